"""The context-manager protocol of an object with ``close``: ``with X(...) as x`` closes it."""

from __future__ import annotations

from typing import TypeVar

__all__ = ["Closing"]

_C = TypeVar("_C", bound="Closing")


class Closing:
    """Mixin for a class that defines ``close``: entering gives the object itself, leaving
    (normally or by an exception, which propagates) calls ``close``."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: _C) -> _C:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
