"""Namespace tokens: the secret every OS object name shmrdv creates is derived from.

Segments and semaphores live in /dev/shm, which every local user can list. One job's
workers share a secret random token; a name is ``shmrdv_<namespace id>_<kind><hash>``
where the *namespace id* is a public digest of the token (tools list and collect by it)
and the hash is keyed by the token, so reading a listing lets another user neither find
the token nor predict, squat or plant a name of the job (DESIGN.md, "Names and keys").
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import secrets
from collections.abc import Mapping

from ._errors import InvalidArgumentError

__all__ = [
    "ENV_VAR",
    "NAMESPACE_ID_HEX",
    "describe_bad_token",
    "namespace_id",
    "new_namespace",
    "resolve_namespace",
]

ENV_VAR = "SHMRDV_NAMESPACE"

# 128 bits cannot be enumerated; base32 (lowercased, unpadded) spells them in 26
# characters of [a-z2-7], safe in any file or semaphore name.
_TOKEN_BYTES = 16
# Tokens go into /dev/shm and semaphore names (NAME_MAX 255 bytes, shared with the
# prefix and the key digest), so keep them short and to one safe alphabet.
_VALID = re.compile(r"[a-z0-9]{8,64}")

#: A namespace id is 8 bytes of blake2b (16 hex characters): enough to tell a host's jobs
#: apart, short enough to leave room in a name; it is public, so its size is no secret.
NAMESPACE_ID_HEX = 16
_ID_PERSON = b"shmrdv.nsid"

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


def namespace_id(token: str) -> str:
    """The public id of the namespace ``token``: 16 lowercase hex characters.

    It prefixes every object of the job in /dev/shm (``shmrdv_<id>_...``) and is what
    ``shmrdv ls`` shows and ``shmrdv gc --namespace`` accepts; it reveals nothing that
    helps find the token (a one-way digest of 128 random bits). Raises
    ``InvalidArgumentError`` if ``token`` is not a valid token.
    """
    if token is None:
        raise InvalidArgumentError("namespace_id() needs a namespace token, not None")
    token = resolve_namespace(token)
    digest = hashlib.blake2b(
        token.encode("ascii"), digest_size=NAMESPACE_ID_HEX // 2, person=_ID_PERSON
    )
    return digest.hexdigest()


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
            f"{source} is not a valid namespace token ({describe_bad_token(namespace)}): it "
            f"must be 8 to 64 lowercase letters or digits ([a-z0-9]); {_HOW_TO_GET_ONE}"
        )
    return namespace


# At most this many of a bad token's characters are named in a message.
_MAX_NAMED_CHARS = 5


def describe_bad_token(value: object) -> str:
    """``value``, refused as a namespace token, described without echoing it.

    A near miss (a token read with its trailing newline, or in upper case) is as secret as
    the token itself, and messages reach logs: say its type or length and which characters
    are not allowed, never the value.
    """
    if not isinstance(value, str):
        return f"a {type(value).__name__}, not a str"
    bad = sorted({c for c in value if not ("a" <= c <= "z" or "0" <= c <= "9")})
    text = f"a string of {len(value)} characters"
    if bad:
        named = ", ".join(repr(c) for c in bad[:_MAX_NAMED_CHARS])
        more = ", ..." if len(bad) > _MAX_NAMED_CHARS else ""
        text += f", with {named}{more} among them"
    return text
