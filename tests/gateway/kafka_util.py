"""Reading a gateway topic back in tests (real broker) and a reference consumer of the record format."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import Consumer, KafkaError, TopicPartition
from confluent_kafka.admin import AdminClient

from gateway.resume import READ_TO_END_FETCH_WAIT_MS
from schemas.codec import decode
from schemas.records import DecodedRecord, RecordType


def read_topic(bootstrap: str, topic: str, timeout: float = 60.0) -> list[tuple[int, int, DecodedRecord]]:
    """Every record of ``topic`` as (partition, offset, record), in partition then offset order."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    md = admin.list_topics(topic, timeout=10).topics[topic]
    parts = sorted(md.partitions)
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"t-{uuid.uuid4()}", "enable.auto.commit": False,
                  "enable.partition.eof": True, "auto.offset.reset": "earliest",
                  "fetch.wait.max.ms": READ_TO_END_FETCH_WAIT_MS})
    out: list[tuple[int, int, DecodedRecord]] = []
    try:
        c.assign([TopicPartition(topic, p, 0) for p in parts])
        pending = set(parts)
        deadline = time.monotonic() + timeout
        while pending:
            assert time.monotonic() < deadline, f"partitions {pending} never reached EOF"
            first = c.poll(0.5)  # then what is already fetched: consume(n, 0.5) would wait out the 0.5 s
            for m in ([first, *c.consume(9_999, 0)] if first is not None else []):
                err = m.error()
                if err is not None:
                    assert err.code() == KafkaError._PARTITION_EOF, err
                    pending.discard(m.partition())
                    continue
                partition, offset = m.partition(), m.offset()
                assert partition is not None and offset is not None
                out.append((partition, offset, decode(m.key(), m.value(), m.headers())))
    finally:
        c.close()
    out.sort(key=lambda t: (t[0], t[1]))
    return out


@dataclass
class _VB:
    docs: dict[bytes, bytes] = field(default_factory=dict)
    history: list[tuple[int, dict[bytes, bytes]]] = field(default_factory=lambda: [(0, {})])
    pending: list[DecodedRecord] = field(default_factory=list)
    snap: tuple[int, int] | None = None
    seqno: int = 0


class TopicReplica:
    """Applies a gateway topic with rollback semantics: whole snapshots only; on a rollback record, restore
    the state at the record's restart boundary (its snapshot range) -- what connectors/ will do for real."""

    def __init__(self) -> None:
        self.vbs: dict[int, _VB] = {}
        self.rollbacks = 0

    def apply_all(self, records: list[tuple[int, int, DecodedRecord]]) -> None:
        for _p, _o, r in records:
            self.apply(r)

    def apply(self, r: DecodedRecord) -> None:
        st = self.vbs.setdefault(r.vbucket, _VB())
        t = r.type
        if t is RecordType.SNAPSHOT:
            if st.snap is not None and st.pending and r.snap_start > st.snap[1]:
                self._commit(st)  # previous snapshot's tail was filtered: it is complete
            elif st.snap is not None and not st.pending and r.snap_start > st.snap[1]:
                st.history.append((st.snap[1], dict(st.docs)))
            st.snap = (r.snap_start, r.snap_end)
        elif t is RecordType.ROLLBACK:
            self.rollbacks += 1
            restart = r.snap_end
            while len(st.history) > 1 and st.history[-1][0] > restart:
                st.history.pop()
            b, docs = st.history[-1]
            assert b == restart or b <= r.seqno, (b, restart, r.seqno)
            st.docs = dict(docs)
            st.pending.clear()
            st.snap = None
        elif r.is_data:
            assert st.snap is not None
            st.pending.append(r)
            if r.seqno >= st.snap[1]:
                self._commit(st)

    def _commit(self, st: _VB) -> None:
        for r in st.pending:
            if r.type is RecordType.MUTATION:
                assert r.value is not None
                st.docs[r.key] = r.value  # type: ignore[index]
            else:
                st.docs.pop(r.key, None)  # type: ignore[arg-type]
        st.pending.clear()
        assert st.snap is not None
        st.history.append((st.snap[1], dict(st.docs)))

    def state(self) -> dict[bytes, tuple[bytes, int]]:
        out: dict[bytes, tuple[bytes, int]] = {}
        for vb, st in self.vbs.items():
            for k, v in st.docs.items():
                out[k] = (v, vb)
        return out


def engine_history(bucket: Any) -> set[tuple[int, int]]:
    """(vbucket, seqno) of every item the engine still holds in storage (current versions and history)."""
    out: set[tuple[int, int]] = set()
    for vb in bucket.vbuckets():
        for row in bucket.storage.scan(vb.id, 0, vb.high_seqno, 10**9):
            out.add((vb.id, row[1]))
    return out


class TopicChecks:
    """What the cluster harnesses (tests/gateway/test_cluster.py, test_process_cluster_gateway.py) check on their
    topic: a subclass sets ``broker``, ``topic``, ``partitions``, ``tmp`` and implements ``actives()`` (every
    live document of the cluster, ``key -> (value, vbucket)``)."""

    broker: Any
    topic: str
    partitions: int
    tmp: Any

    def actives(self) -> dict[bytes, tuple[bytes, int]]:
        raise NotImplementedError

    def records(self) -> list[tuple[int, int, DecodedRecord]]:
        return read_topic(self.broker.bootstrap_servers, self.topic)

    def check(self) -> list[tuple[int, int, DecodedRecord]]:
        """Invariants on every partition and the reference replica equal to the actives."""
        from gateway.invariants import check_partition

        recs = self.records()
        for part in range(self.partitions):
            check_partition([(o, r) for p, o, r in recs if p == part])
        replica = TopicReplica()
        replica.apply_all(recs)
        assert replica.state() == self.actives()
        return recs

    def replicate(self) -> Any:
        """The rollback-aware Replicator (connectors/) run until caught up on the topic."""
        from connectors.replicate import Replicator

        rep = Replicator(self.broker.bootstrap_servers, self.topic, self.tmp / f"r{uuid.uuid4().hex[:6]}.sqlite")
        rep.run(until_caught_up=True)
        return rep

