"""Checkpoint memory recovery (kv_engine ``CheckpointMemRecoveryTask``): above 90 % of the bucket's checkpoint
quota, free down to 60 % (docs/engine.md "Memory quota").

First close open checkpoints and free the ones every cursor passed, then drop the DCP cursors holding the
oldest checkpoints (kv_engine cursor dropping); their streams go back to backfilling from disk and continue.
The persistence cursor is never dropped: if it holds the memory, the front end answers TMPFAIL instead.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.kv.checkpoint import MemoryCounter
from engine.kv.vbucket import VBucket


class CheckpointMemRecovery:
    """Recovers checkpoint memory of ``vbuckets`` (sharing ``counter``) against a quota of ``quota`` bytes."""

    def __init__(self, vbuckets: Sequence[VBucket], counter: MemoryCounter, quota: int) -> None:
        self.vbuckets = vbuckets
        self.counter = counter
        self.quota = quota
        self.cursors_dropped = 0

    def run(self) -> int:
        """Recover memory if above 90 % of the quota; returns the cursors dropped."""
        quota = self.quota
        counter = self.counter
        vbs = self.vbuckets
        if counter.used <= 0.9 * quota:
            return 0
        low = 0.6 * quota
        for vb in vbs:
            if vb.ckpt.mem:
                vb.ckpt.create_checkpoint()
                vb.ckpt.remove_unreferenced()
        if counter.used <= low:
            return 0
        candidates: list[tuple[int, int, int, str]] = []
        for vb in vbs:
            ck = vb.ckpt
            for cur in ck.cursors.values():
                if cur.droppable:
                    # Slowest first: cursors furthest behind their vbucket's open checkpoint, then the
                    # vbuckets holding the most checkpoint memory.
                    candidates.append((ck.open.id - cur.ckpt.id, ck.mem, vb.id, cur.name))
        candidates.sort(reverse=True)
        dropped = 0
        for _pos, _mem, vbid, name in candidates:
            if counter.used <= low:
                break
            ck = vbs[vbid].ckpt
            if ck.drop_cursor(name):
                dropped += 1
                ck.remove_unreferenced()
                for s in vbs[vbid].streams:
                    if s.cursor_name == name:
                        s.notify()
        self.cursors_dropped += dropped
        return dropped


__all__ = ["CheckpointMemRecovery"]
