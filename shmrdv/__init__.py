"""shmrdv: TensorFlow-style rendezvous for numpy arrays across threads, processes and hosts.

A producer ``send``s an array under a rendezvous key and never blocks; a consumer
``recv``s the key. Same process: an in-memory table. Same host: a POSIX shared-memory
segment named by the key, woken by a semaphore, mapped without a copy. Other host: a
gRPC pull with TensorFlow's ``RecvTensor`` wire format. The key's src and dst devices
choose the transport. See README.md.
"""

from __future__ import annotations

__version__ = "0.1.0.dev0"

from ._cluster import ClusterSpec as ClusterSpec
from ._cluster import namespace_id as namespace_id
from ._cluster import new_namespace as new_namespace
from ._errors import AbortedError as AbortedError
from ._errors import CancelledError as CancelledError
from ._errors import DeadlineExceededError as DeadlineExceededError
from ._errors import InternalError as InternalError
from ._errors import InvalidArgumentError as InvalidArgumentError
from ._errors import RendezvousError as RendezvousError
from ._errors import ResourceExhaustedError as ResourceExhaustedError
from ._errors import UnauthenticatedError as UnauthenticatedError
from ._errors import UnavailableError as UnavailableError
from ._keys import DeviceName as DeviceName
from ._keys import ParsedKey as ParsedKey
from ._keys import create_key as create_key
from ._keys import parse_key as parse_key
from ._rendezvous import LocalRendezvous as LocalRendezvous
from ._rendezvous import Received as Received
from ._rendezvous import Rendezvous as Rendezvous
from ._rpc.guard import TLSConfig as TLSConfig
from ._worker import Worker as Worker

__all__ = [
    "AbortedError",
    "CancelledError",
    "ClusterSpec",
    "DeadlineExceededError",
    "DeviceName",
    "InternalError",
    "InvalidArgumentError",
    "LocalRendezvous",
    "ParsedKey",
    "Received",
    "Rendezvous",
    "RendezvousError",
    "ResourceExhaustedError",
    "TLSConfig",
    "UnauthenticatedError",
    "UnavailableError",
    "Worker",
    "__version__",
    "create_key",
    "namespace_id",
    "new_namespace",
    "parse_key",
]

# Tracebacks and reprs show the public path (trio's fixup_module_metadata does the same).
for _name in __all__:
    _obj = globals()[_name]
    if getattr(_obj, "__module__", "").startswith("shmrdv._"):
        try:
            _obj.__module__ = __name__
        except (AttributeError, TypeError):  # pragma: no cover - builtins, functions of C types
            pass
del _name, _obj
