"""``shmrdv serve``: the echo peer of ``shmrdv bench --peer``, on its own (``--listen``) or as
a task of a cluster (a Worker echoing what the other tasks send it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import threading
from collections.abc import Callable

from .. import ClusterSpec, DeviceName, Worker
from .._cluster import ENV_VAR
from .._errors import InvalidArgumentError
from .echo import EchoLoop, EchoService

__all__ = ["run"]


def _serve_until_stopped(tick: Callable[[], object] = lambda: None) -> None:
    """Block until SIGTERM or Ctrl-C, calling ``tick`` every second."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with contextlib.suppress(KeyboardInterrupt):
        while not stop.wait(1.0):
            tick()


def run(args: argparse.Namespace) -> int:
    """``shmrdv serve``: its exit code; blocks until SIGTERM or Ctrl-C."""
    usage: argparse.ArgumentParser = args.parser
    token = os.environ.get("SHMRDV_TOKEN") or None
    if args.listen:
        if args.task or args.cluster or args.namespace:
            usage.error(
                "--listen runs the echo peer on its own: give it without --task, --cluster, --namespace"
            )
        try:
            service = EchoService(args.listen, token=token)
        except InvalidArgumentError as e:
            usage.error(f"--listen: {e}")
        with service:
            port = service.address.rpartition(":")[2]
            print(
                f"echo peer listening on {service.address}; on another host run: "
                f"shmrdv bench --peer <this host>:{port}; Ctrl-C stops",
                flush=True,
            )
            _serve_until_stopped(service.expire_idle)
        return 0
    needs = (
        "give --listen HOST:PORT (the echo peer of `shmrdv bench --peer`), or --task and "
        "--cluster JSON (or TF_CONFIG) and --namespace (or $SHMRDV_NAMESPACE)"
    )
    missing = []
    if not args.cluster and not os.environ.get("TF_CONFIG"):
        missing.append("no --cluster and TF_CONFIG is not set")
    if not args.namespace and not os.environ.get(ENV_VAR):
        missing.append(f"no --namespace and ${ENV_VAR} is not set")
    if missing:
        usage.error(f"{'; '.join(missing)}: {needs}")
    if args.cluster:
        try:
            cluster = ClusterSpec(json.loads(args.cluster))
        except json.JSONDecodeError as e:
            usage.error(f'--cluster is not JSON ({e}); e.g. \'{{"worker": ["hostA:2222"]}}\'')
    else:
        cluster = ClusterSpec.from_tf_config()
    task = args.task or (None if args.cluster else ClusterSpec.tf_config_task())
    if not task:
        usage.error(f"no task: {needs}")
    with Worker(
        task, cluster=cluster, namespace=args.namespace, transports=("grpc", "shm"), token=token
    ) as w:
        others = [t for t in cluster.tasks() if DeviceName.parse(t) != DeviceName.parse(w.task)]
        echo = EchoLoop(w, others)
        try:
            print(
                f"serving {w.task} on {w.address} (incarnation {w.incarnation:016x}), echoing "
                f"what {len(others)} other task(s) send it; Ctrl-C stops",
                flush=True,
            )
            _serve_until_stopped()
        finally:
            echo.close()
    return 0
