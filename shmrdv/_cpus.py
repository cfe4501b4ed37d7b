"""How many CPUs this process's job may use at once: the machine's, capped by its cgroup quota.

A spin before blocking pays only while the peer can run meanwhile, so the shared-memory
poller spins only where more than one CPU is usable (``_shm/dispatcher.py``). The count
is the machine's CPUs capped by the CPU bandwidth quota of this process's cgroup and of
each of its ancestors: cgroup v2's ``cpu.max`` (``"max 100000"`` or ``"150000 100000"``)
or v1's ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (``-1`` for none), rounded up. The
cgroup's directory is found from ``/proc/self/cgroup`` and the cgroup mounts of
``/proc/self/mountinfo`` (a container sees its own cgroup as the mount's root). CPU
*affinity* is deliberately not counted: a process pinned to one CPU while its peer is
pinned to another is exactly where a spin pays.

Everything read is a small kernel file; any that is missing or malformed counts as "no
quota", never as an error. At most ``_MAX_DEPTH`` ancestors are read per hierarchy.
"""

from __future__ import annotations

import math
import os

__all__ = ["cgroup_cpu_limit", "usable_cpus"]

_MAX_DEPTH = 32
_MAX_READ = 1 << 16


def usable_cpus(root: str = "/") -> int:
    """The CPUs this process's job may use at once: ``os.cpu_count()`` capped by the
    cgroup quota (rounded up, at least 1). ``root`` prefixes every path read (tests)."""
    cpus = os.cpu_count() or 1
    limit = cgroup_cpu_limit(root)
    if limit is not None:
        cpus = min(cpus, max(1, math.ceil(limit)))
    return cpus


def cgroup_cpu_limit(root: str = "/") -> float | None:
    """The tightest CPU quota (in CPUs) on this process's cgroups and their ancestors,
    or ``None`` where there is none (or it cannot be read)."""
    paths = _own_cgroups(_read(os.path.join(root, "proc/self/cgroup")))
    best: float | None = None
    for line in _read(os.path.join(root, "proc/self/mountinfo")).splitlines():
        mount = _cgroup_mount(line)
        if mount is None:
            continue
        version, fs_root, mount_point = mount
        own = paths.get(version)
        if own is None:
            continue
        for directory in _ancestors(os.path.join(root, mount_point.lstrip("/")), fs_root, own):
            limit = _v2_limit(directory) if version == "v2" else _v1_limit(directory)
            if limit is not None and (best is None or limit < best):
                best = limit
    return best


def _read(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(_MAX_READ).decode("utf-8", "replace")
    except OSError:
        return ""


def _own_cgroups(text: str) -> dict[str, str]:
    """This process's cgroup path per hierarchy that can hold a CPU quota: ``"v2"`` (the
    ``0::`` line) and ``"v1"`` (the line whose controllers include ``cpu``)."""
    own: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hier, controllers, path = parts
        if hier == "0" and controllers == "":
            own["v2"] = path
        elif "cpu" in controllers.split(","):
            own["v1"] = path
    return own


def _cgroup_mount(line: str) -> tuple[str, str, str] | None:
    """``(version, root within the hierarchy, mount point)`` of a mountinfo line that
    mounts cgroup v2 or the v1 hierarchy holding the ``cpu`` controller, else ``None``."""
    fields, sep, rest = line.partition(" - ")
    head, tail = fields.split(), rest.split()
    if not sep or len(head) < 5 or len(tail) < 3:
        return None
    fs_root, mount_point = head[3], head[4]
    if tail[0] == "cgroup2":
        return "v2", fs_root, mount_point
    if tail[0] == "cgroup" and "cpu" in tail[2].split(","):
        return "v1", fs_root, mount_point
    return None


def _ancestors(mount_point: str, fs_root: str, own: str) -> list[str]:
    """The directories of ``own`` and its ancestors visible under this mount (up to its
    root), innermost first; none where ``own`` lies outside the mount's root."""
    rel = os.path.relpath(own, fs_root)
    if rel.startswith(".."):
        return []
    parts = [] if rel == "." else rel.split("/")
    dirs = []
    for depth in range(min(len(parts), _MAX_DEPTH), -1, -1):
        dirs.append(os.path.join(mount_point, *parts[:depth]))
    return dirs


def _v2_limit(directory: str) -> float | None:
    fields = _read(os.path.join(directory, "cpu.max")).split()
    if len(fields) != 2 or fields[0] == "max":
        return None
    return _ratio(fields[0], fields[1])


def _v1_limit(directory: str) -> float | None:
    quota = _read(os.path.join(directory, "cpu.cfs_quota_us")).strip()
    period = _read(os.path.join(directory, "cpu.cfs_period_us")).strip()
    return _ratio(quota, period)


def _ratio(quota: str, period: str) -> float | None:
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None
