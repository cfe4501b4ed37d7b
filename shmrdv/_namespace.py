"""Namespace tokens: the unguessable part of every OS object name shmrdv creates.

Segments and semaphores are named ``shmrdv_<namespace>...`` in /dev/shm, which every
local user can list. A secret random token shared by one job's workers means other
users can neither guess a name to read nor create one first to squat it
(DESIGN.md, "Segments are created 0600 with O_EXCL; names carry an unguessable
namespace token").
"""

from __future__ import annotations

import base64
import os
import re
import secrets
from collections.abc import Mapping

from ._devices import _quote
from ._errors import InvalidArgumentError

__all__ = ["ENV_VAR", "new_namespace", "resolve_namespace"]

ENV_VAR = "SHMRDV_NAMESPACE"

# 128 bits cannot be enumerated; base32 (lowercased, unpadded) spells them in 26
# characters of [a-z2-7], safe in any file or semaphore name.
_TOKEN_BYTES = 16
# Tokens go into /dev/shm and semaphore names (NAME_MAX 255 bytes, shared with the
# prefix and the key digest), so keep them short and to one safe alphabet.
_VALID = re.compile(r"[a-z0-9]{8,64}")

_HOW_TO_GET_ONE = (
    "call shmrdv.new_namespace() once per job and pass it to every Worker, "
    f"or export {ENV_VAR}=$(python -m shmrdv namespace)"
)


def new_namespace() -> str:
    """A fresh token of 128 random bits from ``secrets``: 26 lowercase letters and digits.

    Create it once per job and give the same token to every worker of the job.
    """
    raw = base64.b32encode(secrets.token_bytes(_TOKEN_BYTES)).decode("ascii")
    return raw.rstrip("=").lower()


def resolve_namespace(namespace: str | None, environ: Mapping[str, str] | None = None) -> str:
    """The namespace to use: ``namespace`` if given, else env ``SHMRDV_NAMESPACE``.

    ``environ`` defaults to ``os.environ``; an empty variable counts as unset. Raises
    ``InvalidArgumentError`` if neither is set (saying how to get a token) or if the
    token is not 8 to 64 characters of ``[a-z0-9]``.
    """
    source = "namespace"
    if namespace is None:
        env = os.environ if environ is None else environ
        namespace = env.get(ENV_VAR) or None
        source = f"environment variable {ENV_VAR}"
        if namespace is None:
            raise InvalidArgumentError(
                f"no shmrdv namespace given and {ENV_VAR} is not set: {_HOW_TO_GET_ONE}"
            )
    if not isinstance(namespace, str):
        raise InvalidArgumentError(
            f"namespace must be a str or None, not {type(namespace).__name__}"
        )
    if _VALID.fullmatch(namespace) is None:
        raise InvalidArgumentError(
            f"{source} {_quote(namespace)} is not a valid namespace token: it must be 8 to 64 "
            f"lowercase letters or digits ([a-z0-9]); {_HOW_TO_GET_ONE}"
        )
    return namespace
