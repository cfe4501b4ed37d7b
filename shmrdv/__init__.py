"""shmrdv: TensorFlow-style rendezvous for numpy arrays across threads, processes and hosts.

A producer ``send``s an array under a rendezvous key; a consumer ``recv``s it. Same
process: an in-memory table; same host: a POSIX shared-memory segment named by the key,
woken by a semaphore; other host: a gRPC pull in TensorFlow's ``RecvTensor`` format. The
key's devices choose the transport. See README.md and docs/api.md.
"""

from __future__ import annotations

__version__ = "0.1.0.dev0"

from ._cluster import ClusterSpec, namespace_id, new_namespace
from ._errors import (
    AbortedError,
    CancelledError,
    DeadlineExceededError,
    InternalError,
    InvalidArgumentError,
    RendezvousError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
)
from ._keys import DeviceName, ParsedKey, create_key, parse_key
from ._rendezvous import LocalRendezvous, Received, Rendezvous
from ._rpc.guard import TLSConfig
from ._worker import Worker

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
    if getattr(_obj, "__module__", "").startswith("shmrdv._"):  # our classes and functions
        _obj.__module__ = __name__
del _name, _obj
