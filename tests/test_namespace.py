"""Namespace tokens: random, shm-name safe, resolved from argument or environment."""

from __future__ import annotations

import hashlib
import re

import pytest

import shmrdv
from shmrdv._cluster import ENV_VAR, namespace_ids, new_namespace, resolve_namespace
from shmrdv._errors import InvalidArgumentError


def test_new_namespace_is_26_lowercase_letters_and_digits() -> None:
    token = new_namespace()
    assert re.fullmatch(r"[a-z2-7]{26}", token), token
    assert resolve_namespace(token) == token


def test_new_namespace_is_random() -> None:
    tokens = {new_namespace() for _ in range(1000)}
    assert len(tokens) == 1000


def test_resolve_namespace_prefers_the_argument() -> None:
    assert resolve_namespace("abcdefgh", {ENV_VAR: "zzzzzzzz"}) == "abcdefgh"


def test_resolve_namespace_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_namespace(None, {ENV_VAR: "0123456789"}) == "0123456789"
    monkeypatch.setenv(ENV_VAR, "fromosenviron")
    assert resolve_namespace(None) == "fromosenviron"


@pytest.mark.parametrize("environ", [{}, {ENV_VAR: ""}])
def test_resolve_namespace_missing_says_how_to_get_one(environ: dict[str, str]) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        resolve_namespace(None, environ)
    message = str(info.value)
    assert "shmrdv.new_namespace()" in message
    assert f"export {ENV_VAR}=$(python -m shmrdv namespace)" in message


@pytest.mark.parametrize(
    "token",
    ["short", "a" * 65, "ABCDEFGH", "abcd-efgh", "abcd/efgh", "abcdefgh\n", "abcdéfgh", ""],
)
def test_resolve_namespace_rejects_unsafe_tokens(token: str) -> None:
    with pytest.raises(InvalidArgumentError, match=r"8 to 64 lowercase letters or digits"):
        resolve_namespace(token)


def test_resolve_namespace_rejects_unsafe_env_token_naming_the_variable() -> None:
    with pytest.raises(InvalidArgumentError, match=f"environment variable {ENV_VAR} is not"):
        resolve_namespace(None, {ENV_VAR: "BAD"})


def test_resolve_namespace_bad_token_described_not_echoed() -> None:
    # A near miss of a real token (read with its newline, upper-cased) is as secret as it.
    token = new_namespace()
    with pytest.raises(InvalidArgumentError) as info:
        resolve_namespace(token + "\n")
    text = str(info.value)
    assert token not in text
    assert f"a string of {len(token) + 1} characters, with '\\n' among them" in text
    with pytest.raises(InvalidArgumentError) as info:
        resolve_namespace(token.upper())
    assert token.upper() not in str(info.value)


def test_resolve_namespace_rejects_non_str() -> None:
    with pytest.raises(InvalidArgumentError, match="must be a str or None, not bytes"):
        resolve_namespace(b"abcdefgh")  # type: ignore[arg-type]


def test_resolve_namespace_accepts_bounds() -> None:
    assert resolve_namespace("a" * 8) == "a" * 8
    assert resolve_namespace("9" * 64) == "9" * 64


def test_namespace_id_is_a_public_digest_of_the_token() -> None:
    token = new_namespace()
    nsid = shmrdv.namespace_id(token)
    assert re.fullmatch(r"[0-9a-f]{16}", nsid)
    assert nsid == shmrdv.namespace_id(token)
    assert nsid != shmrdv.namespace_id(new_namespace())
    assert nsid == hashlib.blake2b(token.encode(), digest_size=8, person=b"shmrdv.nsid").hexdigest()
    assert token not in nsid


@pytest.mark.parametrize("token", [None, "", "short", "UPPER_CASE_TOKEN", 12345678])
def test_namespace_id_rejects_what_is_not_a_token(token: object) -> None:
    with pytest.raises(shmrdv.InvalidArgumentError, match="namespace"):
        shmrdv.namespace_id(token)  # type: ignore[arg-type]


def test_namespace_ids_may_be_a_token_or_an_id() -> None:
    token = shmrdv.new_namespace()
    nsid = shmrdv.namespace_id(token)
    assert namespace_ids(token) == {nsid}
    # 16 hex characters are also a valid token: both readings are kept.
    assert namespace_ids(nsid) == {nsid, shmrdv.namespace_id(nsid)}
    for bad in ("", "NOT-A-NAMESPACE", "short", "0123456789abcdeF"):
        with pytest.raises(shmrdv.InvalidArgumentError, match="namespace"):
            namespace_ids(bad)
