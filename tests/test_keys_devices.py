"""Device names: TensorFlow's ParseFullName / ParseLocalName grammar and canonical form."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shmrdv._errors import InvalidArgumentError
from shmrdv._keys import DeviceName

D = DeviceName


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("/job:worker/replica:0/task:1/device:CPU:0", D("worker", 0, 1, "CPU", 0)),
        ("/job:w/task:1", D("w", None, 1, None, None)),
        ("/job:w_2/replica:3", D("w_2", 3, None, None, None)),
        ("/cpu:0", D(None, None, None, "CPU", 0)),
        ("/CPU:1", D(None, None, None, "CPU", 1)),
        ("/gpu:2", D(None, None, None, "GPU", 2)),
        ("/GPU:3", D(None, None, None, "GPU", 3)),
        ("/job:w/replica:0/task:0/cpu:4", D("w", 0, 0, "CPU", 4)),
        ("/cpu:*", D(None, None, None, "CPU", None)),
        ("/job:*/replica:*/task:*/device:*:*", D(None, None, None, None, None)),
        ("/job:*/task:3", D(None, None, 3, None, None)),
        ("/device:GPU", D(None, None, None, "GPU", None)),
        ("/device:GPU/job:w", D("w", None, None, "GPU", None)),
        ("/device:TPU_SYSTEM:0", D(None, None, None, "TPU_SYSTEM", 0)),
        ("/device:*:2", D(None, None, None, None, 2)),
        ("/device:cpu:0", D(None, None, None, "cpu", 0)),  # TensorFlow keeps the case
        ("", D(None, None, None, None, None)),
        ("/", D(None, None, None, None, None)),
        ("/task:1/job:x/device:CPU:0/replica:2", D("x", 2, 1, "CPU", 0)),
        ("/job:w/task:01", D("w", None, 1, None, None)),
        ("/job:a/job:b", D("b", None, None, None, None)),  # TensorFlow: a repeated part overrides
        ("/cpu:0/device:GPU", D(None, None, None, "GPU", None)),
        (f"/task:{2**63 - 1}", D(None, None, 2**63 - 1, None, None)),
        ("/task:" + "0" * 5000 + "7", D(None, None, 7, None, None)),
    ],
)
def test_parse_accepts_tensorflow_forms(name: str, expected: DeviceName) -> None:
    assert DeviceName.parse(name) == expected


@pytest.mark.parametrize(
    ("name", "fragment"),
    [
        ("/job:1w", "job name '1w'"),
        ("/job:", "job name is empty"),
        ("/job:w-x", "job name 'w-x'"),
        ("/job:*x", "job name '*x'"),
        ("/job:w/", "unexpected '/' at offset 6"),
        ("//", "unexpected '//' at offset 0"),
        ("/job:w/foo:1", "unexpected '/foo:1'"),
        ("/replica:x", "replica 'x' is not a decimal number"),
        ("/task:-1", "task '-1' is not a decimal number"),
        ("/task:+1", "task '+1'"),
        ("/task:1x", "task '1x'"),
        ("/task: 1", "task ' 1'"),
        ("/task:\u0661", "task '\u0661'"),  # Arabic-Indic digit one: ASCII digits only
        ("/task:", "task is empty"),
        (f"/task:{2**63}", "larger than 9223372036854775807"),
        ("/task:" + "9" * 5000, "larger than"),
        ("/device:", "device type is empty"),
        ("/device:0GPU:0", "device type '0GPU'"),
        ("/device:CPU:", "device id is empty"),
        ("/device:CPU:0:1", "device id '0:1'"),
        ("/device:CPU:x", "device id 'x'"),
        ("/cpu", "unexpected '/cpu'"),
        ("/cpu:", "device id is empty"),
        ("/Cpu:0", "unexpected '/Cpu:0'"),
        ("/cpu:0x", "device id '0x'"),
        # TensorFlow's ParseFullName: every part starts with '/'. A local name is refused,
        # and pointed at parse_local (ParseLocalName) when it is one.
        ("gpu:3", "starts with '/'"),
        ("gpu:3", "'gpu:3' is a local name: DeviceName.parse_local reads it"),
        ("CPU:0", "DeviceName.parse_local"),
        ("job:w", "starts with '/'"),
        ("CPU", "starts with '/'"),
        ("0:0", "starts with '/'"),
        (" /cpu:0", "starts with '/'"),
    ],
)
def test_parse_rejects_with_message_naming_the_part(name: str, fragment: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        DeviceName.parse(name)
    message = str(info.value)
    assert fragment in message
    assert message.startswith("Invalid device name ")


def test_parse_error_quotes_a_long_name_shortened() -> None:
    name = "/job:" + "x" * 10_000 + "!"
    with pytest.raises(InvalidArgumentError) as info:
        DeviceName.parse(name)
    assert len(str(info.value)) < 1000
    assert "10006 characters" in str(info.value)


@pytest.mark.parametrize("bad", [None, 0, b"/cpu:0", ["/cpu:0"], {"job": "w"}])
def test_parse_non_str_raises_invalid_argument(bad: object) -> None:
    with pytest.raises(InvalidArgumentError, match="must be a str"):
        DeviceName.parse(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("CPU:0", D(None, None, None, "CPU", 0)),
        ("XLA_GPU:12", D(None, None, None, "XLA_GPU", 12)),
        ("gpu:3", D(None, None, None, "gpu", 3)),  # ParseLocalName keeps the case
        ("CPU:007", D(None, None, None, "CPU", 7)),
    ],
)
def test_parse_local_accepts_tensorflow_local_names(name: str, expected: DeviceName) -> None:
    assert DeviceName.parse_local(name) == expected


@pytest.mark.parametrize(
    ("name", "fragment"),
    [
        ("/cpu:0", "without a leading '/'"),
        ("/device:CPU:0", "without a leading '/'"),
        ("CPU", "local name 'CPU' lacks ':<n>'"),
        ("CPU:*", "takes no '*' id"),
        ("CPU:-1", "device id '-1'"),
        ("CPU:0/job:w", "device id '0/job:w'"),
        ("CPU:", "device id is empty"),
        ("0:0", "expected a local name"),
        ("", "expected a local name"),
    ],
)
def test_parse_local_rejects_with_message_naming_the_part(name: str, fragment: str) -> None:
    with pytest.raises(InvalidArgumentError, match="Invalid device name") as info:
        DeviceName.parse_local(name)
    assert fragment in str(info.value)


@given(st.text())
def test_parse_refuses_every_name_without_a_leading_slash(text: str) -> None:
    if text.startswith("/") or text == "":
        return
    with pytest.raises(InvalidArgumentError):
        DeviceName.parse(text)


def test_parse_is_cached() -> None:
    name = "/job:cache_check/replica:0/task:3/device:CPU:0"
    assert DeviceName.parse(name) is DeviceName.parse(name)


@given(st.text())
def test_parse_arbitrary_text_raises_only_invalid_argument(text: str) -> None:
    try:
        parsed = DeviceName.parse(text)
    except InvalidArgumentError:
        return
    assert DeviceName.parse(str(parsed)) == parsed


# Text built from the grammar's own pieces reaches far more accepting paths than st.text().
_GRAMMAR = ["/job:", "/replica:", "/task:", "/device:", "/cpu:", "/GPU:", "/", ":", "*", "_"]
_PIECES = st.sampled_from([*_GRAMMAR, "-", "w", "a", "x9", "CPU", "0", "12"])


@given(st.lists(_PIECES, max_size=12).map("".join))
def test_parse_grammar_like_text_round_trips_or_raises(text: str) -> None:
    try:
        parsed = DeviceName.parse(text)
    except InvalidArgumentError:
        return
    assert DeviceName.parse(str(parsed)) == parsed


_IDENTS = st.from_regex(r"[A-Za-z][A-Za-z0-9_]{0,12}", fullmatch=True)
_NUMBERS = st.integers(min_value=0, max_value=2**63 - 1)
_DEVICE_NAMES = st.builds(
    DeviceName,
    st.none() | _IDENTS,
    st.none() | _NUMBERS,
    st.none() | _NUMBERS,
    st.none() | _IDENTS,
    st.none() | _NUMBERS,
)


@given(_DEVICE_NAMES)
def test_str_then_parse_round_trips(name: DeviceName) -> None:
    assert DeviceName.parse(str(name)) == name


@pytest.mark.parametrize(
    ("name", "text"),
    [
        (D("w", 0, 1, "CPU", 0), "/job:w/replica:0/task:1/device:CPU:0"),
        (D("w", None, 1, None, None), "/job:w/task:1"),
        (D(None, None, None, "GPU", None), "/device:GPU:*"),
        (D(None, None, None, None, 3), "/device:*:3"),
        (D(None, None, None, None, None), ""),
    ],
)
def test_str_is_canonical(name: DeviceName, text: str) -> None:
    assert str(name) == text


def test_str_of_legacy_name_is_device_form() -> None:
    assert str(DeviceName.parse("/job:w/replica:0/task:0/cpu:0")) == (
        "/job:w/replica:0/task:0/device:CPU:0"
    )


def test_equality_is_on_parsed_fields() -> None:
    assert DeviceName.parse("/cpu:0") == DeviceName.parse("/device:CPU:0")
    assert DeviceName.parse("/job:w/task:1") != DeviceName.parse("/job:w/task:10")
    assert hash(DeviceName.parse("/CPU:0")) == hash(DeviceName.parse_local("CPU:0"))


def test_task_part_has_only_set_parts() -> None:
    assert DeviceName.parse("/job:w/replica:0/task:1/device:CPU:0").task_part == (
        "/job:w/replica:0/task:1"
    )
    assert DeviceName.parse("/job:w/task:1/device:CPU:0").task_part == "/job:w/task:1"
    assert DeviceName.parse("/device:CPU:0").task_part == ""


def test_has_task_needs_job_and_task() -> None:
    assert DeviceName.parse("/job:w/task:0").has_task
    assert not DeviceName.parse("/job:w/replica:0").has_task
    assert not DeviceName.parse("/task:0/device:CPU:0").has_task


def test_same_task_treats_unset_replica_as_zero() -> None:
    a = DeviceName.parse("/job:w/task:1/device:CPU:0")
    b = DeviceName.parse("/job:w/replica:0/task:1/device:GPU:3")
    assert a.same_task(b) and b.same_task(a)
    assert not a.same_task(DeviceName.parse("/job:w/replica:1/task:1"))


def test_same_task_compares_numbers_not_prefixes() -> None:
    # TensorFlow's IsLocalDevice is a string-prefix test that gets this wrong.
    one = DeviceName.parse("/job:w/replica:0/task:1")
    ten = DeviceName.parse("/job:w/replica:0/task:10/device:CPU:0")
    assert not one.same_task(ten)
    assert not DeviceName.parse("/job:w/task:1").same_task(DeviceName.parse("/job:ww/task:1"))


def test_same_task_false_without_job_or_task() -> None:
    full = DeviceName.parse("/job:w/replica:0/task:0")
    assert not full.same_task(DeviceName.parse("/job:w/replica:0"))
    assert not DeviceName.parse("/replica:0/task:0").same_task(full)
    assert not DeviceName.parse("").same_task(DeviceName.parse(""))


def test_task_key_defaults_replica_to_zero() -> None:
    assert DeviceName.parse("/job:w/task:4/cpu:0").task_key() == ("w", 0, 4)
    assert DeviceName.parse("/job:w/replica:2/task:4").task_key() == ("w", 2, 4)


@pytest.mark.parametrize("name", ["/job:w", "/task:1", "/cpu:0", ""])
def test_task_key_without_task_raises(name: str) -> None:
    with pytest.raises(InvalidArgumentError, match="does not name a task"):
        DeviceName.parse(name).task_key()


def test_with_device_replaces_device_part() -> None:
    base = DeviceName.parse("/job:w/replica:0/task:2/device:CPU:0")
    assert str(base.with_device("GPU", 1)) == "/job:w/replica:0/task:2/device:GPU:1"
    assert str(base.with_device(None, None)) == "/job:w/replica:0/task:2"
    with pytest.raises(InvalidArgumentError, match="field type"):
        base.with_device("G P U", 1)
    with pytest.raises(InvalidArgumentError, match="field id"):
        base.with_device("GPU", -1)


@pytest.mark.parametrize(
    "fields",
    [
        ("1w", None, None, None, None),
        ("", None, None, None, None),
        (None, -1, None, None, None),
        (None, None, 2**63, None, None),
        (None, None, True, None, None),
        (None, None, 1.0, None, None),
        (None, None, None, "C;PU", None),
        (None, None, None, None, "0"),
    ],
)
def test_constructor_rejects_unspellable_fields(fields: tuple[object, ...]) -> None:
    with pytest.raises(InvalidArgumentError, match="device name field"):
        DeviceName(*fields)  # type: ignore[arg-type]


def test_device_name_is_frozen() -> None:
    name = DeviceName.parse("/job:w/task:0")
    with pytest.raises(AttributeError):
        name.job = "x"  # type: ignore[misc]
