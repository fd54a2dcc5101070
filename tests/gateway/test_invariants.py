"""The record-format invariants (gateway/invariants.py): valid histories pass, every breach is caught.

Valid histories come from a model of the gateway publishing an engine's DCP stream (snapshots with filtered
items, stream restarts mid-snapshot, failovers, stream ends, rollbacks to the newest boundary <= R) and from
the real engine; each is encoded with :class:`RecordEncoder` and decoded back, then single mutations of it
(duplicates, reordering, dropped snapshot records, wrong headers...) must be detected.
"""

from __future__ import annotations

import contextlib
import itertools
import random
import re
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import (
    Bucket,
    BucketConfig,
    FailoverEntry,
    Item,
    KeyNotFound,
    Message,
    Op,
    SnapshotFlags,
    SnapshotMarker,
    StreamEnd,
    StreamEndReason,
)
from engine.kv.item import DATA_OPS
from gateway.exceptions import InvariantViolation
from gateway.invariants import check_partition, data_positions
from schemas.codec import RecordEncoder, decode
from schemas.records import DecodedRecord, KafkaRecord, RecordType, ValueFormat

Records = list[DecodedRecord]


def dec(rec: KafkaRecord) -> DecodedRecord:
    return decode(rec.key, rec.value, rec.headers)


# ---------------------------------------------------------------------------------------------- model histories
@st.composite
def vb_history(draw: st.DrawFn, vb: int, enc: RecordEncoder) -> Records:
    """One vbucket's records as a correct gateway publishes them."""
    out: Records = []
    uuids = itertools.count(1000 * (vb + 1))
    log = [FailoverEntry(next(uuids), 0)]
    pos = 0  # last seqno processed (published or filtered)
    snap = (0, 0)
    boundaries = [0]

    def restart(high: int) -> None:
        out.append(dec(enc.failover_log(vb, log, high, *snap)))

    restart(0)
    actions = draw(st.lists(st.sampled_from(["snapshot"] * 4 + ["restart", "stream-end", "rollback"]), max_size=10))
    for action in actions:
        if action == "snapshot":
            k = draw(st.integers(1, 5))
            seqnos = list(itertools.accumulate(draw(st.lists(st.integers(1, 3), min_size=k, max_size=k)),
                                               initial=pos))[1:]
            start, end = pos + 1, seqnos[-1] + draw(st.integers(0, 2))
            flags = draw(st.sampled_from([SnapshotFlags.MEMORY, SnapshotFlags.MEMORY | SnapshotFlags.CHK,
                                          SnapshotFlags.DISK | SnapshotFlags.CHK]))
            out.append(dec(enc.snapshot(SnapshotMarker(vb, start, end, flags), log[0].vbuuid)))
            snap = (start, end)
            cut = draw(st.one_of(st.none(), st.integers(1, k))) if k > 1 else None
            for i, s in enumerate(seqnos):
                if i == cut:
                    # The stream ends or the gateway crashes mid-snapshot: restart from (pos, snap); the engine
                    # repeats the snapshot's start, possibly with a later end.
                    if draw(st.booleans()):
                        out.append(dec(enc.stream_end(StreamEnd(vb, StreamEndReason.CLOSED), log[0].vbuuid, pos,
                                                      *snap)))
                    restart(end)
                    end += draw(st.integers(0, 3))
                    out.append(dec(enc.snapshot(SnapshotMarker(vb, start, end, SnapshotFlags.DISK), log[0].vbuuid)))
                    snap = (start, end)
                if not draw(st.booleans()) or draw(st.booleans()):  # ~3/4 published, the rest filtered out
                    op = draw(st.sampled_from(list(DATA_OPS)))
                    item = Item(b"k%d" % draw(st.integers(0, 20)), b"v" if op is Op.MUTATION else None, vb, s,
                                draw(st.integers(1, 10)), draw(st.integers(0, 2**64 - 1)), 0, 0, 0, op)
                    out.append(dec(enc.data(item, log[0].vbuuid, *snap)))
                pos = s
            pos = end
            boundaries.append(end)
        elif action == "restart":
            if draw(st.booleans()):  # a failover: new branch at the engine's high seqno
                log = [FailoverEntry(next(uuids), pos), *log]
            restart(pos)
        elif action == "stream-end":
            reason = draw(st.sampled_from(list(StreamEndReason)))
            out.append(dec(enc.stream_end(StreamEnd(vb, reason), log[0].vbuuid, pos, *snap)))
            restart(pos)
        else:  # the engine answers ROLLBACK(r): back to the newest boundary <= r, new branch
            r = draw(st.integers(0, pos))
            b = max(x for x in boundaries if x <= r)
            boundaries = [x for x in boundaries if x <= b]
            log = [FailoverEntry(next(uuids), r), *(e for e in log if e.seqno <= r)]
            out.append(dec(enc.rollback(vb, r, log, snap_start=b, snap_end=b)))
            snap = (b, b)
            pos = b
            restart(r + draw(st.integers(0, 5)))
    return out


@st.composite
def partition_history(draw: st.DrawFn) -> Records:
    """Several vbuckets' histories interleaved in one partition (per-vbucket order kept)."""
    enc = RecordEncoder(draw(st.sampled_from(list(ValueFormat))))
    vbs = draw(st.lists(st.integers(0, 1023), min_size=1, max_size=3, unique=True))
    queues = [draw(vb_history(vb, enc)) for vb in vbs]
    merged: Records = []
    order = draw(st.randoms(use_true_random=False))
    while any(queues):
        q = order.choice([q for q in queues if q])
        merged.append(q.pop(0))
    return merged


# ---------------------------------------------------------------------------------------------- mutations
Mutation = tuple[Records, int, int, int]  # mutated records, vbucket, seqno and offset of the violation


def vb_indices(recs: Records, vb: int) -> list[int]:
    return [i for i, r in enumerate(recs) if r.vbucket == vb]


def m_duplicate(recs: Records, rnd: random.Random) -> Mutation | None:
    data = [i for i, r in enumerate(recs) if r.is_data]
    if not data:
        return None
    i = rnd.choice(data)
    return [*recs[: i + 1], recs[i], *recs[i + 1 :]], recs[i].vbucket, recs[i].seqno, i + 1


def m_swap(recs: Records, rnd: random.Random) -> Mutation | None:
    pairs = []
    for vb in {r.vbucket for r in recs}:
        idx = vb_indices(recs, vb)
        pairs += [(a, b) for a, b in itertools.pairwise(idx) if recs[a].is_data and recs[b].is_data]
    if not pairs:
        return None
    a, b = rnd.choice(pairs)
    out = list(recs)
    out[a], out[b] = out[b], out[a]
    return out, recs[a].vbucket, recs[a].seqno, b


def m_drop_snapshot(recs: Records, rnd: random.Random) -> Mutation | None:
    cands = []
    for vb in {r.vbucket for r in recs}:
        idx = vb_indices(recs, vb)
        cands += [(a, b) for a, b in itertools.pairwise(idx)
                  if recs[a].type is RecordType.SNAPSHOT and recs[b].is_data]
    if not cands:
        return None
    a, b = rnd.choice(cands)
    return recs[:a] + recs[a + 1 :], recs[b].vbucket, recs[b].seqno, b - 1


def m_seqno_outside_snapshot(recs: Records, rnd: random.Random) -> Mutation | None:
    data = [i for i, r in enumerate(recs) if r.is_data]
    if not data:
        return None
    i = rnd.choice(data)
    seqno = recs[i].snap_end + rnd.randint(1, 3)
    return [*recs[:i], replace(recs[i], seqno=seqno), *recs[i + 1 :]], recs[i].vbucket, seqno, i


def m_wrong_snap_headers(recs: Records, rnd: random.Random) -> Mutation | None:
    data = [i for i, r in enumerate(recs) if r.is_data]
    if not data:
        return None
    i = rnd.choice(data)
    r = recs[i]
    bad = replace(r, snap_end=r.snap_end + 1) if rnd.random() < 0.5 else replace(r, snap_start=max(0, r.snap_start - 1))
    if bad == r:
        bad = replace(r, snap_end=r.snap_end + 1)
    return [*recs[:i], bad, *recs[i + 1 :]], r.vbucket, r.seqno, i


def m_wrong_vbuuid(recs: Records, rnd: random.Random) -> Mutation | None:
    data = [i for i, r in enumerate(recs) if r.is_data]
    if not data:
        return None
    i = rnd.choice(data)
    r = recs[i]
    return [*recs[:i], replace(r, vbuuid=r.vbuuid ^ 1), *recs[i + 1 :]], r.vbucket, r.seqno, i


def m_not_above_rollback(recs: Records, rnd: random.Random) -> Mutation | None:
    cands = []
    for vb in {r.vbucket for r in recs}:
        idx = vb_indices(recs, vb)
        for n, a in enumerate(idx):
            if recs[a].type is RecordType.ROLLBACK:
                nxt = next((b for b in idx[n + 1 :] if recs[b].is_data or recs[b].type is RecordType.ROLLBACK), None)
                if nxt is not None and recs[nxt].is_data:
                    cands.append((a, nxt))
    if not cands:
        return None
    a, b = rnd.choice(cands)
    seqno = rnd.randint(0, recs[a].snap_end)
    return [*recs[:b], replace(recs[b], seqno=seqno), *recs[b + 1 :]], recs[b].vbucket, seqno, b


def m_data_before_snapshot(recs: Records, rnd: random.Random) -> Mutation | None:
    data = [i for i, r in enumerate(recs) if r.is_data]
    if not data:
        return None
    r = recs[rnd.choice(data)]
    first = vb_indices(recs, r.vbucket)[0]  # the vbucket's first record: its stream-start failover log
    return [*recs[: first + 1], r, *recs[first + 1 :]], r.vbucket, r.seqno, first + 1


def m_data_after_stream_end(recs: Records, rnd: random.Random) -> Mutation | None:
    ends = [i for i, r in enumerate(recs) if r.type is RecordType.STREAM_END]
    data = [i for i, r in enumerate(recs) if r.is_data]
    if not ends or not data:
        return None
    i = rnd.choice(ends)
    r = replace(recs[rnd.choice(data)], vbucket=recs[i].vbucket, seqno=recs[i].seqno + 1)
    return [*recs[: i + 1], r, *recs[i + 1 :]], r.vbucket, r.seqno, i + 1


def m_stream_end_below_data(recs: Records, rnd: random.Random) -> Mutation | None:
    cands = []
    for vb in {r.vbucket for r in recs}:
        last_data: int | None = None
        for i in vb_indices(recs, vb):
            t = recs[i].type
            if recs[i].is_data:
                last_data = recs[i].seqno
            elif t is RecordType.ROLLBACK:
                last_data = None
            elif t is RecordType.STREAM_END and last_data:
                cands.append((i, last_data))
    if not cands:
        return None
    i, last = rnd.choice(cands)
    seqno = rnd.randint(0, last - 1)
    return [*recs[:i], replace(recs[i], seqno=seqno), *recs[i + 1 :]], recs[i].vbucket, seqno, i


def m_rollback_restart_above(recs: Records, rnd: random.Random) -> Mutation | None:
    rbs = [i for i, r in enumerate(recs) if r.type is RecordType.ROLLBACK]
    if not rbs:
        return None
    i = rnd.choice(rbs)
    r = recs[i]
    above = r.seqno + rnd.randint(1, 3)
    return [*recs[:i], replace(r, snap_start=above, snap_end=above), *recs[i + 1 :]], r.vbucket, r.seqno, i


def m_failover_vbuuid(recs: Records, rnd: random.Random) -> Mutation | None:
    fls = [i for i, r in enumerate(recs) if r.type in (RecordType.FAILOVER_LOG, RecordType.ROLLBACK)]
    i = rnd.choice(fls)
    r = recs[i]
    return [*recs[:i], replace(r, vbuuid=r.vbuuid + 1), *recs[i + 1 :]], r.vbucket, r.seqno, i


MUTATIONS: dict[str, Callable[[Records, random.Random], Mutation | None]] = {
    "duplicate": m_duplicate,
    "swap": m_swap,
    "drop-snapshot": m_drop_snapshot,
    "seqno-outside-snapshot": m_seqno_outside_snapshot,
    "wrong-snap-headers": m_wrong_snap_headers,
    "wrong-vbuuid": m_wrong_vbuuid,
    "not-above-rollback": m_not_above_rollback,
    "data-before-snapshot": m_data_before_snapshot,
    "data-after-stream-end": m_data_after_stream_end,
    "stream-end-below-data": m_stream_end_below_data,
    "rollback-restart-above": m_rollback_restart_above,
    "failover-vbuuid": m_failover_vbuuid,
}


# ---------------------------------------------------------------------------------------------- properties
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(partition_history())
def test_valid_histories_pass(recs: Records) -> None:
    check_partition(recs)
    check_partition(enumerate(recs))  # (offset, record) pairs
    check_partition((0, o, r) for o, r in enumerate(recs))  # (partition, offset, record) triples
    positions = data_positions(recs)
    assert all(n == 1 for n in positions.values())
    assert sum(positions.values()) == sum(r.is_data for r in recs)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(partition_history(), st.sampled_from(sorted(MUTATIONS)), st.randoms(use_true_random=False))
def test_every_single_mutation_is_detected(recs: Records, kind: str, rnd: random.Random) -> None:
    mutated = MUTATIONS[kind](recs, rnd)
    if mutated is None:
        return  # not applicable to this history
    bad, vb, seqno, offset = mutated
    with pytest.raises(InvariantViolation) as e:
        check_partition(enumerate(bad))
    msg = str(e.value)
    assert (e.value.vbucket, e.value.seqno, e.value.offset) == (vb, seqno, offset), (kind, msg)
    assert f"vbucket {vb}, seqno {seqno} at offset {offset}:" in msg, msg


def test_mutations_are_exercised() -> None:
    """Every mutation kind applies to some generated history (so the property above tests them all)."""
    enc = RecordEncoder()
    seen: set[str] = set()
    rnd = random.Random(7)

    @settings(max_examples=200, deadline=None, database=None)
    @given(vb_history(3, enc))
    def collect(recs: Records) -> None:
        seen.update(k for k, m in MUTATIONS.items() if m(recs, rnd) is not None)

    collect()
    assert seen == set(MUTATIONS)


# ---------------------------------------------------------------------------------------------- examples
ENC = RecordEncoder()
LOG = [FailoverEntry(500, 0)]


def item(seqno: int, vb: int = 1) -> Item:
    return Item(b"k", b"v", vb, seqno, 1, 1)


def snap(start: int, end: int, vb: int = 1, vbuuid: int = 500) -> DecodedRecord:
    return dec(ENC.snapshot(SnapshotMarker(vb, start, end, SnapshotFlags.MEMORY), vbuuid))


def data(seqno: int, start: int, end: int, vb: int = 1, vbuuid: int = 500) -> DecodedRecord:
    return dec(ENC.data(item(seqno, vb), vbuuid, start, end))


def test_examples_of_violations_name_vbucket_and_seqno() -> None:
    fl = dec(ENC.failover_log(1, LOG, 0, 0, 0))
    ok = [fl, snap(1, 3), data(1, 1, 3), data(3, 1, 3), snap(4, 4), data(4, 4, 4)]
    check_partition(ok)
    cases = {
        "before any snapshot record": [fl, data(1, 0, 0)],
        "duplicate or out of order": [fl, snap(1, 3), data(2, 1, 3), data(2, 1, 3)],
        "outside its snapshot": [fl, snap(1, 3), data(4, 1, 3)],
        "last snapshot record is [1, 3]": [fl, snap(1, 3), data(2, 1, 4)],
        "branch is 500": [fl, snap(1, 3), data(2, 1, 3, vbuuid=501)],
        "without a new snapshot record": [fl, snap(1, 3), data(1, 1, 3), dec(ENC.failover_log(1, LOG, 3, 1, 3)),
                                          data(2, 1, 3)],
        "follows a stream-end": [fl, snap(1, 3), data(1, 1, 3),
                                 dec(ENC.stream_end(StreamEnd(1, StreamEndReason.OK), 500, 1, 1, 3)), data(2, 1, 3)],
    }
    for what, recs in cases.items():
        with pytest.raises(InvariantViolation, match=re.escape(what)) as e:
            check_partition(recs)
        assert e.value.vbucket == 1 and f"vbucket 1, seqno {recs[-1].seqno}:" in str(e.value)
        assert e.value.offset is None


def test_rollback_resets_the_order_to_its_restart_point() -> None:
    fl = dec(ENC.failover_log(1, LOG, 0, 0, 0))
    new_log = [FailoverEntry(600, 5), *LOG]
    head = [fl, snap(1, 5), data(3, 1, 5), data(5, 1, 5), snap(6, 9), data(8, 6, 9)]
    rb = dec(ENC.rollback(1, 7, new_log, snap_start=5, snap_end=5))
    restart = dec(ENC.failover_log(1, new_log, 7, 5, 5))
    check_partition([*head, rb, restart, snap(6, 7, vbuuid=600), data(6, 6, 7, vbuuid=600)])
    # default restart point = the rollback seqno: data must then be above it
    rb7 = dec(ENC.rollback(1, 7, new_log))
    check_partition([*head, rb7, dec(ENC.failover_log(1, new_log, 7, 7, 7)), snap(8, 9, vbuuid=600),
                     data(8, 8, 9, vbuuid=600)])
    with pytest.raises(InvariantViolation, match="rollback to 7") as e:
        check_partition([*head, rb7, dec(ENC.failover_log(1, new_log, 7, 7, 7)), snap(6, 9, vbuuid=600),
                         data(6, 6, 9, vbuuid=600)])
    assert (e.value.vbucket, e.value.seqno) == (1, 6)
    # the old branch is over after the rollback
    with pytest.raises(InvariantViolation, match="branch is 600"):
        check_partition([*head, rb, restart, snap(6, 7, vbuuid=500)])


def test_vbuckets_are_independent_in_one_partition() -> None:
    a = [dec(ENC.failover_log(1, LOG, 0, 0, 0)), snap(1, 2), data(1, 1, 2), data(2, 1, 2)]
    b = [dec(ENC.failover_log(2, LOG, 0, 0, 0)), snap(1, 2, vb=2), data(1, 1, 2, vb=2), data(2, 1, 2, vb=2)]
    merged = [a[0], b[0], a[1], b[1], a[2], b[2], a[3], b[3]]
    check_partition(merged)
    assert data_positions(merged) == {(1, 500, 1): 1, (1, 500, 2): 1, (2, 500, 1): 1, (2, 500, 2): 1}
    dup = [*merged, b[3]]
    with pytest.raises(InvariantViolation, match="vbucket 2, seqno 2 at offset 8"):
        check_partition(enumerate(dup))
    assert data_positions(dup)[(2, 500, 2)] == 2


def test_real_engine_stream_with_restarts_satisfies_the_invariants(tmp_path: Path) -> None:
    """The real engine's DCP stream, encoded as the contract says, with streams closed at random points
    (possibly mid-snapshot) and re-requested from the position after the last record."""
    rnd = random.Random(11)
    bucket = Bucket(BucketConfig(data_dir=tmp_path / "data", num_vbuckets=4, seed=5, checkpoint_max_items=7,
                                 tune_gc=False))
    try:
        for fmt in ValueFormat:
            _engine_round(bucket, RecordEncoder(fmt), rnd)
    finally:
        bucket.close()


class _Pos:
    def __init__(self) -> None:
        self.seqno = 0
        self.snap = (0, 0)
        self.log: list[FailoverEntry] = []


def _engine_round(bucket: Bucket, enc: RecordEncoder, rnd: random.Random) -> None:
    out: list[KafkaRecord] = []
    producer = bucket.dcp_producer(f"test-{enc.value_format.value}")
    pos = {vb: _Pos() for vb in range(bucket.num_vbuckets)}

    def start(vb: int) -> None:
        p = pos[vb]
        p.log = producer.stream_request(vb, p.seqno, vbuuid=p.log[0].vbuuid if p.log else 0,
                                        snap_start=p.snap[0], snap_end=p.snap[1])
        out.append(enc.failover_log(vb, p.log, bucket.vbucket(vb).high_seqno, *p.snap))

    def handle(msgs: list[Message]) -> None:
        for m in msgs:
            p = pos[m.vbucket]
            if isinstance(m, SnapshotMarker):
                p.snap = (m.start, m.end)
                out.append(enc.snapshot(m, p.log[0].vbuuid))
            elif isinstance(m, StreamEnd):
                out.append(enc.stream_end(m, p.log[0].vbuuid, p.seqno, *p.snap))
                start(m.vbucket)
            else:
                assert isinstance(m, Item)
                out.append(enc.data(m, p.log[0].vbuuid, *p.snap))
                p.seqno = m.seqno

    for vb in pos:
        start(vb)
    keys = [f"key-{i}" for i in range(40)]
    for n in range(30):
        for _ in range(rnd.randint(1, 25)):
            k = rnd.choice(keys)
            if rnd.random() < 0.2:
                with contextlib.suppress(KeyNotFound):
                    bucket.delete(k)
            else:
                bucket.set(k, b'{"r": %d}' % n)
        if rnd.random() < 0.5:
            bucket.flush()
        handle(producer.step(rnd.randint(1, 40)))
        if rnd.random() < 0.3:
            producer.close_stream(rnd.randrange(bucket.num_vbuckets))
    while msgs := producer.step(10_000):
        handle(msgs)
    recs = [dec(r) for r in out]
    check_partition(enumerate(recs))
    positions = data_positions(recs)
    assert positions and all(n == 1 for n in positions.values())
    for vb in pos:
        assert max((s for v, _, s in positions if v == vb), default=0) == bucket.vbucket(vb).high_seqno
    producer.close()
