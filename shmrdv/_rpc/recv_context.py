"""What a receive is given by the client that starts it (``CallContext``, ``Address``).

``call.Recv`` and its phases (``recv_unary``, ``recv_stream``) use the client only
through ``CallContext``: the channels (``channels.ChannelCache``), the acks
(``acks.AckQueue``), the callback threads (``runner.Runner``), the call metadata and
inline limit, and the client's books (``forget``, ``count``). ``new_request_id`` draws
the request ids of the client's receives.

Thread model (``docs/threads.md``): none of its own; the context is immutable.
"""

from __future__ import annotations

import dataclasses
import os
import random
import secrets
from collections.abc import Callable, Sequence
from typing import Any

from .._keys import ParsedKey
from .acks import AckQueue
from .channels import ChannelCache
from .runner import Runner

__all__ = ["Address", "CallContext", "new_request_id"]

# Request ids need to be unique, not secret: a generator seeded from the OS (again in a
# forked child) costs no syscall per receive, as secrets.randbits would. Callers make
# them odd, so never 0 (TensorFlow: GetUniqueRequestId, a random non-zero int64).
_ids = random.Random(secrets.randbits(128))
os.register_at_fork(after_in_child=lambda: _ids.seed(secrets.randbits(128)))
#: ``new_request_id(63) | 1``: a fresh request id (the generator's own method: no frame).
new_request_id = _ids.getrandbits

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
