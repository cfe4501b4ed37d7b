"""Reading a ``grpc.RpcError``: its status code and its details, whatever raised it.

A call's error is usually a ``grpc.Call`` too, but not always (a channel closed under
the call raises a bare ``RpcError``): these never fail. Pure; no thread model.
"""

from __future__ import annotations

import grpc

__all__ = ["error_code", "error_details"]


def error_details(e: grpc.RpcError) -> str:
    """The error's details, else its text."""
    details = e.details() if hasattr(e, "details") else None
    return details or str(e)


def error_code(e: grpc.RpcError) -> grpc.StatusCode:
    """The error's status code; ``UNKNOWN`` when it carries none."""
    code = e.code() if hasattr(e, "code") else None
    return code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.UNKNOWN
