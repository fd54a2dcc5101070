"""VBucketReplayer (the pure per-vbucket core): snapshot atomicity, duplicates, resumed snapshots,
rollback records, failover-log divergence and every worked example of the UPR design specification (docs/rollback.md)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from connectors.client.replay import Change, ConsumerPosition, Rollback, Snapshot, VBucketReplayer
from schemas.failover_log import FailoverEntry as E
from schemas.records import DecodedRecord, RecordType, ValueFormat

CAFEBABE, DEADBEEF, BA5EBA11 = 0xCAFEBABE, 0xDEADBEEF, 0xBA5EBA11
HIGH = 100  # the engine's high seqno in the failover-log record (the UPR specification's server sentinel)
OPEN_END = 100  # end of the snapshot the client is inside (unknown in the specification's tables)


def rec(t: RecordType, seqno: int, snap: tuple[int, int], vbuuid: int = CAFEBABE, key: bytes | None = None,
        log: tuple[E, ...] | None = None) -> DecodedRecord:
    data = t in (RecordType.MUTATION, RecordType.DELETION)
    return DecodedRecord(t, 0, vbuuid, seqno, snap[0], snap[1], key if data else None,
                         b"v%d" % seqno if t is RecordType.MUTATION else None,
                         1 if data else None, 1 if data else None, 0 if data else None, 0 if data else None,
                         0 if data else None, 0 if t is RecordType.SNAPSHOT else None, log,
                         seqno if t is RecordType.ROLLBACK else None, None, ValueFormat.AVRO)


class Feed:
    def __init__(self, state: ConsumerPosition | None = None) -> None:
        self.r = VBucketReplayer(state or ConsumerPosition(0))
        self.off = -1
        self.events: list[Snapshot | Rollback] = []

    def __call__(self, r: DecodedRecord) -> list[Snapshot | Rollback]:
        self.off += 1
        out = self.r.feed(r, self.off)
        self.events += out
        return out

    def flog(self, *log: tuple[int, int], high: int = 0) -> list[Snapshot | Rollback]:
        entries = tuple(E(u, s) for u, s in log)
        return self(rec(RecordType.FAILOVER_LOG, high, (0, 0), entries[0].vbuuid, log=entries))

    def snap(self, start: int, end: int, vbuuid: int = CAFEBABE) -> list[Snapshot | Rollback]:
        return self(rec(RecordType.SNAPSHOT, start, (start, end), vbuuid))

    def data(self, seqno: int, snap: tuple[int, int], vbuuid: int = CAFEBABE, key: bytes | None = None,
             t: RecordType = RecordType.MUTATION) -> list[Snapshot | Rollback]:
        return self(rec(t, seqno, snap, vbuuid, key or b"k%d" % seqno))

    def rollback(self, r: int, restart: int, *log: tuple[int, int]) -> list[Snapshot | Rollback]:
        entries = tuple(E(u, s) for u, s in log)
        return self(rec(RecordType.ROLLBACK, r, (restart, restart), entries[0].vbuuid, log=entries))


def test_snapshot_released_only_when_complete() -> None:
    f = Feed()
    f.flog((CAFEBABE, 0))
    f.snap(1, 3)
    assert f.data(1, (1, 3)) == [] and f.data(2, (1, 3)) == []
    assert f.r.has_partial
    (ev,) = f.data(3, (1, 3))
    assert isinstance(ev, Snapshot) and [c.seqno for c in ev.changes] == [1, 2, 3] and ev.end == 3
    assert ev.state is not None and ev.state.applied_seqno == 3 and ev.state.offset == ev.offset == 4
    assert not f.r.has_partial


def test_filtered_tail_completes_at_next_snapshot_record() -> None:
    f = Feed()
    f.flog((CAFEBABE, 0))
    f.snap(1, 5)
    f.data(1, (1, 5))
    f.data(2, (1, 5))
    (ev,) = f.snap(6, 8)
    assert isinstance(ev, Snapshot) and ev.end == 5 and len(ev.changes) == 2 and ev.offset == 3


def test_filtered_tail_completes_at_rollback_record_above_it() -> None:
    # bug fixed: the rollback record's restart point (10) proves [6, 10] was published completely
    f = Feed()
    f.flog((CAFEBABE, 0))
    f.snap(1, 5)
    f.data(5, (1, 5))
    f.snap(6, 10)
    f.data(7, (6, 10))
    evs = f.rollback(12, 10, (DEADBEEF, 12), (CAFEBABE, 0))
    assert [type(e) for e in evs] == [Snapshot]
    assert f.r.state.applied_seqno == 10


def test_duplicates_are_skipped() -> None:
    f = Feed()
    f.flog((CAFEBABE, 0))
    f.snap(1, 2)
    f.data(1, (1, 2))
    f.data(1, (1, 2))  # duplicate inside the buffer
    (ev,) = f.data(2, (1, 2))
    assert isinstance(ev, Snapshot)
    assert [c.seqno for c in ev.changes] == [1, 2]
    assert f.data(2, (1, 2)) == []  # already applied


def test_resumed_snapshot_keeps_the_buffer() -> None:
    f = Feed()
    f.flog((CAFEBABE, 0))
    f.snap(1, 4)
    f.data(1, (1, 4))
    f.data(2, (1, 4))
    assert f.flog((DEADBEEF, 2), (CAFEBABE, 0), high=2) == []  # gateway restarted mid-snapshot
    f.snap(1, 6, DEADBEEF)
    f.data(5, (1, 6), DEADBEEF)
    (ev,) = f.data(6, (1, 6), DEADBEEF)
    assert isinstance(ev, Snapshot)
    assert [c.seqno for c in ev.changes] == [1, 2, 5, 6] and (ev.start, ev.end) == (1, 6)


def test_rollback_record_discards_buffer_and_rolls_back_applied() -> None:
    f = Feed()
    f.flog((CAFEBABE, 0))
    f.snap(1, 3)
    f.data(3, (1, 3))
    f.snap(4, 6)
    f.data(4, (4, 6))
    # nothing applied above the restart point: no event, only the buffer goes
    assert f.rollback(4, 3, (DEADBEEF, 4), (CAFEBABE, 0)) == []
    assert not f.r.has_partial and f.r.state.applied_seqno == 3
    f2 = Feed()
    f2.flog((CAFEBABE, 0))
    f2.snap(1, 3)
    f2.data(3, (1, 3))
    f2.snap(4, 6)
    f2.data(6, (4, 6))
    (rb2,) = f2.rollback(5, 3, (DEADBEEF, 5), (CAFEBABE, 0))
    assert isinstance(rb2, Rollback) and (rb2.restart_seqno, rb2.applied_seqno) == (3, 6)
    assert rb2.state is not None and rb2.state.applied_seqno == 3
    # the re-published history (seqnos > 3 on the new branch) is applied, not taken for duplicates
    f2.snap(4, 5, DEADBEEF)
    (ev,) = f2.data(5, (4, 5), DEADBEEF)
    assert isinstance(ev, Snapshot)
    assert [c.seqno for c in ev.changes] == [5]


def test_deterministic_replay_from_saved_state() -> None:
    f = Feed()
    f.flog((CAFEBABE, 0))
    f.snap(1, 2)
    f.data(1, (1, 2))
    (ev,) = f.data(2, (1, 2))
    assert ev.state is not None
    g = Feed(ev.state.copy())
    g.off = ev.offset
    f.snap(3, 3)
    g.snap(3, 3)
    assert f.data(3, (3, 3)) == g.data(3, (3, 3))


# ----------------------------------------------------------------------------------------------------------
# The UPR design specification's worked examples (docs/rollback.md) at the client level.
#
# Mapping (as in tests/schemas/test_failover_log.py): the client's log is the failover-log record it saw
# first; "snapshot at S" = the last complete snapshot it applied ([1, S], S > 0); "seen through T" = the data
# it buffered of the next snapshot [S+1, OPEN_END]; the server's log arrives in a failover-log record with
# the server's high seqno HIGH. The client's restart point is the Rollback event's ``restart_seqno`` when
# there is one, else: its buffered seqno T when it kept the buffer, else its applied seqno S.
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SeedCase:
    name: str
    server: tuple[tuple[int, int], ...]
    client: tuple[tuple[int, int], ...]
    snapshot_at: int
    seen_through: int
    seed_answer: int
    client_answer: int  # what the replayer does (differs from the specification only in example 5, see below)


SEED_CASES = [
    SeedCase("1 first connect", ((CAFEBABE, 0),), (), 0, 0, 0, 0),
    SeedCase("2 no failover, no snapshot, seen 5", ((CAFEBABE, 0),), ((CAFEBABE, 0),), 0, 5, 5, 5),
    SeedCase("3 no failover, snapshot 6, seen 7", ((CAFEBABE, 0),), ((CAFEBABE, 0),), 6, 7, 7, 7),
    SeedCase("4 deadbeef at 5, snapshot 6, seen 7", ((DEADBEEF, 5), (CAFEBABE, 0)), ((CAFEBABE, 0),),
             6, 7, 5, 5),
    # Example 5: the specification restarts from the last complete snapshot (6). The gateway resumes an incomplete
    # snapshot itself (repeated snapshot start), and the buffered seqno 7 is shared history (branch point 8),
    # so the client keeps its buffer: restart point 7, no rollback (kv_engine's answer when the open snapshot
    # lies in the shared history, tests/schemas/test_failover_log.py example 5).
    SeedCase("5 deadbeef at 8, snapshot 6, seen 7", ((DEADBEEF, 8), (CAFEBABE, 0)), ((CAFEBABE, 0),),
             6, 7, 6, 7),
    SeedCase("6 deadbeef at 8, client ba5eba11 at 7, snapshot 7, seen 9", ((DEADBEEF, 8), (CAFEBABE, 0)),
             ((BA5EBA11, 7), (CAFEBABE, 0)), 7, 9, 7, 7),
    SeedCase("7 deadbeef at 8, client ba5eba11 at 7, snapshot 6, seen 9", ((DEADBEEF, 8), (CAFEBABE, 0)),
             ((BA5EBA11, 7), (CAFEBABE, 0)), 6, 9, 6, 6),
    SeedCase("8 deadbeef with no replica, client ba5eba11 at 7, snapshot 7, seen 9", ((DEADBEEF, 0),),
             ((BA5EBA11, 7), (CAFEBABE, 0)), 7, 9, 0, 0),
]


@pytest.mark.parametrize("case", SEED_CASES, ids=[c.name for c in SEED_CASES])
def test_seed_001_worked_examples_at_the_client(case: SeedCase) -> None:
    f = Feed()
    vbuuid = case.client[0][0] if case.client else CAFEBABE
    if case.client:
        f.flog(*case.client, high=case.seen_through)
    s, t = case.snapshot_at, case.seen_through
    if s:
        f.snap(1, s, vbuuid)
        (ev,) = f.data(s, (1, s), vbuuid)
        assert isinstance(ev, Snapshot)
    if t > s:
        f.snap(s + 1, OPEN_END, vbuuid)
        for q in range(s + 1, t + 1):
            assert f.data(q, (s + 1, OPEN_END), vbuuid) == []
    assert f.r.state.applied_seqno == s
    evs = f.flog(*case.server, high=HIGH)
    rbs = [e for e in evs if isinstance(e, Rollback)]
    if rbs:
        (rb,) = rbs
        restart = rb.restart_seqno
        assert rb.applied_seqno == s and restart < s and rb.reason == "failover-log-divergence"
    elif f.r.has_partial:
        restart = f.r.last_change.seqno if f.r.last_change else 0
    else:
        restart = f.r.state.applied_seqno
    assert restart == case.client_answer
    if case.client_answer != case.seed_answer:
        assert case.name.startswith("5 ") and restart == t and case.seed_answer == s
    # a rollback event exactly when the answer is below what was applied
    assert bool(rbs) == (case.seed_answer < s)


# ------------------------------------------------------------------------------ feed_changes (client hot path)
_step = st.one_of(
    # a snapshot marker: start, length, branch
    st.tuples(st.just("snap"), st.integers(0, 40), st.integers(0, 8), st.sampled_from([CAFEBABE, DEADBEEF])),
    # a data record: seqno (duplicates, gaps and seqnos below what was applied included), branch
    st.tuples(st.just("data"), st.integers(0, 50), st.integers(0, 0), st.sampled_from([CAFEBABE, DEADBEEF])),
)


@settings(max_examples=300, deadline=None)
@given(steps=st.lists(_step, max_size=60), cuts=st.lists(st.booleans(), min_size=60, max_size=60),
       applied=st.integers(0, 20))
def test_feed_changes_is_feed_change_record_by_record(
        steps: list[tuple[str, int, int, int]], cuts: list[bool], applied: int) -> None:
    """``feed_changes`` (runs of data records in one call, as the Kafka client feeds them) yields the same
    snapshots and leaves the same state (buffer, range, counters, last change) as ``feed_change`` per record,
    wherever the runs are cut."""
    state = ConsumerPosition(0, CAFEBABE, applied, applied, applied)
    one, runs = VBucketReplayer(state.copy()), VBucketReplayer(state.copy())
    ev_one: list[object] = []
    ev_runs: list[object] = []
    run: list[Change] = []
    for i, (kind, a, b, vbuuid) in enumerate(steps):
        if kind == "snap":
            ev_runs += runs.feed_changes(run)
            run = []
            marker = rec(RecordType.SNAPSHOT, a, (a, a + b), vbuuid)
            ev_one += one.feed(marker, i)
            ev_runs += runs.feed(marker, i)
            continue
        ch = Change(RecordType.MUTATION, b"k%d" % a, b"v", 0, vbuuid, a, 1, 1, 0, 0, 0, i)
        snap = one.feed_change(ch)
        if snap is not None:
            ev_one.append(snap)
        run.append(ch)
        if cuts[i]:
            ev_runs += runs.feed_changes(run)
            run = []
    ev_runs += runs.feed_changes(run)
    assert ev_runs == ev_one
    assert [getattr(e, "state", None) for e in ev_runs] == [getattr(e, "state", None) for e in ev_one]
    for attr in ("_pending", "_range", "_vbuuid", "_last_offset", "accepted", "last_change", "state"):
        assert getattr(runs, attr) == getattr(one, attr), attr


# ---------------------------------------------------------------------------------------------- oversize records
def oversize(seqno: int, snap: tuple[int, int], key: bytes, size: int = 2_000_000) -> DecodedRecord:
    return DecodedRecord(RecordType.OVERSIZE, 0, CAFEBABE, seqno, snap[0], snap[1], key, None, 1, 7, None, None,
                         None, None, None, None, None, ValueFormat.AVRO, size, "MSG_SIZE_TOO_LARGE")


def test_oversize_record_takes_the_seqno_and_is_reported_apart() -> None:
    f = Feed()
    f.flog((CAFEBABE, 0))
    f.snap(1, 3)
    f.data(1, (1, 3))
    assert f(oversize(2, (1, 3), b"big")) == []
    [s] = f.data(3, (1, 3))
    assert isinstance(s, Snapshot)
    assert [c.seqno for c in s.changes] == [1, 3]
    assert [(o.key, o.seqno, o.size, o.reason, o.cas) for o in s.oversize] == [
        (b"big", 2, 2_000_000, "MSG_SIZE_TOO_LARGE", 7)]
    # an oversize record at the snapshot's end completes it; a duplicate of it is skipped
    f.snap(4, 5)
    f.data(4, (4, 5))
    [s2] = f(oversize(5, (4, 5), b"big2"))
    assert isinstance(s2, Snapshot) and [c.seqno for c in s2.changes] == [4]
    assert [o.seqno for o in s2.oversize] == [5] and f.r.state.applied_seqno == 5
    assert f(oversize(5, (4, 5), b"big2")) == []
    # a rollback discards a buffered oversize record with the rest of the snapshot
    f.snap(6, 8)
    f(oversize(6, (6, 8), b"big3"))
    f.rollback(5, 5, (DEADBEEF, 5), (CAFEBABE, 0))
    f.snap(6, 6, DEADBEEF)
    [s3] = f.data(6, (6, 6), DEADBEEF)
    assert isinstance(s3, Snapshot) and s3.oversize == () and [c.seqno for c in s3.changes] == [6]
