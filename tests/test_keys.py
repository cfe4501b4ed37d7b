"""Rendezvous keys: byte-identical to TensorFlow's CreateKey, parsed as its ParseKey."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from shmrdv._errors import InvalidArgumentError
from shmrdv._keys import DeviceName, ParsedKey, create_key, parse_key

# Seen in a pytorch/xla issue, produced by TensorFlow (research/tf_rendezvous.md §1.1).
TF_KEY = (
    "/job:localservice/replica:0/task:7/device:CPU:0;2845c575404f86b6;"
    "/job:localservice/replica:0/task:7/device:CPU:0;Placeholder_112:0;0:0"
)
CPU0 = "/job:w/replica:0/task:0/device:CPU:0"
CPU1 = "/job:w/replica:0/task:1/device:CPU:0"


def test_parse_key_tensorflow_example() -> None:
    pk = parse_key(TF_KEY)
    device = "/job:localservice/replica:0/task:7/device:CPU:0"
    assert pk == ParsedKey(
        src_device=device,
        src_incarnation=0x2845C575404F86B6,
        dst_device=device,
        edge_name="Placeholder_112:0",
        frame_iter=(0, 0),
        src=DeviceName("localservice", 0, 7, "CPU", 0),
        dst=DeviceName("localservice", 0, 7, "CPU", 0),
        full_key=TF_KEY,
    )
    assert str(pk) == TF_KEY


def test_create_key_tensorflow_example_is_byte_identical() -> None:
    device = "/job:localservice/replica:0/task:7/device:CPU:0"
    key = create_key(device, 0x2845C575404F86B6, device, "Placeholder_112:0", (0, 0))
    assert key == TF_KEY


def test_create_key_pads_incarnation_to_16_lowercase_hex() -> None:
    assert create_key(CPU0, 1, CPU1, "edge_30_Assign_1") == (
        f"{CPU0};0000000000000001;{CPU1};edge_30_Assign_1;0:0"
    )
    assert create_key("", 2**64 - 1, "", "x", (7, -1)) == ";ffffffffffffffff;;x;7:-1"
    assert create_key(CPU0, 0xABCDEF, CPU1, "e").split(";")[1] == "0000000000abcdef"


def test_create_key_keeps_device_text_as_given() -> None:
    # CreateKey concatenates; it does not canonicalise (legacy names stay legacy).
    assert create_key("/cpu:0", 0, "/job:w/task:1/gpu:0", "e").startswith("/cpu:0;")
    assert create_key(DeviceName.parse("/cpu:0"), 0, CPU1, "e").startswith("/device:CPU:0;")


def test_create_key_accepts_numpy_integers() -> None:
    key = create_key(CPU0, np.uint64(2**64 - 1), CPU1, "e", (np.int64(3), np.int32(-1)))
    assert key == f"{CPU0};ffffffffffffffff;{CPU1};e;3:-1"


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        ((CPU0, -1, CPU1, "e"), "uint64"),
        ((CPU0, 2**64, CPU1, "e"), "uint64"),
        ((CPU0, True, CPU1, "e"), "not bool"),
        ((CPU0, 1.0, CPU1, "e"), "must be an integer, not float"),
        ((CPU0, "1", CPU1, "e"), "must be an integer, not str"),
        ((CPU0, 1, CPU1, ""), "edge name is empty"),
        ((CPU0, 1, CPU1, "a;b"), "contains ';'"),
        ((CPU0, 1, CPU1, "a\ud800"), "not encodable as UTF-8"),
        ((CPU0, 1, CPU1, b"e"), "edge name must be a str"),
        ((CPU0 + ";", 1, CPU1, "e"), "src_device '/job:w/replica:0/task:0/device:CPU:0;'"),
        ((CPU0, 1, "/job:w;", "e"), "dst_device '/job:w;' contains ';'"),
        (("/job:1", 1, CPU1, "e"), "src_device: Invalid device name '/job:1'"),
        ((CPU0, 1, "CPU:0", "e"), "dst_device: Invalid device name 'CPU:0'"),
        ((None, 1, CPU1, "e"), "src_device must be a str"),
        (([CPU0], 1, CPU1, "e"), "src_device must be a str"),
        ((CPU0, 1, {CPU1: 1}, "e"), "dst_device must be a str"),
        ((CPU0, 1, CPU1, "e", (0,)), "frame_iter must be a tuple"),
        ((CPU0, 1, CPU1, "e", [0, 0]), "frame_iter must be a tuple"),
        ((CPU0, 1, CPU1, "e", (-1, 0)), "frame_id must be a uint64"),
        ((CPU0, 1, CPU1, "e", (2**64, 0)), "frame_id must be a uint64"),
        ((CPU0, 1, CPU1, "e", (0, 2**63)), "iter_id must be an int64"),
        ((CPU0, 1, CPU1, "e", (0, -(2**63) - 1)), "iter_id must be an int64"),
        ((CPU0, 1, CPU1, "e", (0, 0.5)), "iter_id) must be an integer"),
    ],
)
def test_create_key_rejects_bad_fields(args: tuple[object, ...], fragment: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        create_key(*args)  # type: ignore[arg-type]
    assert fragment in str(info.value)


def test_parse_key_accepts_empty_devices_as_unset() -> None:
    # TensorFlow: an empty src means "implicit local device".
    pk = parse_key(";00000000000000ff;;e;0:0")
    assert pk.src == pk.dst == DeviceName(None, None, None, None, None)
    assert pk.src_device == pk.dst_device == ""
    assert pk.src_incarnation == 255


def test_parse_key_accepts_upper_case_and_short_hex() -> None:
    # TensorFlow HexStringToUint64 takes either case and any length from 1.
    assert parse_key(f"{CPU0};ABCdef;{CPU1};e;0:0").src_incarnation == 0xABCDEF
    assert parse_key(f"{CPU0};0;{CPU1};e;0:0").src_incarnation == 0


def test_parse_key_keeps_key_text_and_frame_iter() -> None:
    key = f"/cpu:0;1;{CPU1};edge_1_x;18446744073709551615:-1"
    pk = parse_key(key)
    assert pk.frame_iter == (2**64 - 1, -1)
    assert pk.src_device == "/cpu:0"
    assert pk.src == DeviceName(None, None, None, "CPU", 0)
    assert pk.full_key == key


@pytest.mark.parametrize(
    ("key", "fragment"),
    [
        ("", "has 1 ';'-separated parts, expected 5"),
        (f"{CPU0};1;{CPU1};e", "has 4 ';'-separated parts, expected 5"),
        (f"{CPU0};1;{CPU1};e;0:0;x", "has 6 ';'-separated parts"),
        (f"{CPU0};1;{CPU1};e;0:0;", "has 6 ';'-separated parts"),
        (f"/job:1;1;{CPU1};e;0:0", "part 1 (src_device) '/job:1' is not a device name: job name"),
        (f"CPU:0;1;{CPU1};e;0:0", "part 1 (src_device) 'CPU:0' is not a device name"),
        (f"{CPU0};;{CPU1};e;0:0", "part 2 (src_incarnation) is empty"),
        (f"{CPU0};xyz;{CPU1};e;0:0", "part 2 (src_incarnation) 'xyz' is not hexadecimal"),
        (f"{CPU0};0x1;{CPU1};e;0:0", "part 2 (src_incarnation) '0x1' is not hexadecimal"),
        (f"{CPU0};-1;{CPU1};e;0:0", "'-1' is not hexadecimal"),
        (f"{CPU0};{'f' * 17};{CPU1};e;0:0", "more than 16 hex digits"),
        (f"{CPU0};1;/job:w/task:x;e;0:0", "part 3 (dst_device) '/job:w/task:x' is not a device"),
        (f"{CPU0};1;{CPU1};;0:0", "part 4 (edge_name) is empty"),
        (f"{CPU0};1;{CPU1};a\udc80;0:0", "part 4 (edge_name) 'a\\udc80' is not encodable"),
        (f"{CPU0};1;{CPU1};e;", "part 5 (frame_iter) is empty"),
        (f"{CPU0};1;{CPU1};e;0", "part 5 (frame_iter) '0' is not <frame_id>:<iter_id>"),
        (f"{CPU0};1;{CPU1};e;0:0:0", "'0:0:0' is not <frame_id>:<iter_id>"),
        (f"{CPU0};1;{CPU1};e;-1:0", "'-1:0' is not"),
        (f"{CPU0};1;{CPU1};e;a:b", "'a:b' is not"),
        (f"{CPU0};1;{CPU1};e; 0:0", "' 0:0' is not"),
        (f"{CPU0};1;{CPU1};e;\u0661:0", "is not <frame_id>:<iter_id>"),
        (f"{CPU0};1;{CPU1};e;18446744073709551616:0", "is out of range"),
        (f"{CPU0};1;{CPU1};e;0:9223372036854775808", "is out of range"),
        (f"{CPU0};1;{CPU1};e;0:{'1' * 20}", "is not <frame_id>:<iter_id>"),
    ],
)
def test_parse_key_rejects_naming_the_part(key: str, fragment: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        parse_key(key)
    message = str(info.value)
    assert message.startswith("Invalid rendezvous key ")
    assert fragment in message


def test_parse_key_error_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="Invalid rendezvous key"):
        parse_key("nope")


@pytest.mark.parametrize("bad", [None, 1, b"a;1;b;c;0:0"])
def test_parse_key_non_str_raises_invalid_argument(bad: object) -> None:
    with pytest.raises(InvalidArgumentError, match="must be a str"):
        parse_key(bad)  # type: ignore[arg-type]


def test_parse_key_remembers_the_ends_not_the_keys() -> None:
    # A key per item (a scatter/gather) parses by one split and two lookups: what its
    # devices and frame parse to is kept once, and no key string is kept at all.
    from shmrdv import _keys

    first = parse_key(create_key(CPU0, 99, CPU1, "item_0"))
    ends, frames = len(_keys._ends), len(_keys._frames)
    for i in range(1, 2000):
        pk = parse_key(create_key(CPU0, 99, CPU1, f"item_{i}"))
        assert pk.src is first.src and pk.dst is first.dst and pk.edge_name == f"item_{i}"
    assert (len(_keys._ends), len(_keys._frames)) == (ends, frames)
    assert parse_key(first.full_key) == first


@given(st.text())
def test_parse_key_arbitrary_text_raises_only_invalid_argument(text: str) -> None:
    try:
        pk = parse_key(text)
    except InvalidArgumentError:
        return
    assert pk.full_key == text


_PIECES = st.sampled_from([";", "/job:w", "/task:1", "/cpu:0", "0", "ff", "e", ":", "-1", "x"])


@given(st.lists(_PIECES, max_size=16).map("".join))
def test_parse_key_keylike_text_raises_only_invalid_argument(text: str) -> None:
    try:
        pk = parse_key(text)
    except InvalidArgumentError:
        return
    assert str(pk) == text


_IDENTS = st.from_regex(r"[A-Za-z][A-Za-z0-9_]{0,8}", fullmatch=True)
_SMALL = st.integers(min_value=0, max_value=2**63 - 1)
_DEVICES = st.builds(
    DeviceName,
    st.none() | _IDENTS,
    st.none() | _SMALL,
    st.none() | _SMALL,
    st.none() | _IDENTS,
    st.none() | _SMALL,
).map(str)
_EDGE_NAMES = st.text(st.characters(exclude_characters=";", exclude_categories=["Cs"]), min_size=1)


@given(
    _DEVICES,
    st.integers(min_value=0, max_value=2**64 - 1),
    _DEVICES,
    _EDGE_NAMES,
    st.tuples(
        st.integers(min_value=0, max_value=2**64 - 1),
        st.integers(min_value=-(2**63), max_value=2**63 - 1),
    ),
)
def test_parse_of_create_round_trips(
    src: str, incarnation: int, dst: str, edge: str, frame_iter: tuple[int, int]
) -> None:
    key = create_key(src, incarnation, dst, edge, frame_iter)
    pk = parse_key(key)
    assert (pk.src_device, pk.src_incarnation, pk.dst_device, pk.edge_name, pk.frame_iter) == (
        src,
        incarnation,
        dst,
        edge,
        frame_iter,
    )
    assert pk.src == DeviceName.parse(src)
    assert pk.dst == DeviceName.parse(dst)
    assert pk.full_key == key
    assert key.split(";")[1] == f"{incarnation:016x}"


@pytest.mark.parametrize("bad", ["bad", "a;b;c;d;e;f", "/job:w/task:0;zz;/job:w/task:1;e;0:0"])
def test_parse_key_error_points_to_create_key(bad: str) -> None:
    with pytest.raises(InvalidArgumentError, match=r"shmrdv\.create_key\("):
        parse_key(bad)


def test_keys_longer_than_every_transport_carries_are_refused_where_made_and_parsed() -> None:
    from shmrdv._keys import MAX_KEY_BYTES

    head = "/job:a/replica:0/task:0/device:CPU:0"
    fits = "x" * (MAX_KEY_BYTES - len(create_key(head, 0, head, "x")) + 1)
    assert len(create_key(head, 0, head, fits).encode()) == MAX_KEY_BYTES
    assert parse_key(create_key(head, 0, head, fits)).edge_name == fits
    for edge in (fits + "x", fits[:-1] + "\u00e9"):  # one byte over, in ASCII or not
        with pytest.raises(InvalidArgumentError, match=f"too long: at most {MAX_KEY_BYTES}"):
            create_key(head, 0, head, edge)
        with pytest.raises(InvalidArgumentError, match=f"too long: at most {MAX_KEY_BYTES}"):
            parse_key(f"{head};0000000000000000;{head};{edge};0:0")
