"""The Spark source's engine room, free of Spark: snapshot boundaries, offsets and deterministic replay.

A **boundary** of a Kafka partition is an offset ``X`` such that every vbucket of the partition (vbucket ``v``
lives in partition ``v mod P``) has no snapshot open at ``X``: each one's records before ``X`` end with a complete
snapshot (or a rollback / failover-log record, or nothing at all). Replaying ``[S, X)`` from a boundary ``S``
therefore only ever yields complete snapshots, and the state of every vbucket's
:class:`~connectors.client.replay.VBucketReplayer` at ``X`` is fully described by its
:class:`~connectors.client.replay.ConsumerPosition` (nothing buffered). That state travels in the stream offset,
so any micro-batch can be replayed on any executor, any number of times, with exactly the same result.

Offsets (JSON, what Spark writes into the query's checkpoint ``offsets/`` log)::

    {"topic": "dcp.travel-sample",
     "partitions": {"0": 1234, "1": 1200},                 # next Kafka offset to read, a boundary
     "state": {"0": {"vbucket": 0, "vbuuid": ..., "applied_seqno": ..., "snap_start": ..., "snap_end": ...,
                     "offset": ..., "failover_log": [[vbuuid, seqno], ...]}, ...}}

``state`` holds the replayer state of every vbucket seen so far (a few hundred bytes each).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Generator, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import Consumer, KafkaError, TopicPartition

from connectors.client.replay import Change, ConsumerPosition, Rollback, Snapshot, VBucketReplayer
from schemas.codec import decode, read_change
from schemas.errors import RecordFormatError
from schemas.records import DecodedRecord, RecordType

_U64 = 1 << 64
_I64_MAX = (1 << 63) - 1

#: Column names and Spark SQL types of the rows (``DcpDataSource.schema()``).
COLUMNS: tuple[tuple[str, str], ...] = (
    ("op", "string"),
    ("key", "binary"),
    ("value", "binary"),
    ("vbucket", "int"),
    ("vbuuid", "bigint"),
    ("seqno", "bigint"),
    ("snap_start", "bigint"),
    ("snap_end", "bigint"),
    ("rev", "bigint"),
    ("cas", "bigint"),
    ("kafka_partition", "int"),
    ("kafka_offset", "bigint"),
    # the rest of a change's metadata (null for rollback rows): what XDCR writes with meta (docs/xdcr.md)
    ("flags", "bigint"),
    ("expiry", "bigint"),
    ("datatype", "int"),
)
SCHEMA_DDL = ", ".join(f"{n} {t}" for n, t in COLUMNS)

#: ``op`` of the row a corrupt record gives with ``corruptRecords=row`` (docs/spark.md "Corrupt records")
CORRUPT_OP = "corrupt"
#: values of the ``corruptRecords`` option: ``fail`` (the default: reading the range that holds one fails),
#: ``row`` (one ``corrupt`` row per corrupt record)
CORRUPT_MODES = ("fail", "row")

Row = tuple[Any, ...]


class DcpSourceError(ValueError):
    """Bad options or an unreadable topic, with a message saying which."""


def signed64(v: int) -> int:
    """A u64 as Spark's signed ``long`` (two's complement: values >= 2**63 come out negative)."""
    return v - _U64 if v > _I64_MAX else v


# ------------------------------------------------------------------------------------------------ options
@dataclass(frozen=True)
class SourceOptions:
    bootstrap: str
    topic: str
    starting: str = "earliest"
    max_per_partition: int | None = None
    kafka: dict[str, str] = field(default_factory=dict)
    timeout: float = 60.0
    #: at most this many Spark input partitions per batch (Kafka partitions are grouped)
    num_partitions: int = 8
    #: what reading a corrupt record does (``CORRUPT_MODES``); planning (boundaries) always passes over it
    corrupt: str = "fail"

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> SourceOptions:
        opts = {str(k): str(v) for k, v in options.items()}
        low = {k.lower(): v for k, v in opts.items()}
        bootstrap = low.get("bootstrap.servers") or low.get("kafka.bootstrap.servers")
        if not bootstrap:
            raise DcpSourceError(
                "dcp source: option 'bootstrap.servers' (or 'kafka.bootstrap.servers') is required, "
                "e.g. .option('bootstrap.servers', 'localhost:9092')")
        topic = low.get("topic") or low.get("subscribe")
        if not topic:
            raise DcpSourceError("dcp source: option 'topic' is required (the gateway topic, e.g. 'dcp.travel-sample')")
        if "," in topic:
            raise DcpSourceError(f"dcp source: option 'topic' names one topic, got {topic!r}")
        starting = low.get("startingoffsets", "earliest").strip().lower()
        if starting not in ("earliest", "latest"):
            raise DcpSourceError(
                f"dcp source: startingOffsets must be 'earliest' or 'latest', got {starting!r} "
                "(arbitrary offsets are not snapshot boundaries)")
        mx: int | None = None
        raw_max = low.get("maxrecordsperpartitionperbatch")
        if raw_max is not None:
            try:
                mx = int(raw_max)
            except ValueError:
                mx = 0
            if mx <= 0:
                raise DcpSourceError(f"dcp source: maxRecordsPerPartitionPerBatch must be a positive integer, got {raw_max!r}")
        timeout = float(low.get("timeout", "60"))
        nparts = 8
        raw_n = low.get("numpartitions")
        if raw_n is not None:
            nparts = int(raw_n) if raw_n.isdigit() else 0
            if nparts <= 0:
                raise DcpSourceError(f"dcp source: numPartitions must be a positive integer, got {raw_n!r}")
        corrupt = low.get("corruptrecords", "fail").strip().lower()
        if corrupt not in CORRUPT_MODES:
            raise DcpSourceError(f"dcp source: corruptRecords must be 'fail' or 'row', got {corrupt!r}")
        kafka = {k[len("kafka."):]: v for k, v in opts.items()
                 if k.lower().startswith("kafka.") and k.lower() != "kafka.bootstrap.servers"}
        return cls(bootstrap, topic, starting, mx, kafka, timeout, nparts, corrupt)

    def consumer_config(self) -> dict[str, Any]:
        return {"fetch.wait.max.ms": 50, **self.kafka, "bootstrap.servers": self.bootstrap, "group.id": f"dcp-spark-{uuid.uuid4().hex}",
                "enable.auto.commit": False, "enable.partition.eof": True, "auto.offset.reset": "earliest"}


# ------------------------------------------------------------------------------------------------ offsets
@dataclass
class PartitionPosition:
    """A boundary of one partition and the replayer states of its vbuckets there."""

    offset: int
    states: dict[int, dict[str, Any]] = field(default_factory=dict)


def to_offset(topic: str, positions: Mapping[int, PartitionPosition]) -> dict[str, Any]:
    return {
        "topic": topic,
        "partitions": {str(p): pos.offset for p, pos in sorted(positions.items())},
        "state": {str(vb): st for p in sorted(positions) for vb, st in sorted(positions[p].states.items())},
    }


def from_offset(offset: Mapping[str, Any], partitions: int) -> dict[int, PartitionPosition]:
    out = {int(p): PartitionPosition(int(o)) for p, o in offset.get("partitions", {}).items()}
    for vb, st in offset.get("state", {}).items():
        p = int(vb) % partitions
        out.setdefault(p, PartitionPosition(0)).states[int(vb)] = st
    return out


def topic_partitions(opts: SourceOptions) -> int:
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({**opts.kafka, "bootstrap.servers": opts.bootstrap})
    md = admin.list_topics(opts.topic, timeout=opts.timeout).topics.get(opts.topic)
    if md is None or md.error is not None or not md.partitions:
        err = None if md is None else md.error
        raise DcpSourceError(f"dcp source: topic {opts.topic!r} not found on {opts.bootstrap} ({err})")
    return len(md.partitions)


# ------------------------------------------------------------------------------------------------ replay
class PartitionReplay:
    """Every vbucket of one partition through its :class:`VBucketReplayer`, tracking boundaries."""

    def __init__(self, partition: int, start: PartitionPosition) -> None:
        self.partition = partition
        self.start = start.offset
        self.replayers: dict[int, VBucketReplayer] = {
            vb: VBucketReplayer(ConsumerPosition.from_dict(st)) for vb, st in start.states.items()}
        #: snap_end of the last snapshot record per vbucket (an open range until applied reaches it)
        self._open_end: dict[int, int | None] = {}
        self._open: set[int] = set()
        self.boundary = start.offset
        #: states at ``boundary`` of the vbuckets that moved since (copy on write)
        self._at_boundary: dict[int, dict[str, Any] | None] = {}
        self.next_offset = start.offset

    def feed(self, rec: DecodedRecord, offset: int) -> list[Snapshot | Rollback]:
        vb = rec.vbucket
        rep = self.replayers.get(vb)
        if vb not in self._at_boundary:
            self._at_boundary[vb] = None if rep is None else rep.state.to_dict()
        if rep is None:
            rep = self.replayers[vb] = VBucketReplayer(ConsumerPosition(vb))
        events = rep.feed(rec, offset)
        if rec.type is RecordType.SNAPSHOT:
            self._open_end[vb] = rec.snap_end
        elif rec.type is RecordType.ROLLBACK:
            self._open_end[vb] = None
        end = self._open_end.get(vb)
        if rep.has_partial or (end is not None and end > rep.state.applied_seqno):
            self._open.add(vb)
        else:
            self._open.discard(vb)
        self.next_offset = offset + 1
        if not self._open:
            self.boundary = offset + 1
            self._at_boundary = {}
        return events

    def feed_change(self, ch: Change) -> Snapshot | None:
        """:meth:`feed` for a data record already read into a :class:`Change` (the executors' hot path)."""
        vb = ch.vbucket
        rep = self.replayers.get(vb)
        if vb not in self._at_boundary:
            self._at_boundary[vb] = None if rep is None else rep.state.to_dict()
        if rep is None:
            rep = self.replayers[vb] = VBucketReplayer(ConsumerPosition(vb))
        snap = rep.feed_change(ch)
        end = self._open_end.get(vb)
        if rep.has_partial or (end is not None and end > rep.state.applied_seqno):
            self._open.add(vb)
        else:
            self._open.discard(vb)
        self.next_offset = ch.offset + 1
        if not self._open:
            self.boundary = ch.offset + 1
            self._at_boundary = {}
        return snap

    def skip(self, offset: int) -> None:
        """A corrupt record at ``offset``: it belongs to no vbucket (its vbucket cannot be read), so it opens and
        closes nothing; the partition moves past it (a boundary when no snapshot is open), as the Kafka client's
        consumer goes on after a corrupt record it dead-lettered."""
        self.next_offset = offset + 1
        if not self._open:
            self.boundary = offset + 1
            self._at_boundary = {}

    def position(self) -> PartitionPosition:
        """The newest boundary seen and the states there."""
        states: dict[int, dict[str, Any]] = {}
        for vb, rep in self.replayers.items():
            if vb in self._at_boundary:
                st = self._at_boundary[vb]
                if st is not None:
                    states[vb] = st
            else:
                states[vb] = rep.state.to_dict()
        return PartitionPosition(self.boundary, states)


def _consume(opts: SourceOptions, starts: Mapping[int, int]) -> Generator[tuple[int, Any], bool | None, None]:
    """(partition, message) of each partition from its start offset until EOF; (partition, None) at EOF."""
    c = Consumer(opts.consumer_config())
    try:
        parts = [p for p in starts]
        if not parts:
            return
        c.assign([TopicPartition(opts.topic, p, starts[p]) for p in parts])
        pending = set(parts)
        deadline = time.monotonic() + opts.timeout
        while pending:
            # what is fetched already, without waiting; else wait for the first record only (a batch call
            # with a timeout would wait for a full batch at the end of every partition)
            msgs = c.consume(5000, 0)
            if not msgs:
                first = c.poll(0.2)
                msgs = [first, *c.consume(4999, 0)] if first is not None else []
            if not msgs and time.monotonic() > deadline:
                raise DcpSourceError(f"dcp source: partitions {sorted(pending)} of {opts.topic!r} never reached "
                                     f"their end within {opts.timeout}s")
            for m in msgs:
                mp: int = m.partition() or 0
                err = m.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        if mp in pending:
                            pending.discard(mp)
                            yield mp, None
                        continue
                    raise DcpSourceError(f"dcp source: reading {opts.topic!r}: {err}")
                if mp in pending:
                    deadline = time.monotonic() + opts.timeout
                    stop = yield mp, m
                    if stop:
                        pending.discard(mp)
                        c.pause([TopicPartition(opts.topic, mp)])
    finally:
        c.close()


def scan_boundaries(
    opts: SourceOptions, starts: Mapping[int, PartitionPosition], max_per_partition: int | None = None
) -> dict[int, PartitionPosition]:
    """From each partition's boundary, read to its end and return the newest boundary (with states).

    With ``max_per_partition``: stop at the first boundary at least that many records after the start (a
    partition always advances by at least one complete snapshot set when it has one)."""
    replays = {p: PartitionReplay(p, pos) for p, pos in starts.items()}
    gen = _consume(opts, {p: pos.offset for p, pos in starts.items()})
    try:
        item = next(gen)
        while True:
            p, m = item
            stop = False
            if m is not None:
                rp = replays[p]
                v = m.value()
                ch = read_change(v, m.offset(), Change) if v is not None else None
                if ch is not None:  # a data record, from its value alone
                    rp.feed_change(ch)
                else:
                    try:
                        rec = decode(m.key(), v, m.headers())
                    except RecordFormatError:
                        # planning never fails on a corrupt record: reading the range decides (corruptRecords)
                        rp.skip(m.offset())
                    else:
                        rp.feed(rec, m.offset())
                if max_per_partition is not None and rp.boundary - rp.start >= max_per_partition:
                    stop = True
            item = gen.send(stop)
    except StopIteration:
        pass
    return {p: rp.position() for p, rp in replays.items()}


def initial_positions(opts: SourceOptions, partitions: int) -> dict[int, PartitionPosition]:
    """``earliest``: each partition's first offset with empty states; ``latest``: its newest boundary."""
    starts = {p: PartitionPosition(0) for p in range(partitions)}
    c = Consumer(opts.consumer_config())
    try:
        for p in range(partitions):
            try:
                low, _high = c.get_watermark_offsets(TopicPartition(opts.topic, p), timeout=opts.timeout)
                starts[p] = PartitionPosition(max(0, int(low)))
            except Exception:  # watermarks are advisory here: offset 0 + auto.offset.reset=earliest is safe
                starts[p] = PartitionPosition(0)
    finally:
        c.close()
    if opts.starting == "latest":
        return scan_boundaries(opts, starts)
    return starts


# ------------------------------------------------------------------------------------------------ rows
def event_rows(ev: Snapshot | Rollback, partition: int) -> list[Row]:
    if isinstance(ev, Rollback):
        vbuuid = ev.failover_log[0].vbuuid if ev.failover_log else 0
        return [("rollback", None, None, ev.vbucket, signed64(vbuuid), signed64(ev.restart_seqno),
                 signed64(ev.restart_seqno), signed64(ev.restart_seqno), None, None, partition, ev.offset, None, None,
                 None)]
    s0, s1 = signed64(ev.start), signed64(ev.end)
    return [(c.type.value, c.key, c.value, c.vbucket, signed64(c.vbuuid), signed64(c.seqno), s0, s1,
             signed64(c.rev_seqno), signed64(c.cas), partition, c.offset, c.flags, c.expiry, c.datatype)
            for c in ev.changes]


def corrupt_row(opts: SourceOptions, partition: int, offset: int, key: bytes | None, e: RecordFormatError) -> Row:
    """The row of a record that does not decode (``corruptRecords=row``): ``op`` ``corrupt``, ``key`` the record's
    Kafka key, ``value`` the decoding error (UTF-8), where it is; the rest null. ``fail``: a
    :class:`DcpSourceError` naming the record."""
    where = f"{opts.topic}[{partition}]@{offset}"
    if opts.corrupt != "row":
        raise DcpSourceError(f"dcp source: corrupt record at {where}: {e} (option corruptRecords=row hands "
                             "corrupt records over as rows instead)")
    return (CORRUPT_OP, key, f"{where}: {e}".encode(), None, None, None, None, None, None, None, partition, offset,
            None, None, None)


def replay_rows(opts: SourceOptions, partition: int, start: PartitionPosition, end: int) -> Iterator[Row]:
    """The rows of ``[start, end)`` of one partition (both boundaries): deterministic for the same inputs."""
    return replay_ranges(opts, [(partition, start, end)])


def replay_ranges(opts: SourceOptions, ranges: list[tuple[int, PartitionPosition, int]]) -> Iterator[Row]:
    """The rows of several partitions' ``[start, end)`` ranges, read with one consumer. Per partition (hence per
    vbucket) the rows are in replay order; partitions interleave."""
    todo = {p: (start, end) for p, start, end in ranges if end > start.offset}
    if not todo:
        return
    replays = {p: PartitionReplay(p, start) for p, (start, _e) in todo.items()}
    last = {p: start.offset - 1 for p, (start, _e) in todo.items()}
    gen = _consume(opts, {p: start.offset for p, (start, _e) in todo.items()})
    try:
        item = next(gen)
        while True:
            p, m = item
            stop = False
            end = todo[p][1]
            if m is None:
                if last[p] < end - 1:
                    raise DcpSourceError(
                        f"dcp source: partition {p} of {opts.topic!r} ends at offset {last[p] + 1}, "
                        f"before the batch end {end} (records deleted by retention?)")
            else:
                off = m.offset()
                if off >= end:
                    stop = True
                else:
                    last[p] = off
                    v = m.value()
                    ch = read_change(v, off, Change) if v is not None else None
                    if ch is not None:  # a data record: from its value alone (as the Kafka client reads it)
                        snap = replays[p].feed_change(ch)
                        if snap is not None:
                            yield from event_rows(snap, p)
                    else:
                        try:
                            rec = decode(m.key(), v, m.headers())
                        except RecordFormatError as e:
                            replays[p].skip(off)
                            yield corrupt_row(opts, p, off, m.key(), e)
                        else:
                            for ev in replays[p].feed(rec, off):
                                yield from event_rows(ev, p)
                    stop = off >= end - 1
            item = gen.send(stop)
    except StopIteration:
        pass
    finally:
        gen.close()
    for p, rp in replays.items():
        if rp.boundary != todo[p][1]:
            raise DcpSourceError(
                f"dcp source: offset {todo[p][1]} of partition {p} is not a snapshot boundary (replay stopped "
                f"at {rp.boundary}); the offsets do not belong to this topic?")
