"""The public API is exactly what __init__ exports (STYLE.md rule 1)."""

from __future__ import annotations

import shmrdv

EXPECTED = {
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
}


def test_exports_all_is_pinned() -> None:
    assert set(shmrdv.__all__) == EXPECTED
    assert len(shmrdv.__all__) == len(set(shmrdv.__all__))


def test_exports_every_name_exists_and_shows_the_public_module() -> None:
    for name in shmrdv.__all__:
        obj = getattr(shmrdv, name)
        if isinstance(obj, type):
            assert obj.__module__ == "shmrdv", (name, obj.__module__)


def test_exports_no_private_module_leaks() -> None:
    public = {n for n in vars(shmrdv) if not n.startswith(("_", "@"))}
    assert public - set(shmrdv.__all__) <= {"testing", "pytest_plugin", "annotations"}


def test_exports_error_tree_reuses_builtins() -> None:
    assert issubclass(shmrdv.InvalidArgumentError, ValueError)
    assert issubclass(shmrdv.DeadlineExceededError, TimeoutError)
    assert issubclass(shmrdv.UnavailableError, ConnectionError)
    for name in ("AbortedError", "CancelledError", "ResourceExhaustedError", "InternalError"):
        assert issubclass(getattr(shmrdv, name), shmrdv.RendezvousError)


def test_exports_py_typed_ships() -> None:
    import pathlib

    assert (pathlib.Path(shmrdv.__file__).parent / "py.typed").exists()
