"""The machine a ``shmrdv bench`` run ran on: CPU, kernel, Python, the versions of what it
measured, the load average; read from files only.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys
from typing import Any

__all__ = ["describe_machine", "load_average"]


def load_average() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def describe_machine() -> dict[str, Any]:
    """CPU, cores, kernel, Python and the versions of everything measured; reads only files."""
    cpu_model = None
    cpuinfo = _read("/proc/cpuinfo") or ""
    for line in cpuinfo.splitlines():
        if line.startswith("model name"):
            cpu_model = line.split(":", 1)[1].strip()
            break
    try:
        affinity: int | None = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = None
    uname = platform.uname()
    shm: dict[str, Any] = {}
    try:
        st = os.statvfs("/dev/shm")
        shm = {"size_bytes": st.f_frsize * st.f_blocks, "free_bytes": st.f_frsize * st.f_bavail}
    except OSError:
        pass
    versions = {
        dist: _version(dist)
        for dist in (
            "numpy",
            "grpcio",
            "protobuf",
            "posix_ipc",
            "pyzmq",
            "torch",
            "ray",
            "matplotlib",
        )
    }
    return {
        "cpu_model": cpu_model,
        "cpu_count": os.cpu_count(),
        "cpu_affinity": affinity,
        "kernel": f"{uname.system} {uname.release}",
        "machine": uname.machine,
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "versions": versions,
        "dev_shm": shm,
        "cpuidle_driver": _read("/sys/devices/system/cpu/cpuidle/current_driver"),
        "thp_shmem": _read("/sys/kernel/mm/transparent_hugepage/shmem_enabled"),
        "load_average_start": load_average(),
        "load_average_end": None,
        "argv": sys.argv[1:],
    }
