"""Why a receive waits: the sentence that says where its producer's task is alive.

A producer and a consumer started with different namespace tokens never meet: the
consumer waits out its timeout. For the message of that timeout (DESIGN.md: "… task … is
alive in namespace id …, not in this worker's: producer and consumer must share the
namespace"), for a debug line of a receive that waits long and for ``Worker.stats()``,
this module turns what the peer directory saw of the task on this host
(``PeerDirectory.sightings``, declared in ``_transport.py``) into that sentence. Pure: the
looking is the directory's. Never on the per-message path.
"""

from __future__ import annotations

from ._transport import Sighting

__all__ = ["explain_absent_producer"]


def explain_absent_producer(task: str, found: list[Sighting] | None) -> str | None:
    """A sentence saying where ``task`` lives if not in this worker's namespace, or None.

    None also when it is alive in this worker's namespace, or when ``found`` is None (this
    host keeps no presence records to look at). Otherwise either "task … is alive in
    namespace id …, not in this worker's: producer and consumer must share the
    namespace", or "task … is not alive anywhere on this host".
    """
    if found is None or any(s.alive and s.ours for s in found):
        return None
    elsewhere = sorted({s.namespace for s in found if s.alive and not s.ours})
    if elsewhere:
        pids = sorted({s.pid for s in found if s.alive and not s.ours})
        which = ", ".join(elsewhere)
        return (
            f"task {task} is alive in namespace id {which} (pid {', '.join(map(str, pids))}), "
            "not in this worker's: producer and consumer must share the namespace"
        )
    return (
        f"task {task} is not alive anywhere on this host (no live presence record of this "
        "user in any namespace): it has not started, it exited, or it runs on another host"
    )
