"""Which methods a ``shmrdv bench`` run measures: the registry (``methods.METHODS``) with
its plugins loaded, narrowed to what ``--methods`` names, with their baselines.
"""

from __future__ import annotations

import importlib

from . import methods
from .contract import MethodSpec

__all__ = ["PENDING_METHODS", "PLUGIN_MODULES", "load_plugins", "registered_methods", "select"]

PLUGIN_MODULES = ("shmrdv._bench.shmrdv_methods", "shmrdv._bench.iceoryx_methods")


def load_plugins() -> None:
    """Import the plugin modules, which register their methods (once; a missing one is skipped)."""
    # shmrdv's own methods (shmrdv_send, shmrdv_allocate, shmrdv_grpc) register
    # themselves from this module when it exists; see contract.py.
    for module in PLUGIN_MODULES:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise


def registered_methods() -> dict[str, MethodSpec]:
    """Every method by name, shmrdv's and the plugins' included (``methods.METHODS``)."""
    load_plugins()
    return methods.METHODS


PENDING_METHODS = ("shmrdv_send", "shmrdv_send_pending")


def select(names: str | None, with_baselines: bool, mode: str | None = None) -> list[MethodSpec]:
    """The methods to run: ``names`` (comma-separated, aliases allowed) with their
    baselines (and theirs), or every method of ``mode`` (None: the default run)."""
    if not names:
        if mode == "pending":
            names = ",".join(PENDING_METHODS)
        else:
            return [m for m in methods.METHODS.values() if m.mode == mode]
    wanted = [methods.ALIASES.get(n.strip(), n.strip()) for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in methods.METHODS]
    if unknown:
        raise ValueError(
            f"unknown method(s) {', '.join(unknown)}; known: {', '.join(methods.METHODS)}"
        )
    wrong_mode = [n for n in wanted if methods.METHODS[n].mode not in (None, mode)]
    if wrong_mode:
        raise ValueError(
            f"method(s) {', '.join(wrong_mode)} need --{methods.METHODS[wrong_mode[0]].mode}"
        )
    if with_baselines:
        # A baseline's own baseline too (shmrdv_grpc -> grpc_pull -> grpc_pull_piggyback).
        todo = list(wanted)
        while todo:
            base = methods.METHODS[todo.pop()].baseline
            if base is not None and base not in wanted:
                wanted.insert(0, base)
                todo.append(base)
        for base in ("mp_pipe_oob", "memcpy"):
            if base not in wanted:
                wanted.insert(0, base)
    return [methods.METHODS[n] for n in dict.fromkeys(wanted)]
