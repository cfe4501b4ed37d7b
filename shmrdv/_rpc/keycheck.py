"""The server's check of a requested key, as TensorFlow's worker makes it.

One place for the rule every method that serves values applies (``RecvTensor``,
``RecvTensorStream``, ``RecvTensorSeries``): the key parses, its source is this task, and
its source incarnation (when given) is this worker's. The errors are TensorFlow's, word
for word (research/tf_rendezvous.md §2.2).

Pure: no gRPC, no I/O; thread model: none needed.
"""

from __future__ import annotations

from .._errors import AbortedError, InvalidArgumentError
from .._keys import DeviceName, ParsedKey, parse_key

__all__ = ["check_served_key"]


def check_served_key(key: str, task: DeviceName, task_name: str, incarnation: int) -> ParsedKey:
    """``key`` parsed, if this worker (``task``, called ``task_name``, of ``incarnation``)
    is its source; else raise TensorFlow's ``InvalidArgumentError`` / ``AbortedError``."""
    pk = parse_key(key)
    if not pk.src.same_task(task):
        # TensorFlow (BaseRendezvousMgr::RecvLocalAsync / ValidateDevices):
        raise InvalidArgumentError(f"Invalid rendezvous key (src): {pk.full_key} @ {task_name}")
    if pk.src_incarnation != 0 and pk.src_incarnation != incarnation:
        # TensorFlow: GrpcWorker::PrepareRecvTensor, word for word.
        raise AbortedError(
            f"RecvTensor expects a different device incarnation: {pk.src_incarnation:016x} "
            f'vs. {incarnation:016x}. Your worker job ("{task_name}") was probably '
            "restarted. Check your worker job for the reason why it was restarted."
        )
    return pk
