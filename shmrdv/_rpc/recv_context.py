"""What a receive is given by the client that starts it (``CallContext``, ``Address``).

``call.Recv`` and its phases (``recv_unary``, ``recv_stream``) use the client only
through ``CallContext``: the channels (``channels.ChannelCache``), the acks
(``acks.AckQueue``), the callback threads (``runner.Runner``), the call metadata and
inline limit, and the client's books (``forget``, ``count``).

Thread model: none of its own; the context is immutable.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from .._keys import ParsedKey
from .acks import AckQueue
from .channels import ChannelCache
from .runner import Runner

__all__ = ["Address", "CallContext"]

#: The producer's ``host:port``, or a function that returns it and raises
#: ``UnavailableError`` while it is not known yet (a producer that has not started).
Address = str | Callable[[], str]


@dataclasses.dataclass(frozen=True, slots=True)
class CallContext:
    """What a receive uses of the client that started it."""

    channels: ChannelCache
    acks: AckQueue
    runner: Runner
    metadata: Sequence[tuple[str, str]]
    inline_max: int
    forget: Callable[[Any], None]  # this ``call.Recv`` has ended (delivered, failed, cancelled)
    count: Callable[[ParsedKey, int], None]  # a value of this many bytes was received
