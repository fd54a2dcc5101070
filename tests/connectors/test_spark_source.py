"""The ``dcp`` PySpark data source and the materialize helper against a real broker and engine."""

from __future__ import annotations

import sqlite3
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pyspark = pytest.importorskip("pyspark", reason="pyspark is not installed (pip install -e '.[spark]')")

from engine import Bucket, BucketConfig  # noqa: E402
from gateway.broker import Broker  # noqa: E402
from gateway.resume import READ_TO_END_FETCH_WAIT_MS  # noqa: E402
from schemas.records import RecordType  # noqa: E402
from tests.gateway.kafka_util import read_topic  # noqa: E402
from tests.gateway.processes import NVB, GatewayProc, docs, replicate_process  # noqa: E402
from tests.harness import Harness, harnesses  # noqa: E402

# One SparkSession (a JVM) per worker process (the `spark` fixture, tests/connectors/conftest.py): under
# pytest-xdist, `--dist loadgroup` keeps these on one worker.
pytestmark = [pytest.mark.slow, pytest.mark.spark, pytest.mark.xdist_group("spark")]


class Gw(Harness):
    """The shared harness (an engine bucket published by the in-process gateway) plus a `dcp` reader."""

    def reader(self, spark: Any, stream: bool = False, **opts: str) -> Any:
        r = (spark.readStream if stream else spark.read).format("dcp")
        r = r.option("bootstrap.servers", self.broker.bootstrap_servers).option("topic", self.topic)
        for k, v in opts.items():
            r = r.option(k, v)
        return r.load()


@pytest.fixture
def gw(kafka_broker: Broker, tmp_path: Path) -> Iterator[Any]:
    with harnesses(kafka_broker, tmp_path, Gw) as make:
        yield make


def write(bucket: Bucket, n: int, prefix: str = "k", start: int = 0) -> None:
    for i in range(start, start + n):
        bucket.set(f"{prefix}{i}", f'{{"n": {i}}}'.encode())
        if i % 5 == 0:
            bucket.delete(f"{prefix}{i}")
        if i % 7 == 0:
            bucket.set(f"{prefix}{i // 2}", f'{{"again": {i}}}'.encode())


def apply_rows(rows: list[Any]) -> dict[bytes, tuple[bytes, int]]:
    """The engine state from the rows in order, rollbacks reverted exactly (per-vbucket history)."""
    hist: dict[int, list[tuple[int, bytes, bytes | None]]] = {}
    for r in rows:
        if r.op == "rollback":
            hist[r.vbucket] = [h for h in hist.get(r.vbucket, []) if h[0] <= r.seqno]
        else:
            hist.setdefault(r.vbucket, []).append((r.seqno, bytes(r.key), None if r.op != "mutation" else bytes(r.value)))
    out: dict[bytes, tuple[bytes, int]] = {}
    for vb, hs in hist.items():
        cur: dict[bytes, bytes | None] = {}
        for _s, k, v in hs:
            cur[k] = v
        out.update({k: (v, vb) for k, v in cur.items() if v is not None})
    return out


def ordered(rows: list[Any]) -> list[Any]:
    # per vbucket, rows are in Kafka offset order (a vbucket lives in one partition); stable across vbuckets
    return sorted(rows, key=lambda r: (r.kafka_partition, r.kafka_offset))


def table_state(spark: Any, path: Path) -> dict[bytes, tuple[bytes, int]]:
    from connectors.spark import read_table

    return {bytes(r.key): (bytes(r.value), r.vbucket) for r in read_table(spark, str(path)).collect()}


def test_batch_read_equals_engine_state(spark: Any, gw: Any) -> None:
    g = gw(partitions=3)  # vbuckets share partitions (v mod 3)
    write(g.bucket, 300)
    g.settle()
    rows = g.reader(spark).collect()
    assert rows and {r.op for r in rows} <= {"mutation", "deletion", "expiration"}
    assert apply_rows(ordered(rows)) == g.bucket.state_snapshot()
    assert {r.kafka_partition for r in rows} == set(range(3))
    assert all(r.vbucket % 3 == r.kafka_partition for r in rows)
    for r in rows:
        assert r.snap_start <= r.seqno <= r.snap_end


def run_stream(g: Gw, spark: Any, table: Path, chk: Path, **opts: str) -> list[int]:
    """One availableNow run of the stream into the materialized table; the batch ids it ran."""
    from connectors.spark import materialize

    seen: list[int] = []
    batches: dict[int, list[Any]] = getattr(g, "batches", {})
    g.batches = batches  # type: ignore[attr-defined]

    def each(df: Any, batch_id: int) -> None:
        seen.append(batch_id)
        batches[batch_id] = df.collect()
        materialize(df, batch_id, str(table))

    q = (g.reader(spark, stream=True, **opts).writeStream.foreachBatch(each)
         .option("checkpointLocation", str(chk)).trigger(availableNow=True).start())
    q.awaitTermination(120)
    assert q.exception() is None, q.exception()
    return seen


def test_stream_materialize_equals_engine(spark: Any, gw: Any, tmp_path: Path) -> None:
    g = gw()
    write(g.bucket, 200)
    g.settle()
    table, chk = tmp_path / "table", tmp_path / "chk"
    assert run_stream(g, spark, table, chk)
    assert table_state(spark, table) == g.bucket.state_snapshot()
    # a second run of the same query continues from its checkpoint
    write(g.bucket, 100, start=500)
    g.settle()
    assert run_stream(g, spark, table, chk)
    assert table_state(spark, table) == g.bucket.state_snapshot()


def test_engine_crash_rollback_rows_keep_the_table_exact(spark: Any, gw: Any, tmp_path: Path) -> None:
    g = gw(rollback_mitigation=False)
    write(g.bucket, 100)
    g.bucket.flush_all()
    g.settle()
    table, chk = tmp_path / "table", tmp_path / "chk"
    run_stream(g, spark, table, chk)
    write(g.bucket, 60, start=100)  # published from memory, never persisted
    for _ in range(50):
        g.pub.pump()
    g.pub.flush(10)
    g.pub.kafka.flush(10)
    run_stream(g, spark, table, chk)  # the table now holds items the engine is about to lose
    g.crash_engine()
    write(g.bucket, 30, start=1000)
    g.bucket.flush_all()
    g.settle()
    assert any(r.type is RecordType.ROLLBACK for _p, _o, r in read_topic(g.broker.bootstrap_servers, g.topic))
    run_stream(g, spark, table, chk)
    rows = [r for b in sorted(g.batches) for r in ordered(g.batches[b])]
    assert any(r.op == "rollback" for r in rows)
    assert table_state(spark, table) == g.bucket.state_snapshot()
    # a batch read from the beginning applies the rollback rows in order and agrees too
    assert apply_rows(ordered(g.reader(spark).collect())) == g.bucket.state_snapshot()


def test_micro_batches_hold_only_complete_snapshots(spark: Any, gw: Any, tmp_path: Path) -> None:
    from pyspark.sql.streaming.datasource import ReadMaxRows

    from connectors.spark.core import SourceOptions
    from connectors.spark.source import DcpStreamReader

    g = gw(partitions=2)
    write(g.bucket, 120)
    g.settle()
    run_stream(g, spark, tmp_path / "t", tmp_path / "c", maxRecordsPerPartitionPerBatch="60")
    write(g.bucket, 120, start=300)
    g.settle()
    run_stream(g, spark, tmp_path / "t", tmp_path / "c", maxRecordsPerPartitionPerBatch="60")
    assert len(g.batches) >= 2
    # the per-partition limit splits the topic into several boundary-to-boundary ranges
    reader = DcpStreamReader(SourceOptions.parse({"bootstrap.servers": g.broker.bootstrap_servers,
                                                  "topic": g.topic}))
    cut = reader.latestOffset(reader.initialOffset(), ReadMaxRows(60))
    full = reader.latestOffset(reader.initialOffset(), None)
    assert 0 < sum(cut["partitions"].values()) < sum(full["partitions"].values())
    snaps = {(r.vbucket, r.snap_start, r.snap_end, r.seqno) for _p, _o, r in read_topic(
        g.broker.bootstrap_servers, g.topic) if r.is_data}
    ends: dict[tuple[int, int, int], int] = {}
    for vb, s0, s1, seq in snaps:
        ends[(vb, s0, s1)] = max(ends.get((vb, s0, s1), 0), seq)
    for rows in g.batches.values():
        by_snap: dict[tuple[int, int, int], int] = {}
        for r in rows:
            k = (r.vbucket, r.snap_start, r.snap_end)
            by_snap[k] = max(by_snap.get(k, 0), r.seqno)
        # every snapshot in the batch is there up to its last item in the topic (nothing is split)
        assert by_snap == {k: ends[k] for k in by_snap}
        for r in rows:
            assert r.seqno <= r.snap_end
    assert table_state(spark, tmp_path / "t") == g.bucket.state_snapshot()


def test_same_offsets_read_twice_give_identical_rows(spark: Any, gw: Any) -> None:
    from connectors.spark.core import SourceOptions, from_offset, replay_rows
    from connectors.spark.source import DcpStreamReader

    g = gw(partitions=3)
    write(g.bucket, 150)
    g.settle()
    opts = SourceOptions.parse({"bootstrap.servers": g.broker.bootstrap_servers, "topic": g.topic})
    reader = DcpStreamReader(opts)
    start = reader.initialOffset()
    end = reader.latestOffset(start, None)
    assert end == DcpStreamReader(opts).latestOffset(start, None)  # boundaries are deterministic
    def rows_by_kafka_partition() -> dict[int, list[Any]]:
        # Kafka partitions grouped into one input partition interleave; each one's rows are deterministic
        out: dict[int, list[Any]] = {}
        for part in reader.partitions(start, end):
            for batch in reader.read(part):
                for r in batch.to_pylist():
                    out.setdefault(r["kafka_partition"], []).append(r)
        return out

    first = rows_by_kafka_partition()
    assert first == rows_by_kafka_partition() and set(first) == {0, 1, 2}
    s, e = from_offset(start, 3), from_offset(end, 3)
    a = list(replay_rows(opts, 1, s[1], e[1].offset))
    assert a == list(replay_rows(opts, 1, s[1], e[1].offset)) and a
    # and through Spark, twice
    df1 = sorted(g.reader(spark).collect())
    assert df1 == sorted(g.reader(spark).collect())


def test_bad_options_give_clear_errors(spark: Any, kafka_broker: Broker) -> None:
    from connectors.spark.core import DcpSourceError, SourceOptions

    with pytest.raises(DcpSourceError, match="topic"):
        SourceOptions.parse({"bootstrap.servers": "x:1"})
    with pytest.raises(DcpSourceError, match=r"bootstrap\.servers"):
        SourceOptions.parse({"topic": "t"})
    with pytest.raises(DcpSourceError, match="startingOffsets"):
        SourceOptions.parse({"topic": "t", "bootstrap.servers": "x:1", "startingOffsets": '{"0": 5}'})
    with pytest.raises(Exception, match="option 'topic' is required"):
        spark.read.format("dcp").option("bootstrap.servers", kafka_broker.bootstrap_servers).load().collect()
    with pytest.raises(Exception, match=r"bootstrap\.servers"):
        spark.read.format("dcp").option("topic", "x").load().collect()


def test_bad_options_fail_at_load_and_a_missing_topic_is_not_created(spark: Any, kafka_broker: Broker) -> None:
    """docs/spark.md: bad options fail at load() with a DcpSourceError naming the option (before: timeout=abc a
    ValueError, timeout=-1 and misspelled option names accepted); a missing topic fails the read and is not
    created (before: count() was 0 and the read created the topic)."""
    from confluent_kafka.admin import AdminClient

    bs = kafka_broker.bootstrap_servers

    def load(**opts: str) -> Any:
        r = spark.read.format("dcp").option("bootstrap.servers", bs).option("topic", "dcp.x")
        for k, v in opts.items():
            r = r.option(k, v)
        return r.load()  # raises here: no action needed

    for opts, message in [
        ({"timeout": "abc"}, "option timeout must be a positive number of seconds, got 'abc'"),
        ({"timeout": "-1"}, "option timeout must be a positive number of seconds, got '-1'"),
        ({"startingOffset": "latest"}, "unknown option 'startingoffset'; the options are bootstrap.servers, topic, "
                                       "startingOffsets"),
        ({"topic_": "dcp.y"}, "unknown option 'topic_'"),
    ]:
        with pytest.raises(Exception, match="DcpSourceError") as err:
            load(**opts)
        assert message in str(err.value), str(err.value)
    # Spark's own option for load(path) is not refused (ignored: the topic option names what is read)
    assert spark.read.format("dcp").option("bootstrap.servers", bs).option("topic", "t").load("p").schema
    missing = f"no.such.{uuid.uuid4().hex[:8]}"
    with pytest.raises(Exception, match=rf"DcpSourceError: dcp source: topic '{missing}' not found"):
        spark.read.format("dcp").option("bootstrap.servers", bs).option("topic", missing).option(
            "timeout", "20").load().count()
    assert missing not in AdminClient({"bootstrap.servers": bs}).list_topics(timeout=20).topics


def test_materialize_reverts_rollbacks_exactly_and_is_idempotent(spark: Any, tmp_path: Path) -> None:
    from connectors.spark import materialize
    from connectors.spark.core import SCHEMA_DDL

    def row(op: str, key: str | None, value: str | None, seqno: int, off: int) -> tuple[Any, ...]:
        return (op, None if key is None else key.encode(), None if value is None else value.encode(), 0, 7,
                seqno, seqno, seqno, 1, 1, 0, off, 0, 0, 1)

    path = str(tmp_path / "t")
    b0 = [row("mutation", "a", "a1", 1, 1), row("mutation", "b", "b1", 2, 2), row("deletion", "c", None, 3, 3)]
    # batch 1: a changes at 4, b is deleted at 5, then a rollback to 3 undoes both, then a re-sent history
    b1 = [row("mutation", "a", "a4", 4, 4), row("deletion", "b", None, 5, 5), row("rollback", None, None, 3, 6),
          row("mutation", "d", "d4", 4, 7)]
    materialize(spark.createDataFrame(b0, SCHEMA_DDL), 0, path)
    materialize(spark.createDataFrame(b1, SCHEMA_DDL), 1, path)
    want = {b"a": (b"a1", 0), b"b": (b"b1", 0), b"d": (b"d4", 0)}
    assert table_state(spark, Path(path)) == want
    # Spark re-running batch 1 (or an older one) changes nothing
    materialize(spark.createDataFrame(b1, SCHEMA_DDL), 1, path)
    materialize(spark.createDataFrame(b0, SCHEMA_DDL), 0, path)
    assert table_state(spark, Path(path)) == want
    # a later rollback below an earlier batch's changes reverts them too
    materialize(spark.createDataFrame([row("rollback", None, None, 1, 8)], SCHEMA_DDL), 2, path)
    assert table_state(spark, Path(path)) == {b"a": (b"a1", 0)}


class _TopicReader:
    """A gateway topic (published by a `dcpgw up` process) read with the `dcp` format, like :class:`Gw`."""

    def __init__(self, broker: Broker, topic: str) -> None:
        self.broker = broker
        self.topic = topic

    reader = Gw.reader


def test_proof1_real_processes_replica_and_spark_table_equal_engine(spark: Any, kafka_broker: Broker,
                                                                    tmp_path: Path) -> None:
    """Issue 4, proof 1, in one run with real processes: `dcpgw up` publishes items it never persisted (rollback
    mitigation off, flush every 60 s), the reference application (`dcpgw replicate`, a process) and a Spark
    streaming query materializing a Parquet table both read them; the gateway is SIGKILLed, restarted, the
    engine answers ROLLBACK and the gateway publishes rollback records; both end equal to the engine."""
    bucket = f"s{uuid.uuid4().hex[:8]}"
    topic = f"dcp.{bucket}"
    data, db = tmp_path / "data", tmp_path / "replica.sqlite"
    table, chk = tmp_path / "table", tmp_path / "chk"
    src = _TopicReader(kafka_broker, topic)
    proc = GatewayProc(kafka_broker, data, bucket, DCPGW_ROLLBACK_MITIGATION="false", DCPGW_FLUSH_INTERVAL_S="60")
    proc.start()
    try:
        proc.bulk(docs(0, 300))
        proc.wait_caught_up()  # published and acknowledged by Kafka, never flushed by the engine
        first = replicate_process(kafka_broker, topic, db, "--until-caught-up")
        assert first.returncode == 0, first.stderr
        assert run_stream(src, spark, table, chk)  # type: ignore[arg-type]
        assert len(table_state(spark, table)) == 300  # the table holds what the engine is about to lose
        proc.kill9()
        proc.env["DCPGW_FLUSH_INTERVAL_S"] = "0.05"
        proc.start()
        proc.bulk(docs(250, 400))
        proc.wait_caught_up()
    finally:
        proc.stop()
    assert any(r.type is RecordType.ROLLBACK for _p, _o, r in read_topic(kafka_broker.bootstrap_servers, topic))
    second = replicate_process(kafka_broker, topic, db, "--until-caught-up")
    assert second.returncode == 0, second.stderr
    run_stream(src, spark, table, chk)  # type: ignore[arg-type]
    b = Bucket(BucketConfig(data_dir=data, name=bucket, num_vbuckets=NVB))
    try:
        expected = b.state_snapshot()
    finally:
        b.close()
    assert len(expected) == 150  # docs 250..399 survived; 0..299 were lost with the engine's memory
    with sqlite3.connect(db) as conn:
        replica = {k.encode(): (bytes(v), vb) for k, v, vb in conn.execute("SELECT key, value, vbucket FROM docs")}
    assert replica == expected
    assert table_state(spark, table) == expected
    batches = [r for bid in sorted(src.batches) for r in src.batches[bid]]  # type: ignore[attr-defined]
    assert any(r.op == "rollback" for r in batches)


KAFKA_SOURCE_SCHEMA = ("key binary, value binary, topic string, partition int, offset bigint, timestamp timestamp, "
                       "timestampType int, headers array<struct<key:string,value:binary>>")


def _kafka_source_rows(bootstrap: str, topic: str) -> list[tuple[Any, ...]]:
    """The topic as Spark's native ``kafka`` source (``includeHeaders=true``) would hand it over: same columns,
    same types (that jar is not available here: the rows are read with confluent-kafka)."""
    import datetime

    from confluent_kafka import Consumer, KafkaError, TopicPartition

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"t-{uuid.uuid4()}", "enable.partition.eof": True,
                  "auto.offset.reset": "earliest", "enable.auto.commit": False,
                  "fetch.wait.max.ms": READ_TO_END_FETCH_WAIT_MS})
    out = []
    try:
        parts = sorted(c.list_topics(topic, timeout=10).topics[topic].partitions)
        c.assign([TopicPartition(topic, p, 0) for p in parts])
        pending = set(parts)
        while pending:
            first = c.poll(0.5)  # then what is already fetched: consume(n, 0.5) would wait out the 0.5 s
            for m in ([first, *c.consume(999, 0)] if first is not None else []):
                err = m.error()
                if err is not None:
                    assert err.code() == KafkaError._PARTITION_EOF
                    pending.discard(m.partition())
                    continue
                ts = datetime.datetime.fromtimestamp(m.timestamp()[1] / 1000, tz=datetime.UTC)
                headers = m.headers() or []
                assert isinstance(headers, list)  # a consumed message's headers: (name, value) pairs
                out.append((m.key(), m.value(), topic, m.partition(), m.offset(), ts, 0,
                            [(k, v) for k, v in headers]))
    finally:
        c.close()
    return out


def test_native_kafka_format_rows_replay_to_the_engine_state(spark: Any, gw: Any) -> None:
    from connectors.spark import from_kafka_df

    g = gw(rollback_mitigation=False)
    write(g.bucket, 80)
    g.bucket.flush_all()
    g.settle()
    write(g.bucket, 40, start=80)  # published from memory, lost by the crash: rollback records follow
    g.publish_unpersisted()
    g.crash_engine()
    write(g.bucket, 30, start=500)
    g.bucket.flush_all()
    g.settle()
    raw = spark.createDataFrame(_kafka_source_rows(g.broker.bootstrap_servers, g.topic), KAFKA_SOURCE_SCHEMA)
    rows = from_kafka_df(raw).collect()
    assert any(r.op == "rollback" for r in rows)
    assert {r.op for r in rows} <= {"mutation", "deletion", "expiration", "rollback"}
    assert apply_rows(ordered(rows)) == g.bucket.state_snapshot()


def test_cluster_hard_failover_spark_table_equals_new_actives(spark: Any, kafka_broker: Broker,
                                                              tmp_path: Path) -> None:
    """Issue 5, proof 1 for Spark: three nodes, one replica, the gateway following the map (mitigation off); a
    streaming query materializes items the lagging replicas lack; the node is killed and hard-failed over, the
    gateway publishes rollback records; the table (and the Replicator) end equal to the new actives' state."""
    from tests.harness import ClusterHarness

    h = ClusterHarness(kafka_broker, tmp_path / "c", rollback_mitigation=False)
    table, chk = tmp_path / "table", tmp_path / "chk"
    src = _TopicReader(kafka_broker, h.topic)
    try:
        c = h.cluster
        h.write(300)
        h.settle()
        victim = "n1"
        h.write(300)  # the newest items: published from the victim's memory, only partly replicated
        c.pump(rounds=1, max_messages=3)
        h.publish()
        run_stream(src, spark, table, chk)  # type: ignore[arg-type]
        before = table_state(spark, table)
        c.kill(victim)
        c.failover(victim)
        lost = {k: v for k, v in before.items() if h.actives().get(k) != v}
        assert lost, "the table must hold changes the failover lost"
        h.write(200)
        h.settle()
        recs = h.check()
        assert any(r.type is RecordType.ROLLBACK for _p, _o, r in recs)
        run_stream(src, spark, table, chk)  # type: ignore[arg-type]
        assert table_state(spark, table) == h.actives()
        assert any(r.op == "rollback" for b in src.batches.values() for r in b)  # type: ignore[attr-defined]
        with h.replicate() as rep:
            assert rep.docs() == h.actives()
    finally:
        h.close()
