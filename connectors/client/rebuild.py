"""Rebuilding a vbucket from zero without a mutation log (docs/client.md "Mutation log").

A consumer without a mutation log cannot undo a rollback: it tells the application to wipe the vbucket
(``RollbackInstruction.rebuild_from_zero``) and reads the vbucket's partition again from its start. That history
holds the rollback records already met -- the one that asked for the rebuild among them -- and the changes of
the branches they cut off. Handed to the application as they come, the first of those rollbacks would ask for
the same rebuild again, for ever. So while the replay has not passed the record where the rebuild was asked for,
the vbucket's events are folded here instead: every version of every key in seqno order, a rollback dropping the
versions above its restart point (what the mutation log's undo would have done). When the replay passes that
record, :meth:`RebuildFold.snapshot` hands the application one snapshot: the surviving last version of every key
(deletions included), at the replayer's state -- the vbucket exactly as the records up to there define it.
"""

from __future__ import annotations

from connectors.client.replay import Change, ConsumerPosition, Oversize, Rollback, Snapshot

__all__ = ["RebuildFold"]


class RebuildFold:
    """The events of one vbucket's replay from zero, folded until the replay reaches ``until`` (the offset where
    the rebuild was asked for)."""

    __slots__ = ("_oversize", "_versions", "until")

    def __init__(self, until: int) -> None:
        self.until = until
        #: key -> its versions applied so far, ascending seqno
        self._versions: dict[bytes, list[Change]] = {}
        self._oversize: list[Oversize] = []

    def add(self, ev: Snapshot | Rollback) -> None:
        if isinstance(ev, Snapshot):
            versions = self._versions
            for c in ev.changes:
                v = versions.get(c.key)
                if v is None:
                    versions[c.key] = [c]
                else:
                    v.append(c)
            self._oversize.extend(ev.oversize)
            return
        restart = ev.restart_seqno
        for key in list(self._versions):
            v = self._versions[key]
            while v and v[-1].seqno > restart:
                v.pop()
            if not v:
                del self._versions[key]
        self._oversize = [o for o in self._oversize if o.seqno <= restart]

    def snapshot(self, vbucket: int, state: ConsumerPosition) -> Snapshot:
        """One snapshot of what survived, at ``state`` (the replayer's: the end of its last complete snapshot)."""
        changes = sorted((v[-1] for v in self._versions.values()), key=lambda c: c.seqno)
        return Snapshot(vbucket, state.vbuuid, 0, state.seqno, tuple(changes), state.offset, state.copy(),
                        tuple(self._oversize))
