"""ClusterSpec: validation, task lookup, value semantics, TF_CONFIG."""

from __future__ import annotations

import json

import pytest

from shmrdv._cluster import ClusterSpec, split_host_port
from shmrdv._errors import InvalidArgumentError
from shmrdv._keys import DeviceName

SPEC: dict[str, list[str] | dict[int, str]] = {
    "worker": ["hostA:2222", "hostB:2222"],
    "ps": {0: "10.0.0.1:1", 3: "[::1]:2"},
}


def test_cluster_spec_lists_jobs_and_tasks() -> None:
    spec = ClusterSpec(SPEC)
    assert spec.jobs == ["ps", "worker"]
    assert spec.tasks() == [
        "/job:ps/replica:0/task:0",
        "/job:ps/replica:0/task:3",
        "/job:worker/replica:0/task:0",
        "/job:worker/replica:0/task:1",
    ]
    assert spec.tasks("worker") == ["/job:worker/replica:0/task:0", "/job:worker/replica:0/task:1"]
    with pytest.raises(
        InvalidArgumentError, match=r"no job 'chief'; its jobs are \['ps', 'worker'\]"
    ):
        spec.tasks("chief")


@pytest.mark.parametrize(
    "task",
    [
        "/job:worker/replica:0/task:1",
        "/job:worker/task:1",
        "/job:worker/replica:0/task:1/device:CPU:0",
        "/job:worker/task:1/gpu:3",
        DeviceName("worker", None, 1, None, None),
    ],
)
def test_cluster_spec_task_address_accepts_task_and_device_names(task: str | DeviceName) -> None:
    spec = ClusterSpec(SPEC)
    assert spec.task_address(task) == "hostB:2222"
    assert spec.host_of(task) == "hostB"
    assert spec.port_of(task) == 2222
    assert task in spec


def test_cluster_spec_host_and_port_of_ip_addresses() -> None:
    spec = ClusterSpec(SPEC)
    assert spec.host_of("/job:ps/task:0") == "10.0.0.1"
    assert spec.port_of("/job:ps/task:0") == 1
    assert spec.task_address("/job:ps/task:3") == "[::1]:2"
    assert spec.host_of("/job:ps/task:3") == "::1"
    assert spec.port_of("/job:ps/task:3") == 2


def test_cluster_spec_task_1_is_not_task_10() -> None:
    spec = ClusterSpec({"w": {1: "h:1", 10: "h:10"}})
    assert spec.task_address("/job:w/task:1") == "h:1"
    assert spec.task_address("/job:w/task:10") == "h:10"


@pytest.mark.parametrize(
    ("task", "fragment"),
    [
        ("/job:chief/task:0", "no job 'chief' (its jobs are ['ps', 'worker'])"),
        ("/job:worker/task:2", "job 'worker' has replica 0, tasks [0, 1]"),
        ("/job:ps/task:1", "job 'ps' has replica 0, tasks [0, 3]"),
        ("/job:worker/replica:1/task:0", "/job:worker/replica:1/task:0 is not in the cluster"),
        ("/job:worker", "does not name a task"),
        ("/task:0", "does not name a task"),
        ("/job:1", "Invalid device name '/job:1'"),
    ],
)
def test_cluster_spec_task_address_unknown_task_raises(task: str, fragment: str) -> None:
    spec = ClusterSpec(SPEC)
    with pytest.raises(InvalidArgumentError) as info:
        spec.task_address(task)
    assert fragment in str(info.value)
    assert task not in spec


@pytest.mark.parametrize("thing", [None, 0, b"/job:worker/task:0", ("worker", 0)])
def test_cluster_spec_contains_is_false_for_non_names(thing: object) -> None:
    assert thing not in ClusterSpec(SPEC)


@pytest.mark.parametrize(
    "address",
    [
        "host",
        "host:",
        ":80",
        "host:65536",
        "host:-1",
        "host:+1",
        "host: 1",
        "host:80x",
        "a b:1",
        "host/x:1",
        "user@host:1",
        "-host:1",
        "1.2.3.999:1",
        "1.2.3:1",
        "::1:80",
        "[::1]",
        "[::1]80",
        "[zz]:1",
        "[::1:1",
        "",
        "host:\u0661",
    ],
)
def test_cluster_spec_rejects_bad_address(address: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        ClusterSpec({"worker": ["ok:1", address]})
    message = str(info.value)
    assert "/job:worker/replica:0/task:1" in message
    assert repr(address) in message


@pytest.mark.parametrize(
    "address", ["localhost:0", "host-a.example.com:65535", "127.0.0.1:2222", "[fe80::1]:1", "h_1:9"]
)
def test_cluster_spec_accepts_good_address(address: str) -> None:
    assert ClusterSpec({"w": [address]}).task_address("/job:w/task:0") == address


@pytest.mark.parametrize(
    ("cluster", "fragment"),
    [
        ({"1job": ["h:1"]}, "job name '1job'"),
        ({"": ["h:1"]}, "job name ''"),
        ({"a-b": ["h:1"]}, "job name 'a-b'"),
        ({1: ["h:1"]}, "job name 1"),
        ({"w": "h:1"}, "job 'w': expected a list"),
        ({"w": None}, "not NoneType"),
        ({"w": [1]}, "task /job:w/replica:0/task:0: address must be a str"),
        ({"w": {-1: "h:1"}}, "task index -1 is not a non-negative integer"),
        ({"w": {True: "h:1"}}, "task index True"),
        ({"w": {"x": "h:1"}}, "task index 'x'"),
        ({"w": {0: "h:1", "0": "h:2"}}, "task /job:w/replica:0/task:0 is given twice"),
        ({"w": ["h:1"], "v": ["h:1"]}, "tasks /job:v/replica:0/task:0 and /job:w/replica:0/task:0"),
        (["w"], "must be a mapping"),
    ],
)
def test_cluster_spec_rejects_malformed_spec(cluster: object, fragment: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        ClusterSpec(cluster)  # type: ignore[arg-type]
    assert fragment in str(info.value)


def test_cluster_spec_port_zero_may_repeat() -> None:
    spec = ClusterSpec({"w": ["localhost:0", "localhost:0"]})
    assert spec.port_of("/job:w/task:1") == 0


def test_cluster_spec_accepts_string_task_indices_from_json() -> None:
    spec = ClusterSpec(json.loads('{"ps": {"0": "h:1", "3": "h:2"}}'))
    assert spec.tasks() == ["/job:ps/replica:0/task:0", "/job:ps/replica:0/task:3"]


def test_cluster_spec_empty_and_copy() -> None:
    assert ClusterSpec().jobs == []
    assert ClusterSpec({}).tasks() == []
    spec = ClusterSpec(SPEC)
    assert ClusterSpec(spec) == spec


def test_cluster_spec_as_dict_round_trips() -> None:
    spec = ClusterSpec(SPEC)
    assert spec.as_dict() == {
        "ps": {0: "10.0.0.1:1", 3: "[::1]:2"},
        "worker": ["hostA:2222", "hostB:2222"],
    }
    assert ClusterSpec({"w": {1: "a:1", 0: "b:1"}}).as_dict() == {"w": ["b:1", "a:1"]}
    assert ClusterSpec(spec.as_dict()) == spec
    spec.as_dict()["worker"].append("evil:1")  # type: ignore[union-attr]
    assert spec.tasks("worker") == ["/job:worker/replica:0/task:0", "/job:worker/replica:0/task:1"]


def test_cluster_spec_input_is_copied() -> None:
    source = {"w": ["a:1"]}
    spec = ClusterSpec(source)
    source["w"].append("b:1")
    assert spec.tasks() == ["/job:w/replica:0/task:0"]


def test_cluster_spec_equality_and_hash_are_by_value() -> None:
    a = ClusterSpec({"w": ["a:1", "b:1"], "ps": ["c:1"]})
    b = ClusterSpec({"ps": {0: "c:1"}, "w": ("a:1", "b:1")})
    assert a == b and hash(a) == hash(b)
    assert a != ClusterSpec({"w": ["a:1", "b:2"], "ps": ["c:1"]})
    assert a != {"w": ["a:1", "b:1"], "ps": ["c:1"]}
    assert len({a, b}) == 1


def test_cluster_spec_repr_evaluates_back() -> None:
    spec = ClusterSpec(SPEC)
    assert repr(spec) == (
        "ClusterSpec({'ps': {0: '10.0.0.1:1', 3: '[::1]:2'}, "
        "'worker': ['hostA:2222', 'hostB:2222']})"
    )
    assert eval(repr(spec), {"ClusterSpec": ClusterSpec}) == spec


def _env(config: object) -> dict[str, str]:
    return {"TF_CONFIG": config if isinstance(config, str) else json.dumps(config)}


def test_from_tf_config_reads_cluster() -> None:
    env = _env({"cluster": {"worker": ["h0:2222", "h1:2222"], "chief": ["c:1"]}, "task": {}})
    spec = ClusterSpec.from_tf_config(env)
    assert spec == ClusterSpec({"worker": ["h0:2222", "h1:2222"], "chief": ["c:1"]})


def test_from_tf_config_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    config = {"cluster": {"worker": ["h0:1"]}, "task": {"type": "worker", "index": 0}}
    monkeypatch.setenv("TF_CONFIG", json.dumps(config))
    assert ClusterSpec.from_tf_config() == ClusterSpec({"worker": ["h0:1"]})
    assert ClusterSpec.tf_config_task() == "/job:worker/replica:0/task:0"
    monkeypatch.delenv("TF_CONFIG")
    assert ClusterSpec.tf_config_task() is None
    with pytest.raises(InvalidArgumentError, match="TF_CONFIG is not set"):
        ClusterSpec.from_tf_config()


@pytest.mark.parametrize(
    ("env", "fragment"),
    [
        ({}, "TF_CONFIG is not set; it should hold JSON like"),
        ({"TF_CONFIG": "  "}, "TF_CONFIG is not set"),
        (_env("{not json"), "TF_CONFIG is not valid JSON"),
        (_env("[1, 2]"), "TF_CONFIG must be a JSON object"),
        (_env({"task": {"type": "worker", "index": 0}}), 'TF_CONFIG has no "cluster" object'),
        (_env({"cluster": ["h:1"]}), 'no "cluster" object (got list)'),
        (_env({"cluster": {"worker": ["h:99999"]}}), "TF_CONFIG: cluster spec task"),
    ],
)
def test_from_tf_config_rejects_missing_or_malformed(env: dict[str, str], fragment: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        ClusterSpec.from_tf_config(env)
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("config", "task"),
    [
        ({"cluster": {}, "task": {"type": "worker", "index": 3}}, "/job:worker/replica:0/task:3"),
        ({"task": {"type": "evaluator", "index": "0"}}, "/job:evaluator/replica:0/task:0"),
        ({"cluster": {"worker": ["h:1"]}}, None),
        ({"cluster": {}, "task": None}, None),
    ],
)
def test_tf_config_task_names_the_task(config: object, task: str | None) -> None:
    assert ClusterSpec.tf_config_task(_env(config)) == task


def test_tf_config_task_none_when_unset() -> None:
    assert ClusterSpec.tf_config_task({}) is None


@pytest.mark.parametrize(
    ("config", "fragment"),
    [
        ("nope", "not valid JSON"),
        ({"task": "worker"}, '"task" must be an object'),
        ({"task": {"index": 0}}, '"type" None is not a job name'),
        ({"task": {"type": "1w", "index": 0}}, "\"type\" '1w' is not a job name"),
        ({"task": {"type": "worker"}}, 'has no "index"'),
        ({"task": {"type": "worker", "index": -1}}, '"index" -1 is not a non-negative'),
        ({"task": {"type": "worker", "index": 1.5}}, '"index" 1.5'),
        ({"task": {"type": "worker", "index": True}}, '"index" True'),
    ],
)
def test_tf_config_task_rejects_malformed(config: object, fragment: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        ClusterSpec.tf_config_task(_env(config))
    assert fragment in str(info.value)


@pytest.mark.parametrize("address", ["h:\u00b2", "h:\u0663", "h:\uff11\uff12"])
def test_split_host_port_refuses_non_ascii_digits_naming_the_address(address: str) -> None:
    # str.isdigit() takes superscripts and other scripts' digits; int() then fails
    # with a bare ValueError (it did), or reads them as a port.
    with pytest.raises(InvalidArgumentError, match="is not 'host:port'"):
        split_host_port(address)
