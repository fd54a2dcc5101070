"""Property test of the Spark job's record of the target's history (connectors/xdcr/target_history.py): over
random histories of writes, persistence, unclean restarts (unpersisted writes lost, a new failover entry) and
new vbuuids without loss, resending what ``take_lost`` returns -- on start, or when a write answers with a new
vbuuid -- leaves the target holding the last version written of every key."""

from __future__ import annotations

import itertools
import sqlite3

from hypothesis import given, settings
from hypothesis import strategies as st

from connectors.xdcr.checkpoints import history_holds
from connectors.xdcr.document import DocVersion
from connectors.xdcr.target import WriteOp
from connectors.xdcr.target_history import TargetLedger


class Vbucket:
    """One target vbucket as the rollback rules see it: seqno-ordered writes, a persisted seqno, a failover
    log (newest first)."""

    def __init__(self) -> None:
        self.uuids = itertools.count(1000)
        self.log: list[tuple[int, int]] = [(next(self.uuids), 0)]
        self.items: list[tuple[int, bytes, int]] = []  # (seqno, key, version)
        self.persisted = 0

    @property
    def high(self) -> int:
        return self.items[-1][0] if self.items else self.log[0][1]

    def write(self, key: bytes, version: int) -> tuple[int, int]:
        s = self.high + 1
        self.items.append((s, key, version))
        return self.log[0][0], s

    def create_entry(self, high: int) -> None:
        """kv_engine ``FailoverTable::createEntry``: branches above ``high`` were diverged from and go."""
        self.log = [(next(self.uuids), high), *((u, s) for u, s in self.log if s <= high)]

    def crash(self) -> None:
        self.items = [i for i in self.items if i[0] <= self.persisted]
        self.create_entry(self.persisted)

    def new_branch(self) -> None:
        self.create_entry(self.high)

    def holds(self) -> dict[bytes, int]:
        return {k: v for _s, k, v in self.items}


def _op(key: bytes, version: int) -> WriteOp:
    return WriteOp(0, DocVersion(key, version, version, 0, 0, False, 1, b"{}"))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.tuples(st.just("write"), st.integers(0, 7)), st.just(("persist", 0)),
                          st.just(("crash", 0)), st.just(("new_branch", 0)), st.just(("restart_job", 0))),
                max_size=60))
def test_resending_what_take_lost_returns_restores_every_key(steps: list[tuple[str, int]]) -> None:
    vb = Vbucket()
    ledger = TargetLedger(sqlite3.connect(":memory:"))
    versions = itertools.count(1)
    last: dict[bytes, int] = {}
    resent = 0

    def send(op: WriteOp) -> bool:
        return ledger.record(op, 0, vb.write(op.version.key, op.version.cas))

    def check() -> None:
        nonlocal resent
        for op in ledger.take_lost(0, vb.log):
            resent += 1
            send(op)  # resends are on the current branch: no new vbuuid

    for what, n in steps:
        if what == "write":
            key = f"k{n}".encode()
            last[key] = v = next(versions)
            if send(_op(key, v)):  # a new vbuuid answered: check the history now
                check()
        elif what == "persist":
            vb.persisted = vb.high
        elif what == "crash":
            vb.crash()
        elif what == "new_branch":
            vb.new_branch()
        else:
            check()  # the job starts again: every recorded vbucket is checked
    check()
    assert vb.holds() == last
    pos = ledger.position(0)
    assert pos is None or history_holds(vb.log, *pos)
