"""System calls and futex calls per 64 B message, counted by the kernel, not by strace.

    python3 tools/hotpath_perf.py [ROUND_TRIPS]

The same ping-pong as ``../shared/tools/hotpath_counts.py`` (a new key per message, an
int64 ack back, producer on CPU 0 and consumer on CPU 1), counted with ``perf stat``'s
syscall tracepoints, which do not slow the calls they count: under ``strace`` a round trip
takes longer than the receiver's spin, so every wait becomes a semaphore sleep (a futex)
that the real rhythm does not have. Two runs of N and 3N round trips; the difference per
message is what a message costs at steady state. Needs perf and two CPUs.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys

T0, T1 = "/job:w/replica:0/task:0", "/job:w/replica:0/task:1"
D0, D1 = T0 + "/device:CPU:0", T1 + "/device:CPU:0"


def _consumer(ns: str, n: int, out: mp.Queue) -> None:  # type: ignore[type-arg]
    import numpy as np

    import shmrdv

    os.sched_setaffinity(0, {1})
    with shmrdv.Worker(T1, namespace=ns, incarnation=1) as w:
        r = w.rendezvous(1)
        for i in range(n):
            a = r.recv(shmrdv.create_key(D0, 1, D1, f"x{i}"), timeout=60).value
            r.send(shmrdv.create_key(D1, 1, D0, f"a{i}"), np.array([int(a[0])], np.int64))
        out.put({k: v for k, v in w.stats()["shm"].items() if k.startswith("spin")})


def _producer(ns: str, n: int) -> None:
    import numpy as np

    import shmrdv

    os.sched_setaffinity(0, {0})
    value = np.ones(64, np.uint8)
    with shmrdv.Worker(T0, namespace=ns, incarnation=1) as w:
        r = w.rendezvous(1)
        for i in range(n):
            r.send(shmrdv.create_key(D0, 1, D1, f"x{i}"), value)
            r.recv(shmrdv.create_key(D1, 1, D0, f"a{i}"), timeout=60)


def _pingpong(n: int) -> None:
    import shmrdv

    ctx = mp.get_context("spawn")
    ns, out = shmrdv.new_namespace(), ctx.Queue()
    procs = [
        ctx.Process(target=_consumer, args=(ns, n, out)),
        ctx.Process(target=_producer, args=(ns, n)),
    ]
    for p in procs:
        p.start()
    print(json.dumps(out.get(timeout=300)))
    for p in procs:
        p.join(60)


def _counted(n: int) -> tuple[int, int, str]:
    events = ["-e", "raw_syscalls:sys_enter", "-e", "syscalls:sys_enter_futex"]
    cmd = ["perf", "stat", "-x,", *events, sys.executable, __file__, "--child", str(n)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True)
    counts = {}
    for line in proc.stderr.splitlines():
        fields = line.split(",")  # count, unit, event, ...
        if len(fields) > 2 and fields[0].isdigit():
            counts[fields[2]] = int(fields[0])
    return counts["raw_syscalls:sys_enter"], counts["syscalls:sys_enter_futex"], proc.stdout


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        _pingpong(int(sys.argv[2]))
        return
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
    s1, f1, _ = _counted(n)
    s2, f2, spins = _counted(3 * n)
    messages = 2 * (3 * n - n)  # a value and its ack per round trip
    print(f"consumer's spin, last run: {spins.strip()}")
    print(
        json.dumps(
            {"syscalls_per_msg": round((s2 - s1) / messages, 3),
             "futex_per_msg": round((f2 - f1) / messages, 3)}
        )
    )  # fmt: skip


if __name__ == "__main__":
    main()
