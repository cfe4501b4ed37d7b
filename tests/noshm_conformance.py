"""Run the conformance battery over a gRPC-only pair where /dev/shm cannot be used.

Run by tests/test_worker_noshm.py as a script inside a mount namespace whose /dev/shm is
read-only or absent: it first proves that no object can be created there, then runs every
check over a producer Worker in a child process and a consumer Worker here, both
``transports=("grpc",)``, found through a cluster spec on 127.0.0.1 (with no presence
records, nothing else can tell one worker where the other listens). Prints
``conformance ok <checks>`` and exits 0, or raises.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import sys
from collections.abc import Iterator

import shmrdv
from shmrdv._procs import ChildWorker
from shmrdv.testing import CHECKS, RendezvousPair, run_conformance

PRODUCER = "/job:worker/replica:0/task:0"
CONSUMER = "/job:worker/replica:0/task:1"


def _shm_is_unusable() -> str:
    """Why nothing can be created in /dev/shm; raise if something can."""
    try:
        fd = os.open("/dev/shm/shmrdv_probe", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError as e:
        return e.strerror or str(e)
    os.close(fd)
    os.unlink("/dev/shm/shmrdv_probe")
    raise AssertionError("/dev/shm is usable: this run proves nothing")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    why = _shm_is_unusable()
    print(f"/dev/shm: {why}", flush=True)
    cluster = shmrdv.ClusterSpec(
        {"worker": [f"127.0.0.1:{_free_port()}", f"127.0.0.1:{_free_port()}"]}
    )
    ns = shmrdv.new_namespace()
    steps = itertools.count(1)
    kwargs = {"namespace": ns, "cluster": cluster, "transports": ("grpc",)}
    with (
        shmrdv.Worker(CONSUMER, **kwargs) as consumer,  # type: ignore[arg-type]
        ChildWorker(PRODUCER, **kwargs) as producer,
    ):
        assert consumer.address is not None and "shm" not in consumer.stats()
        for allocate in (False, True):

            @contextlib.contextmanager
            def pair(allocate: bool = allocate) -> Iterator[RendezvousPair]:
                step = next(steps)
                try:
                    yield RendezvousPair(
                        producer=producer.producer(step, allocate=allocate),
                        consumer=consumer.rendezvous(step),
                        make_key=lambda edge: shmrdv.create_key(
                            f"{PRODUCER}/device:CPU:0", 0, f"{CONSUMER}/device:CPU:0", edge
                        ),
                    )
                finally:
                    consumer.cleanup(step)
                    producer.cleanup(step)

            run_conformance(pair)
    print(f"conformance ok {2 * len(CHECKS)}", flush=True)


if __name__ == "__main__":
    main()
    sys.exit(0)
