"""The cluster spec: which address serves each task (``job -> task index -> host:port``).

Modelled on TensorFlow's ``tf.train.ClusterSpec`` (tensorflow/python/training/server_lib.py)
and its ``TF_CONFIG`` environment variable (TFConfigClusterResolver). Tasks are named
``/job:<job>/replica:0/task:<index>``: a cluster spec has no replicas, so an unset
replica means 0 and any other replica is not in the cluster. Pure: no I/O besides
reading the environment mapping it is given.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
from collections.abc import Mapping, Sequence

from ._devices import DeviceName, _quote
from ._errors import InvalidArgumentError

__all__ = ["ClusterSpec"]

# Same grammar as job names in device names (TensorFlow IsJobName).
_JOB_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*")
# A DNS-ish host name: letters, digits, '-', '_', '.'; no spaces, '/', '@', ':'.
_HOST_NAME = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?")
_DOTTED_NUMBERS = re.compile(r"[0-9.]+")
_PORT = re.compile(r"[0-9]{1,5}")
_TASK_INDEX = re.compile(r"[0-9]{1,18}")
_MAX_PORT = 65535

_TF_CONFIG = "TF_CONFIG"
_TF_CONFIG_EXAMPLE = (
    '{"cluster": {"worker": ["host0:2222", "host1:2222"]}, "task": {"type": "worker", "index": 0}}'
)

# A job maps to addresses by task index; JSON (TF_CONFIG) spells the indices as strings.
JobTasks = Sequence[str] | Mapping[int, str] | Mapping[str, str]


def _split_address(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of ``host:port`` / ``[v6]:port``, or None if malformed."""
    if address.startswith("["):
        close = address.find("]")
        if close == -1 or not address.startswith(":", close + 1):
            return None
        host, port_text = address[1:close], address[close + 2 :]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            return None
    else:
        host, sep, port_text = address.rpartition(":")
        if not sep or ":" in host or _HOST_NAME.fullmatch(host) is None:
            return None
        if _DOTTED_NUMBERS.fullmatch(host) is not None:
            # All digits and dots: it must be a real IPv4 address, not "1.2.3.999".
            try:
                ipaddress.IPv4Address(host)
            except ValueError:
                return None
    if _PORT.fullmatch(port_text) is None or int(port_text) > _MAX_PORT:
        return None
    return host, int(port_text)


def _task_index(value: object, job: str) -> int:
    # JSON object keys are strings, so a TF_CONFIG dict form arrives as {"0": ...}.
    if isinstance(value, str) and _TASK_INDEX.fullmatch(value) is not None:
        return int(value)
    if type(value) is int and value >= 0:
        return value
    raise InvalidArgumentError(
        f"cluster spec job {job!r}: task index {value!r:.80} is not a non-negative integer"
    )


class ClusterSpec:
    """An immutable map from task to address, ``job -> task index -> "host:port"``.

    ``ClusterSpec({"worker": ["hostA:2222", "hostB:2222"], "ps": {0: "h:1", 3: "h:2"}})``:
    each job maps to a list of addresses (task indices 0, 1, ...) or to a dict of task
    index to address; another ``ClusterSpec`` is copied. Job names match
    ``[A-Za-z][A-Za-z0-9_]*``; an address is ``host:port`` with a host name, an IPv4
    address or ``[IPv6]``, and a port in 0..65535. Two tasks may not share an address,
    except with port 0 ("any free port"). Malformed specs raise ``InvalidArgumentError``
    naming the job, the task and the value.

    Equal specs compare and hash equal; ``task in spec`` accepts task or device names.
    """

    __slots__ = ("_hash", "_jobs")

    _jobs: dict[str, dict[int, str]]
    _hash: int

    def __init__(self, cluster: ClusterSpec | Mapping[str, JobTasks] | None = None) -> None:
        if isinstance(cluster, ClusterSpec):
            jobs = {job: dict(tasks) for job, tasks in cluster._jobs.items()}
        else:
            jobs = self._validate(cluster if cluster is not None else {})
        self._jobs = jobs
        self._hash = hash(tuple((job, tuple(tasks.items())) for job, tasks in jobs.items()))

    @staticmethod
    def _validate(cluster: object) -> dict[str, dict[int, str]]:
        if not isinstance(cluster, Mapping):
            raise InvalidArgumentError(
                "a cluster spec must be a mapping of job name to a list of 'host:port' "
                f"(or to a dict of task index to 'host:port'), not {type(cluster).__name__}"
            )
        jobs: dict[str, dict[int, str]] = {}
        seen: dict[str, str] = {}  # address -> task name, to refuse duplicates
        for job in sorted(cluster, key=str):
            if not isinstance(job, str) or _JOB_NAME.fullmatch(job) is None:
                raise InvalidArgumentError(
                    f"cluster spec job name {job!r:.80} does not match [A-Za-z][A-Za-z0-9_]*"
                )
            tasks = cluster[job]
            items: list[tuple[int, object]]
            if isinstance(tasks, Mapping):
                items = [(_task_index(index, job), address) for index, address in tasks.items()]
            elif isinstance(tasks, (list, tuple)):
                items = list(enumerate(tasks))
            else:
                raise InvalidArgumentError(
                    f"cluster spec job {job!r}: expected a list of 'host:port' or a dict of "
                    f"task index to 'host:port', not {type(tasks).__name__}"
                )
            by_index: dict[int, str] = {}
            for index, address in sorted(items, key=lambda item: item[0]):
                task = f"/job:{job}/replica:0/task:{index}"
                if index in by_index:
                    raise InvalidArgumentError(f"cluster spec task {task} is given twice")
                if not isinstance(address, str):
                    raise InvalidArgumentError(
                        f"cluster spec task {task}: address must be a str 'host:port', "
                        f"not {type(address).__name__}"
                    )
                split = _split_address(address)
                if split is None:
                    raise InvalidArgumentError(
                        f"cluster spec task {task}: address {_quote(address)} is not "
                        "'host:port' (host name, IPv4 or [IPv6]; port 0..65535)"
                    )
                # Two servers cannot listen on one address; port 0 means "pick a free one".
                if split[1] != 0:
                    if address in seen:
                        raise InvalidArgumentError(
                            f"cluster spec tasks {seen[address]} and {task} have the same "
                            f"address {address!r}"
                        )
                    seen[address] = task
                by_index[index] = address
            jobs[job] = by_index
        return jobs

    @property
    def jobs(self) -> list[str]:
        """The job names, sorted."""
        return list(self._jobs)

    def tasks(self, job: str | None = None) -> list[str]:
        """Canonical task names ``/job:<job>/replica:0/task:<i>``, by job then index.

        With ``job``, only that job's tasks; an unknown job raises ``InvalidArgumentError``.
        """
        if job is not None and job not in self._jobs:
            raise InvalidArgumentError(f"cluster spec has no job {job!r}; its jobs are {self.jobs}")
        names = [job] if job is not None else list(self._jobs)
        return [f"/job:{j}/replica:0/task:{i}" for j in names for i in self._jobs[j]]

    def task_address(self, task: str | DeviceName) -> str:
        """The ``host:port`` of ``task``, a task or device name (its device part is ignored).

        Raises ``InvalidArgumentError`` if the name does not parse, lacks a job or task,
        has a replica other than 0, or is not in the spec; the message names the task
        and the jobs (or task indices) the spec knows.
        """
        name = task if isinstance(task, DeviceName) else DeviceName.parse(task)
        if not name.has_task:
            raise InvalidArgumentError(
                f"{_quote(str(name))} does not name a task: it needs /job:<name> and /task:<n>"
            )
        assert name.job is not None and name.task is not None  # has_task, for mypy
        tasks = self._jobs.get(name.job)
        if tasks is None:
            raise InvalidArgumentError(
                f"task {name.task_part} is not in the cluster spec: no job {name.job!r} "
                f"(its jobs are {self.jobs})"
            )
        address = tasks.get(name.task) if (name.replica or 0) == 0 else None
        if address is None:
            raise InvalidArgumentError(
                f"task {name.task_part} is not in the cluster spec: job {name.job!r} has "
                f"replica 0, tasks {sorted(tasks)}"
            )
        return address

    def host_of(self, task: str | DeviceName) -> str:
        """The host part of ``task``'s address (an IPv6 address without brackets)."""
        split = _split_address(self.task_address(task))
        assert split is not None  # validated in __init__
        return split[0]

    def port_of(self, task: str | DeviceName) -> int:
        """The port of ``task``'s address (0 means "any free port")."""
        split = _split_address(self.task_address(task))
        assert split is not None  # validated in __init__
        return split[1]

    def as_dict(self) -> dict[str, list[str] | dict[int, str]]:
        """A fresh dict: a list per job whose tasks are 0..n-1, else index -> address.

        TensorFlow's ``ClusterSpec.as_dict`` makes the same choice; the result feeds
        back into ``ClusterSpec(...)``.
        """
        out: dict[str, list[str] | dict[int, str]] = {}
        for job, tasks in self._jobs.items():
            if list(tasks) == list(range(len(tasks))):
                out[job] = list(tasks.values())
            else:
                out[job] = dict(tasks)
        return out

    def __contains__(self, task: object) -> bool:
        """True when ``task`` (a task or device name) has an address; False for anything else."""
        if not isinstance(task, (str, DeviceName)):
            return False
        try:
            self.task_address(task)
        except InvalidArgumentError:
            return False
        return True

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ClusterSpec):
            return NotImplemented
        return self._jobs == other._jobs

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"ClusterSpec({self.as_dict()!r})"

    @classmethod
    def from_tf_config(cls, environ: Mapping[str, str] | None = None) -> ClusterSpec:
        """The cluster in the ``TF_CONFIG`` environment variable (``environ`` or ``os.environ``).

        ``TF_CONFIG`` holds JSON ``{"cluster": {"worker": ["h:2222", ...], ...},
        "task": {"type": "worker", "index": 0}}``, as TensorFlow's
        ``TFConfigClusterResolver`` reads it. Raises ``InvalidArgumentError`` if it is
        unset, not JSON, has no ``"cluster"`` object, or the cluster is malformed.
        """
        config = _read_tf_config(environ)
        if config is None:
            raise InvalidArgumentError(
                f"{_TF_CONFIG} is not set; it should hold JSON like {_TF_CONFIG_EXAMPLE}"
            )
        cluster = config.get("cluster")
        if not isinstance(cluster, dict):
            raise InvalidArgumentError(
                f'{_TF_CONFIG} has no "cluster" object (got {type(cluster).__name__}); '
                f"expected JSON like {_TF_CONFIG_EXAMPLE}"
            )
        try:
            return cls(cluster)
        except InvalidArgumentError as e:
            raise InvalidArgumentError(f"{_TF_CONFIG}: {e}") from None

    @staticmethod
    def tf_config_task(environ: Mapping[str, str] | None = None) -> str | None:
        """This process's task ``/job:<type>/replica:0/task:<index>`` from ``TF_CONFIG``.

        None if ``TF_CONFIG`` is unset or has no ``"task"``. The task need not be in the
        cluster (TensorFlow's "evaluator" is not). Raises ``InvalidArgumentError`` if
        ``TF_CONFIG`` is not a JSON object or its ``"task"`` lacks a valid ``"type"`` or
        ``"index"``.
        """
        config = _read_tf_config(environ)
        if config is None or config.get("task") is None:
            return None
        task = config["task"]
        if not isinstance(task, dict):
            raise InvalidArgumentError(
                f'{_TF_CONFIG} "task" must be an object like {{"type": "worker", "index": 0}}, '
                f"not {type(task).__name__}"
            )
        job = task.get("type")
        if not isinstance(job, str) or _JOB_NAME.fullmatch(job) is None:
            raise InvalidArgumentError(
                f'{_TF_CONFIG} "task" "type" {job!r:.80} is not a job name ([A-Za-z][A-Za-z0-9_]*)'
            )
        if "index" not in task:
            raise InvalidArgumentError(f'{_TF_CONFIG} "task" has no "index" (task type {job!r})')
        index = task["index"]
        try:
            number = _task_index(index, job)
        except InvalidArgumentError:
            raise InvalidArgumentError(
                f'{_TF_CONFIG} "task" "index" {index!r:.80} is not a non-negative integer'
            ) from None
        return f"/job:{job}/replica:0/task:{number}"


def _read_tf_config(environ: Mapping[str, str] | None) -> dict[str, object] | None:
    """The parsed ``TF_CONFIG`` object, None if unset or blank; raise if not a JSON object."""
    env = os.environ if environ is None else environ
    raw = env.get(_TF_CONFIG)
    if raw is None or not raw.strip():
        return None
    try:
        config = json.loads(raw)
    except (ValueError, RecursionError) as e:  # JSONDecodeError; absurdly deep nesting
        raise InvalidArgumentError(f"{_TF_CONFIG} is not valid JSON ({e}): {_quote(raw)}") from e
    if not isinstance(config, dict):
        raise InvalidArgumentError(
            f"{_TF_CONFIG} must be a JSON object like {_TF_CONFIG_EXAMPLE}, "
            f"not {type(config).__name__}"
        )
    return config
