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

import math
import time
import uuid
from collections.abc import Generator, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from connectors.client.consumer import record_problem
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
#: the source's option names as documented (Spark hands them over lower-cased: names are case-insensitive)
OPTION_NAMES: tuple[str, ...] = ("bootstrap.servers", "topic", "startingOffsets", "maxRecordsPerPartitionPerBatch",
                                 "numPartitions", "corruptRecords", "timeout")
#: accepted spellings of documented options (Spark's own ``kafka`` source spells the topic ``subscribe``)
_ALIASES = ("subscribe",)
#: what Spark itself adds to a Python data source's options: ``path`` for ``load(path)``, ``paths`` (a JSON list)
#: for ``load([p1, p2])``; the source reads no path and ignores them
SPARK_OPTIONS: tuple[str, ...] = ("path", "paths")
_KNOWN = frozenset(n.lower() for n in (*OPTION_NAMES, *_ALIASES, *SPARK_OPTIONS))
#: librdkafka properties the source sets itself (a ``kafka.`` option for one of them is refused)
_SOURCE_SETS = {
    "group.id": "a fresh group per reader: progress lives in Spark's checkpoint, never in Kafka",
    "enable.auto.commit": "nothing is committed to Kafka",
    "enable.partition.eof": "the readers stop at each partition's end",
    "auto.offset.reset": "offsets are the source's snapshot boundaries",
    "allow.auto.create.topics": "the source never creates the topic it reads",
}


def _pick(low: Mapping[str, str], name: str, alias: str) -> str | None:
    a, b = low.get(name), low.get(alias)
    if a is not None and b is not None and a != b:
        raise DcpSourceError(f"dcp source: options {name!r} and {alias!r} disagree ({a!r} vs {b!r}); give one")
    v = a if a is not None else b
    return None if v is None else v.strip()


def _positive_int(name: str, raw: str) -> int:
    try:
        n = int(raw.strip())
    except ValueError:
        n = 0
    if n <= 0:
        raise DcpSourceError(f"dcp source: option {name} must be a positive integer, got {raw!r}")
    return n


def _positive_seconds(name: str, raw: str) -> float:
    try:
        v = float(raw.strip())
    except ValueError:
        v = math.nan
    if not (math.isfinite(v) and v > 0):
        raise DcpSourceError(f"dcp source: option {name} must be a positive number of seconds, got {raw!r}")
    return v


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
        """The options Spark hands the source (case-insensitive names), checked strictly: every bad value and
        every unknown name is a :class:`DcpSourceError` naming the option (docs/spark.md "Options")."""
        opts = {str(k): str(v) for k, v in options.items()}
        low: dict[str, str] = {}
        for k, v in opts.items():
            name = k.lower()
            if name in low and low[name] != v:
                raise DcpSourceError(f"dcp source: option {k!r} is given twice with different values "
                                     "(option names are case-insensitive)")
            low[name] = v
        unknown = sorted(k for k in opts if k.lower() not in _KNOWN and not k.lower().startswith("kafka."))
        if unknown:
            raise DcpSourceError(
                f"dcp source: unknown option {', '.join(repr(u) for u in unknown)}; the options are "
                f"{', '.join(OPTION_NAMES)} and kafka.<librdkafka consumer property> (names are case-insensitive)")
        bootstrap = _pick(low, "bootstrap.servers", "kafka.bootstrap.servers")
        if not bootstrap:
            raise DcpSourceError(
                "dcp source: option 'bootstrap.servers' (or 'kafka.bootstrap.servers') is required, "
                "e.g. .option('bootstrap.servers', 'localhost:9092')")
        topic = _pick(low, "topic", "subscribe")
        if not topic:
            raise DcpSourceError("dcp source: option 'topic' is required (the gateway topic, e.g. 'dcp.travel-sample')")
        if "," in topic:
            raise DcpSourceError(f"dcp source: option 'topic' names one topic, got {topic!r}")
        starting = low.get("startingoffsets", "earliest").strip().lower()
        if starting not in ("earliest", "latest"):
            raise DcpSourceError(
                f"dcp source: option startingOffsets must be 'earliest' or 'latest', got {starting!r} "
                "(arbitrary offsets are not snapshot boundaries)")
        raw_max = low.get("maxrecordsperpartitionperbatch")
        mx = None if raw_max is None else _positive_int("maxRecordsPerPartitionPerBatch", raw_max)
        timeout = _positive_seconds("timeout", low.get("timeout", "60"))
        raw_n = low.get("numpartitions")
        nparts = 8 if raw_n is None else _positive_int("numPartitions", raw_n)
        corrupt = low.get("corruptrecords", "fail").strip().lower()
        if corrupt not in CORRUPT_MODES:
            raise DcpSourceError(f"dcp source: option corruptRecords must be 'fail' or 'row', got {corrupt!r}")
        kafka = {k[len("kafka."):]: v for k, v in low.items()
                 if k.startswith("kafka.") and k != "kafka.bootstrap.servers"}
        for k in kafka:
            if k in _SOURCE_SETS:
                raise DcpSourceError(f"dcp source: option 'kafka.{k}' cannot be set: the source sets {k} itself "
                                     f"({_SOURCE_SETS[k]})")
        out = cls(bootstrap, topic, starting, mx, kafka, timeout, nparts, corrupt)
        if kafka:
            out._check_kafka()
        return out

    def _check_kafka(self) -> None:
        """librdkafka refuses unknown properties and bad values when a client is created (no connection yet)."""
        try:
            Consumer(self.consumer_config()).close()
        except (KafkaException, ValueError, TypeError) as e:
            err = e.args[0] if e.args else e
            text = err.str() if isinstance(err, KafkaError) else str(err)
            raise DcpSourceError(f"dcp source: a kafka.<property> option is refused by the Kafka client: {text}") from e

    def consumer_config(self) -> dict[str, Any]:
        # allow.auto.create.topics: a metadata request for a missing topic would create it (Tansu does unless the
        # client says not to, docs/kafka-compat.md); the source never creates the topic it reads
        return {"fetch.wait.max.ms": 50, **self.kafka, "bootstrap.servers": self.bootstrap,
                "group.id": f"dcp-spark-{uuid.uuid4().hex}", "enable.auto.commit": False,
                "enable.partition.eof": True, "auto.offset.reset": "earliest", "allow.auto.create.topics": False}


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
    """The topic's partition count, asked with a consumer's metadata request that does not allow the broker to
    create a missing topic (``allow.auto.create.topics=false``, as the client library asks): a missing topic is a
    :class:`DcpSourceError` and stays missing."""
    c = Consumer(opts.consumer_config())
    try:
        md = c.list_topics(opts.topic, timeout=opts.timeout).topics.get(opts.topic)
    except KafkaException as e:
        raise DcpSourceError(f"dcp source: cannot read the metadata of {opts.topic!r} on {opts.bootstrap}: "
                             f"{e.args[0].str() if e.args and isinstance(e.args[0], KafkaError) else e}") from e
    finally:
        c.close()
    if md is None or md.error is not None or not md.partitions:
        err = None if md is None else md.error
        why = err.str() if isinstance(err, KafkaError) else "no partitions"
        raise DcpSourceError(f"dcp source: topic {opts.topic!r} not found on {opts.bootstrap} ({why})")
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
        raise DcpSourceError(f"dcp source: corrupt record at {where}: {record_problem(e)} (option corruptRecords=row hands "
                             "corrupt records over as rows instead)")
    return (CORRUPT_OP, key, f"{where}: {record_problem(e)}".encode(), None, None, None, None, None, None, None, partition, offset,
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
