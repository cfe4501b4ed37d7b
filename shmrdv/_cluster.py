"""Where a job's workers are: the cluster spec, host addresses, the namespace, the peers.

``ClusterSpec`` is TensorFlow's ``tf.train.ClusterSpec`` / ``TF_CONFIG`` (no replicas:
unset means 0). The namespace is a job's secret token and its public id. ``Peers`` is a
Worker's peer directory: this host's presence records (final), else the cluster spec
(provisional, before a peer has started).

Thread model (``docs/threads.md``): no thread of its own.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import hashlib
import ipaddress
import json
import os
import re
import secrets
import socket
from collections.abc import Mapping, Sequence

from ._errors import InvalidArgumentError
from ._keys import DeviceName, _quote
from ._transport import PeerRecord, PresenceBoard, Sighting, TaskState

__all__ = ["ALL_TRANSPORTS", "ClusterSpec", "ENV_VAR", "NAMESPACE_ID_HEX", "NoPresence", "Peers"]
__all__ += ["canonical_task", "describe_bad_token", "is_local_host", "namespace_id"]
__all__ += ["namespace_ids", "new_namespace", "resolve_namespace", "split_host_port"]


def split_host_port(address: str) -> tuple[str, int]:
    """``"host:port"`` / ``"[v6]:port"`` -> (host without brackets, port), or raise."""
    if not isinstance(address, str):
        raise InvalidArgumentError(
            f"an address must be a 'host:port' str, not {type(address).__name__}"
        )
    split = _split_address(address)
    if split is None:
        raise InvalidArgumentError(
            f"address {address!r} is not 'host:port' (e.g. '127.0.0.1:2222', '[::1]:2222')"
        )
    return split


@functools.lru_cache(maxsize=1)
def _own_addresses() -> frozenset[str]:
    names = {"localhost", socket.gethostname(), socket.getfqdn()}
    addrs: set[str] = set()
    for name in names:
        try:
            for info in socket.getaddrinfo(name, None):
                addrs.add(str(info[4][0]))
        except OSError:
            continue
    # Every interface address (Linux): the kernel's local routes and its IPv6 list.
    try:
        with open("/proc/net/fib_trie", encoding="ascii") as f:
            lines = f.read().splitlines()
        for i, line in enumerate(lines):
            if "/32 host LOCAL" in line and i > 0:
                addrs.add(lines[i - 1].split()[-1])
    except OSError:
        pass
    try:
        with open("/proc/net/if_inet6", encoding="ascii") as f:
            for line in f:
                hexaddr = line.split()[0]
                addrs.add(str(ipaddress.IPv6Address(int(hexaddr, 16))))
    except (OSError, ValueError):
        pass
    return frozenset(a.lower() for a in names | addrs)


def is_local_host(host: str) -> bool:
    """True if ``host`` (a name or an IP) is this machine."""
    h = host.strip("[]").lower()
    if h in ("", "localhost", "0.0.0.0", "::"):
        return True
    try:
        ip = ipaddress.ip_address(h)
        if ip.is_loopback:
            return True
        return str(ip) in _own_addresses()
    except ValueError:
        pass
    if h in _own_addresses():
        return True
    try:
        resolved = {str(info[4][0]) for info in socket.getaddrinfo(h, None)}
    except OSError:
        return False
    return any(ipaddress.ip_address(a).is_loopback or a in _own_addresses() for a in resolved)


ENV_VAR = "SHMRDV_NAMESPACE"

# 128 bits cannot be enumerated; base32 spells them in 26 characters of [a-z2-7].
_TOKEN_BYTES = 16
# A token is hashed into names (NAME_MAX 255 bytes): short, of one safe alphabet.
_VALID = re.compile(r"[a-z0-9]{8,64}")

#: 8 bytes of blake2b: enough to tell a host's jobs apart, short enough for a name.
NAMESPACE_ID_HEX = 16
_ID_PERSON = b"shmrdv.nsid"

_HOW_TO_GET_ONE = (
    "call shmrdv.new_namespace() once per job and pass it to every Worker, "
    f"or export {ENV_VAR}=$(python -m shmrdv namespace)"
)


def new_namespace() -> str:
    """A fresh token of 128 random bits: create it once per job, give it to every worker."""
    raw = base64.b32encode(secrets.token_bytes(_TOKEN_BYTES)).decode("ascii")
    return raw.rstrip("=").lower()


def namespace_id(token: str) -> str:
    """The public id of the namespace ``token`` (16 hex characters, a one-way digest), as
    ``shmrdv ls`` shows it; ``InvalidArgumentError`` for an invalid token."""
    if token is None:
        raise InvalidArgumentError("namespace_id() needs a namespace token, not None")
    token = resolve_namespace(token)
    digest = hashlib.blake2b(
        token.encode("ascii"), digest_size=NAMESPACE_ID_HEX // 2, person=_ID_PERSON
    )
    return digest.hexdigest()


def resolve_namespace(namespace: str | None, environ: Mapping[str, str] | None = None) -> str:
    """``namespace``, else env ``SHMRDV_NAMESPACE``, checked; else ``InvalidArgumentError``
    saying how to get a token."""
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


def namespace_ids(namespace: str) -> frozenset[str]:
    """The ids a ``--namespace`` of ``shmrdv ls`` / ``gc`` may mean (an id, a token's id)."""
    ids: set[str] = set()
    if len(namespace) == NAMESPACE_ID_HEX and all(c in "0123456789abcdef" for c in namespace):
        ids.add(namespace)
    if _VALID.fullmatch(namespace) is not None:
        ids.add(namespace_id(namespace))
    elif not ids:
        raise InvalidArgumentError(
            f"namespace ({describe_bad_token(namespace)}) is neither a namespace id "
            f"({NAMESPACE_ID_HEX} hex characters, as `shmrdv ls` shows) nor a namespace token"
        )
    return frozenset(ids)


# At most this many of a bad token's characters are named in a message.
_MAX_NAMED_CHARS = 5


def describe_bad_token(value: object) -> str:
    """A refused token described, never echoed: a near miss is as secret as the token."""
    if not isinstance(value, str):
        return f"a {type(value).__name__}, not a str"
    bad = sorted({c for c in value if not ("a" <= c <= "z" or "0" <= c <= "9")})
    text = f"a string of {len(value)} characters"
    if bad:
        named = ", ".join(repr(c) for c in bad[:_MAX_NAMED_CHARS])
        more = ", ..." if len(bad) > _MAX_NAMED_CHARS else ""
        text += f", with {named}{more} among them"
    return text


# Same grammar as job names in device names (TensorFlow IsJobName).
_JOB_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*")
# A DNS-ish host name: no spaces, '/', '@', ':'.
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
    """An immutable map ``job -> task index -> "host:port"``, compared by value.

    ``ClusterSpec({"worker": ["hostA:2222", "hostB:2222"], "ps": {0: "h:1", 3: "h:2"}})``;
    no two tasks share an address but port 0 ("any free port"). ``InvalidArgumentError``
    names the bad job, task or value. ``task in spec`` takes task or device names.
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
        return list(self._jobs)

    def tasks(self, job: str | None = None) -> list[str]:
        """Task names (of ``job`` only, if given), by job then index."""
        if job is not None and job not in self._jobs:
            raise InvalidArgumentError(f"cluster spec has no job {job!r}; its jobs are {self.jobs}")
        names = [job] if job is not None else list(self._jobs)
        return [f"/job:{j}/replica:0/task:{i}" for j in names for i in self._jobs[j]]

    def task_address(self, task: str | DeviceName) -> str:
        """The ``host:port`` of ``task`` (a task or device name), or raise naming the spec's."""
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
        return split_host_port(self.task_address(task))[0]

    def port_of(self, task: str | DeviceName) -> int:
        """The port of ``task``'s address (0 means "any free port")."""
        return split_host_port(self.task_address(task))[1]

    def as_dict(self) -> dict[str, list[str] | dict[int, str]]:
        """A list per job whose tasks are 0..n-1, else a dict, as TensorFlow's ``as_dict``."""
        return {
            job: list(tasks.values()) if list(tasks) == list(range(len(tasks))) else dict(tasks)
            for job, tasks in self._jobs.items()
        }

    def __contains__(self, task: object) -> bool:
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
        """The cluster of ``TF_CONFIG`` as TensorFlow's ``TFConfigClusterResolver`` reads it;
        ``InvalidArgumentError`` if unset or malformed."""
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
        """This process's task from ``TF_CONFIG``'s ``"task"`` (None if none; it need not
        be in the cluster, as TensorFlow's "evaluator"); raises if malformed."""
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


#: Every transport name, in the default order of preference.
ALL_TRANSPORTS = ("shm", "grpc")


def canonical_task(dev: DeviceName) -> DeviceName:
    """The task part of ``dev``, replica defaulted to 0; raise if it names no task."""
    job, replica, task = dev.task_key()
    return DeviceName(job=job, replica=replica, task=task, type=None, id=None)


class NoPresence:
    """The ``PresenceBoard`` of a worker without /dev/shm: peers come from the cluster spec."""

    def publish(
        self, task: str, incarnation: int, address: str | None, transports: tuple[str, ...]
    ) -> None:
        pass

    def state(self, task: str) -> TaskState:
        return TaskState("absent")

    def sightings(self, task: str) -> list[Sighting] | None:
        return None

    def close(self) -> None:
        pass

    def __repr__(self) -> str:
        return "<NoPresence>"


class Peers:
    """The ``PeerDirectory`` of one Worker, over its ``PresenceBoard`` and cluster spec.
    A task given port 0 is found by its presence record, so only on this host."""

    def __init__(self, board: PresenceBoard, cluster: ClusterSpec | None) -> None:
        self._board = board
        self._cluster = cluster
        for task in [] if cluster is None else cluster.tasks():
            address = cluster.task_address(task)  # type: ignore[union-attr]
            host, port = split_host_port(address)
            if port == 0 and not is_local_host(host):
                raise InvalidArgumentError(
                    f"the cluster spec gives {task} the address {address}: port 0 picks a "
                    "free port when that task's server starts, which only a worker on the "
                    "same host can learn (from the task's presence record); give a task on "
                    "another host a fixed port"
                )

    def _provisional(self, name: str) -> PeerRecord:
        """What the cluster spec says of task ``name`` (no address for port 0); a task it
        does not name is only reachable on this host."""
        if self._cluster is None or name not in self._cluster:
            return PeerRecord(name, True, ALL_TRANSPORTS, None, False)
        address = self._cluster.task_address(name)
        host, port = split_host_port(address)
        return PeerRecord(
            name, is_local_host(host), ALL_TRANSPORTS, address if port else None, False
        )

    def _final(self, record: PeerRecord) -> PeerRecord:
        """A board's record, with the cluster's address unless that has port 0."""
        if self._cluster is not None and record.task in self._cluster:
            address = self._cluster.task_address(record.task)
            if address != record.address and split_host_port(address)[1]:
                return dataclasses.replace(record, address=address)
        return record

    def lookup(self, task: DeviceName) -> PeerRecord:
        return self.state(task).record or self._provisional(str(canonical_task(task)))

    def state(self, task: DeviceName) -> TaskState:
        name = str(canonical_task(task))
        seen = self._board.state(name)
        if seen.state == "absent":
            return seen
        record = self._provisional(name) if seen.record is None else self._final(seen.record)
        return TaskState(seen.state, record)

    def sightings(self, task: DeviceName) -> list[Sighting] | None:
        return self._board.sightings(str(canonical_task(task)))

    def close(self) -> None:
        self._board.close()
