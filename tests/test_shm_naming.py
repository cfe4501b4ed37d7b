"""Tests of shmrdv._shm.naming: pure name building and parsing."""

from __future__ import annotations

import hashlib
import pickle
import re
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shmrdv import namespace_id
from shmrdv._errors import InvalidArgumentError
from shmrdv._shm.naming import DIGEST_BYTES, SHM_DIR, Names, ObjectName, parse_name

NS = "abcdefghijklmnopqrstuvwxyz"
NSID = namespace_id(NS)
TASK = "/job:w/replica:0/task:1"
KEY = (
    "/job:w/replica:0/task:0/device:CPU:0;0000000000000001;"
    "/job:w/replica:0/task:1/device:CPU:0;x;0:0"
)
_SAFE = re.compile(r"[a-z0-9_]+")


def _names() -> Names:
    return Names(NS)


def test_names_namespace_invalid_rejected() -> None:
    for bad in ["", "short", "UPPERCASEUPPER", "with_underscore", "a" * 65, "héllo123"]:
        with pytest.raises(InvalidArgumentError, match="namespace"):
            Names(bad)
    Names("a" * 8)
    Names("0" * 64)


def test_names_all_kinds_round_trip_through_parse_name() -> None:
    n = _names()
    inc = 0xDEADBEEF01234567
    cases: list[tuple[str, str]] = [
        (n.presence(TASK), "presence"),
        ("sem." + n.bell(TASK)[1:], "bell"),
        (n.temp(), "temp"),
        (n.message(7, KEY, inc, 3), "message"),
        (n.pool(TASK, inc, 5), "pool"),
        (n.held(TASK, inc, 5), "held"),
        (n.returned(TASK, inc, 5), "returned"),
    ]
    for entry, kind in cases:
        parsed = parse_name(entry)
        assert parsed is not None, entry
        assert parsed.kind == kind
        assert parsed.namespace == NSID
        assert parsed.entry == entry
        assert len(entry) < 100
        assert _SAFE.fullmatch(entry.removeprefix("sem.")), entry
        # Nothing of the token, the task, the incarnation or the slot is in clear.
        assert NS not in entry and f"{inc:016x}" not in entry and "x5" not in entry


def test_names_bell_name_and_path_agree() -> None:
    n = _names()
    assert n.bell(TASK).startswith("/shmrdv_" + NSID + "_b")
    assert n.bell_path(TASK) == f"{SHM_DIR}/sem.{n.bell(TASK)[1:]}"
    assert n.bell(TASK)[len(n.prefix) + 2 :] == n.presence(TASK)[len(n.prefix) + 1 :]


def test_names_path_joins_shm_dir() -> None:
    n = _names()
    name = n.temp()
    assert n.path(name) == f"/dev/shm/{name}"


def test_names_hashes_are_deterministic_and_distinct() -> None:
    n = _names()
    assert n.presence(TASK) == Names(NS).presence(TASK)
    assert n.presence("/job:w/replica:0/task:1") != n.presence("/job:w/replica:0/task:10")
    assert n.message(1, KEY, 2, 3) == n.message(1, KEY, 2, 3)
    variants = {
        n.message(1, KEY, 2, 3),
        n.message(2, KEY, 2, 3),
        n.message(1, KEY + "x", 2, 3),
        n.message(1, KEY, 3, 3),
        n.message(1, KEY, 2, 4),
        n.message(-1, KEY, 2, 3),
    }
    assert len(variants) == 6
    assert Names("b" * 26).message(1, KEY, 2, 3) != n.message(1, KEY, 2, 3)


def test_names_temp_is_random() -> None:
    n = _names()
    assert len({n.temp() for _ in range(100)}) == 100


def test_names_out_of_range_fields_rejected() -> None:
    n = _names()
    with pytest.raises(InvalidArgumentError):
        n.message(2**63, KEY, 0, 0)
    with pytest.raises(InvalidArgumentError):
        n.message(0, KEY, -1, 0)
    with pytest.raises(InvalidArgumentError):
        n.message(0, KEY, 0, 2**64)
    with pytest.raises(InvalidArgumentError):
        n.pool(TASK, 2**64, 0)
    with pytest.raises(InvalidArgumentError):
        n.held(TASK, 0, -1)
    with pytest.raises(InvalidArgumentError):
        n.returned(TASK, 0, 2**64)
    with pytest.raises(InvalidArgumentError):
        n.presence("")


@pytest.mark.parametrize(
    "entry",
    [
        "",
        "shmrdv_",
        "shmrdv_" + NSID,
        "shmrdv_" + NSID + "_",
        "shmrdv_" + NSID + "_z0123456789abcdef0123",
        "shmrdv_" + NSID + "_m0123456789abcdef012",  # one hex digit short
        "shmrdv_" + NSID + "_m0123456789abcdef01234",  # one too many
        "shmrdv_" + NSID + "_m0123456789ABCDEF0123",  # upper case
        "shmrdv_" + NSID + "_b0123456789abcdef0123",  # a bell without sem.
        "sem.shmrdv_" + NSID + "_m0123456789abcdef0123",  # sem. on a segment
        "shmrdv_" + NSID + "_p0123456789abcdef0123x1",  # the old slot form
        "shmrdv_" + NS + "_m0123456789abcdef0123",  # a token where the id belongs
        "shmrdv_" + NSID[:-1] + "_m0123456789abcdef0123",
        "shmrdv_" + NSID.upper() + "_m0123456789abcdef0123",
        "other_" + NSID + "_m0123456789abcdef0123",
        "sem.other",
        "psm_1234",
    ],
)
def test_parse_name_foreign_entries_are_none(entry: str) -> None:
    assert parse_name(entry) is None


def test_parse_name_returns_object_name() -> None:
    name = _names().pool(TASK, 1, 0)
    parsed = parse_name(name)
    assert parsed == ObjectName(name, "pool", NSID, name.rsplit("_", 1)[1][1:])


@given(st.text(max_size=120))
def test_parse_name_fuzz_never_raises(entry: str) -> None:
    parsed = parse_name(entry)
    if parsed is not None:
        assert parsed.entry == entry


@given(
    st.from_regex(r"[a-z0-9]{8,64}", fullmatch=True),
    st.integers(0, 2**64 - 1),
    st.integers(0, 2**64 - 1),
    st.integers(-(2**63), 2**63 - 1),
    st.text(max_size=300),
)
def test_names_fuzz_round_trip(ns: str, inc: int, slot: int, step: int, key: str) -> None:
    n = Names(ns)
    names = (n.pool(TASK, inc, slot), n.held(TASK, inc, slot), n.returned(TASK, inc, slot))
    for entry in names:
        parsed = parse_name(entry)
        assert parsed is not None
        assert parsed.namespace == n.namespace_id == namespace_id(ns)
        assert len(entry) < 100
    msg = n.message(step, key, inc, slot)
    assert len(n.presence(key or "t")) < 100
    parsed = parse_name(msg)
    assert parsed is not None and parsed.kind == "message" and len(msg) < 100


def test_names_pool_slots_differ_between_producers_of_one_incarnation() -> None:
    n = _names()
    other = "/job:w/replica:0/task:2"
    for kind in (n.pool, n.held, n.returned):
        assert kind(TASK, 1, 0) != kind(other, 1, 0)


def _keyed(token: str, person: bytes, data: bytes) -> str:
    return hashlib.blake2b(
        data, digest_size=DIGEST_BYTES, key=token.encode(), person=person
    ).hexdigest()


def test_names_are_keyed_by_the_token() -> None:
    """Issue 13 §2: every part but the public id is a blake2b keyed by the token."""
    n = _names()
    raw = TASK.encode()
    task = struct.pack("<Q", len(raw)) + raw
    assert n.presence(TASK) == f"shmrdv_{NSID}_w" + _keyed(NS, b"shmrdv.task", task)
    assert n.bell(TASK) == f"/shmrdv_{NSID}_b" + _keyed(NS, b"shmrdv.task", task)
    slot = task + struct.pack("<QQ", 7, 3)
    assert n.pool(TASK, 7, 3) == f"shmrdv_{NSID}_p" + _keyed(NS, b"shmrdv.pool", slot)
    assert n.held(TASK, 7, 3) == f"shmrdv_{NSID}_h" + _keyed(NS, b"shmrdv.held", slot)
    assert n.returned(TASK, 7, 3) == f"shmrdv_{NSID}_r" + _keyed(NS, b"shmrdv.returned", slot)
    key = KEY.encode()
    msg = struct.pack("<qQQQ", 1, 2, 3, len(key)) + key
    assert n.message(1, KEY, 2, 3) == f"shmrdv_{NSID}_m" + _keyed(NS, b"shmrdv.message", msg)


def test_names_of_another_token_share_nothing_but_their_shape() -> None:
    """Knowing the id (or a name of one token) predicts no name of another token."""
    a, b = _names(), Names("b" * 26)
    for kind in (a.presence, b.presence):
        assert kind(TASK).startswith(("shmrdv_" + a.namespace_id, "shmrdv_" + b.namespace_id))
    pairs = [
        (a.presence(TASK), b.presence(TASK)),
        (a.message(1, KEY, 2, 3), b.message(1, KEY, 2, 3)),
        (a.ring(TASK, 1, TASK), b.ring(TASK, 1, TASK)),
        (a.pool(TASK, 1, 0), b.pool(TASK, 1, 0)),
    ]
    for x, y in pairs:
        assert x.rsplit("_", 1)[1][1:] != y.rsplit("_", 1)[1][1:]
    # An attacker who takes the visible id for a token gets other names entirely.
    fake = Names(a.namespace_id)
    assert fake.prefix != a.prefix and fake.presence(TASK) != a.presence(TASK)


def test_names_slot_states_are_unlinkable() -> None:
    """A free slot's name does not tell its held or returned name (each is keyed apart)."""
    n = _names()
    rests = {name.rsplit("_", 1)[1][1:] for name in (n.pool(TASK, 1, 0), n.held(TASK, 1, 0))}
    rests.add(n.returned(TASK, 1, 0).rsplit("_", 1)[1][1:])
    assert len(rests) == 3


def test_names_repr_hides_the_token() -> None:
    assert NS not in repr(_names()) and NSID in repr(_names())


def test_names_pickle_and_interleaved_tokens_keep_their_digests() -> None:
    """The keyed digest states are cached per (token, person) outside ``Names``: a
    ``Names`` stays plain data (it pickles, for a spawned child), and names of two tokens
    computed in turn still match the ones computed alone (``test_names_are_keyed_...``)."""
    a, b = _names(), Names("b" * 26)
    alone = [a.held(TASK, 7, 3), b.held(TASK, 7, 3), a.message(1, KEY, 2, 3)]
    for _ in range(3):
        assert [a.held(TASK, 7, 3), b.held(TASK, 7, 3), a.message(1, KEY, 2, 3)] == alone
    again = pickle.loads(pickle.dumps(a))
    assert again == a and hash(again) == hash(a) and again.prefix == a.prefix
    assert again.held(TASK, 7, 3) == alone[0] and again.message(1, KEY, 2, 3) == alone[2]
    slot = struct.pack("<Q", len(TASK.encode())) + TASK.encode() + struct.pack("<QQ", 7, 3)
    assert b.held(TASK, 7, 3) == f"shmrdv_{b.namespace_id}_h" + _keyed(
        "b" * 26, b"shmrdv.held", slot
    )
