"""The search indexer as a Spark structured-streaming job (docs/search.md "The Spark job").

    python -m connectors.search.spark_job --topic dcp.default --index-dir ./search-index [--once]
        [--bootstrap KAFKA] [--mapping FILE] [--backend tantivy|elasticsearch|opensearch --es-url URL ...]
        [--checkpoint-location DIR] [--master local[2]]

The ``dcp`` source (connectors/spark, docs/spark.md) hands each micro-batch as rows of complete snapshots and
rollback rows; ``foreachBatch`` runs :class:`BatchIndexer` on the driver, which does what the standalone indexer
(connectors/search/indexer.py) does with the client's events:

1. **The document store** ``spark-store.sqlite`` (in the index directory): ``search_docs(key, value, vbucket,
   seqno, gen)`` -- the same table as the indexer's, ``gen`` = batch id + 1 --, the mutation log
   (connectors/client/mutation_log.py: each change records the key's prior version, a rollback row to B
   restores every key changed above B to its version at B), the per-vbucket positions and the **batch id**, all
   in one SQLite transaction per batch. A batch id at or below the recorded one was applied already (Spark runs
   a batch again after a failure or a restart): its rows are skipped. That is the idempotence per batch id.
2. **The backend** (tantivy in ``index-dir/tantivy``, or an Elasticsearch index): after the store committed, the
   rows of the generations above the backend's checkpoint are applied and committed with a checkpoint (the
   generation and positions). A crash between the two leaves the backend behind; the next batch (or the same
   batch run again) applies those generations first.

Spark's own progress (offsets, the states of the replayers at the snapshot boundaries, commits) is in the
checkpoint location, ``index-dir/spark-checkpoint`` unless given. Start a new index directory together with a
new checkpoint location (batch ids begin again at 0 there).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sqlite3
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from connectors.client.mutation_log import DEFAULT_MAX_ENTRIES, LogTooShort, MutationLog
from connectors.exceptions import ConnectorError
from connectors.search.backend import ApplyStats, Checkpoint, Delete, IndexBackend, IndexOp, Position, Upsert

__all__ = ["BatchIndexer", "SparkIndexError", "main", "start_query"]

log = logging.getLogger(__name__)

_U64 = (1 << 64) - 1

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS search_docs (key TEXT PRIMARY KEY, value BLOB, vbucket INTEGER NOT NULL, "
    "seqno INTEGER NOT NULL, gen INTEGER NOT NULL)",
    "CREATE INDEX IF NOT EXISTS search_docs_gen ON search_docs (gen)",
    "CREATE TABLE IF NOT EXISTS spark_positions (vbucket INTEGER PRIMARY KEY, vbuuid INTEGER NOT NULL, "
    "seqno INTEGER NOT NULL)",
    "CREATE TABLE IF NOT EXISTS spark_batch (one INTEGER PRIMARY KEY CHECK (one = 0), batch_id INTEGER NOT NULL)",
)

#: the columns of the dcp source's rows the job reads (docs/spark.md "Rows")
COLUMNS = ("op", "key", "value", "vbucket", "vbuuid", "seqno", "kafka_partition", "kafka_offset")


class SparkIndexError(ConnectorError):
    """The Spark job cannot apply a batch exactly (e.g. a rollback below its mutation log's reach)."""


def _k(key: bytes) -> str:
    return key.decode("utf-8", "surrogateescape")


def _signed(v: int) -> int:
    """A u64 (vbuuid) as SQLite's signed 64-bit integer (the dcp source's bigint already is)."""
    return v - (1 << 64) if v >= 1 << 63 else v


class BatchIndexer:
    """``foreachBatch`` sink: ``query.writeStream.foreachBatch(BatchIndexer(index_dir, backend))``."""

    def __init__(self, index_dir: str | Path, backend: IndexBackend, *, mapping_id: str = "",
                 mutation_log_max: int = DEFAULT_MAX_ENTRIES) -> None:
        self.dir = Path(index_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.backend = backend
        self.mapping_id = mapping_id
        self.conn = sqlite3.connect(str(self.dir / "spark-store.sqlite"), isolation_level=None,
                                    check_same_thread=False)
        self.conn.execute("PRAGMA journal_mode=WAL")
        for stmt in _SCHEMA:
            self.conn.execute(stmt)
        self.mlog = MutationLog(self.conn, mutation_log_max)
        self.stats = ApplyStats()
        self.batches = 0
        self.skipped_batches = 0
        self.rollbacks = 0
        self.changes = 0
        cp = backend.checkpoint()
        if cp is not None and self.last_batch() is None:
            log.warning("spark job: the index has a checkpoint but the document store in %s is new: rebuilding it",
                        self.dir)
            backend.reset()
            cp = None
        self.visible: Checkpoint = cp or Checkpoint(0, {}, mapping_id)

    # ------------------------------------------------------------------------------------------ store
    def last_batch(self) -> int | None:
        row = self.conn.execute("SELECT batch_id FROM spark_batch").fetchone()
        return None if row is None else int(row[0])

    def positions(self) -> dict[int, Position]:
        return {int(vb): Position(int(u) & _U64, int(s))
                for vb, u, s in self.conn.execute("SELECT vbucket, vbuuid, seqno FROM spark_positions")}

    def __call__(self, df: Any, batch_id: int) -> None:
        rows = df.select(*COLUMNS).collect()
        self.apply_rows(rows, batch_id)

    def apply_rows(self, rows: Sequence[Any], batch_id: int) -> bool:
        """Apply one micro-batch (rows with the :data:`COLUMNS` fields) then sync the backend. Returns False
        when the batch id was applied before (its rows are skipped)."""
        last = self.last_batch()
        if last is not None and batch_id <= last:
            self.skipped_batches += 1
            self.sync()
            return False
        gen = batch_id + 1
        c = self.conn
        c.execute("BEGIN IMMEDIATE")
        try:
            touched: set[int] = set()
            # per vbucket the Kafka offset is the order (a vbucket lives in one partition, docs/spark.md)
            for r in sorted(rows, key=lambda r: (r.kafka_partition, r.kafka_offset)):
                vb = int(r.vbucket)
                touched.add(vb)
                if r.op == "rollback":
                    self._rollback(vb, int(r.seqno), gen)
                else:
                    self._change(r, vb, gen)
                c.execute("INSERT OR REPLACE INTO spark_positions VALUES (?, ?, ?)",
                          (vb, _signed(int(r.vbuuid) & _U64), int(r.seqno)))
            for vb in touched:
                self.mlog.trim(vb)
            c.execute("INSERT OR REPLACE INTO spark_batch VALUES (0, ?)", (batch_id,))
            c.execute("COMMIT")
        except BaseException:
            c.execute("ROLLBACK")
            raise
        self.batches += 1
        self.sync()
        return True

    def _change(self, r: Any, vb: int, gen: int) -> None:
        key = bytes(r.key)
        k = _k(key)
        seqno = int(r.seqno)
        prior = self.conn.execute("SELECT value, seqno FROM search_docs WHERE key = ? AND value IS NOT NULL",
                                  (k,)).fetchone()
        self.mlog.record(vb, [(seqno, key)], {} if prior is None else {key: (bytes(prior[0]), int(prior[1]))})
        value = None if r.op in ("deletion", "expiration") or r.value is None else bytes(r.value)
        self.conn.execute("INSERT OR REPLACE INTO search_docs VALUES (?, ?, ?, ?, ?)", (k, value, vb, seqno, gen))
        self.changes += 1

    def _rollback(self, vb: int, to: int, gen: int) -> None:
        try:
            undo = self.mlog.undo_to(vb, to)
        except LogTooShort as e:
            raise SparkIndexError(f"vbucket {vb} rolled back to seqno {to}, below what the job's mutation log "
                                  f"keeps ({e}): start over on a new index directory and checkpoint location, "
                                  "or raise --mutation-log-max") from e
        self.rollbacks += 1
        for u in undo:
            k = _k(u.key)
            self.conn.execute("INSERT OR REPLACE INTO search_docs VALUES (?, ?, ?, ?, ?)",
                              (k, u.prior_value, vb, u.prior_seqno, gen))

    # ------------------------------------------------------------------------------------------ backend
    def sync(self) -> bool:
        """Apply the store's generations above the backend's checkpoint and commit them with the positions."""
        last = self.last_batch()
        if last is None or last + 1 <= self.visible.generation:
            return False
        gen = last + 1
        ops: list[IndexOp] = [
            Delete(k, vb, s) if v is None else Upsert(k, vb, s, bytes(v))
            for k, v, vb, s in self.conn.execute(
                "SELECT key, value, vbucket, seqno FROM search_docs WHERE gen > ? ORDER BY gen",
                (self.visible.generation,))]
        cp = Checkpoint(gen, self.positions(), self.mapping_id)
        self.stats.add(self.backend.apply(ops))
        self.backend.commit(cp)
        self.visible = cp
        self.conn.execute("DELETE FROM search_docs WHERE value IS NULL AND gen <= ?", (gen,))
        return True

    def docs(self) -> dict[str, tuple[bytes, int]]:
        """The document store: key -> (value, vbucket) of every live document."""
        return {k: (bytes(v), int(vb)) for k, v, vb in
                self.conn.execute("SELECT key, value, vbucket FROM search_docs WHERE value IS NOT NULL")}

    def status(self) -> dict[str, Any]:
        return {"batch_id": self.last_batch(), "generation": self.visible.generation, "batches": self.batches,
                "skipped_batches": self.skipped_batches, "changes": self.changes, "rollbacks": self.rollbacks,
                "indexed": self.stats.indexed, "deleted": self.stats.deleted,
                "binary_skipped": self.stats.binary_skipped, "field_rejected": self.stats.field_rejected,
                "rejected": self.stats.rejected,
                "positions": {str(vb): p.seqno for vb, p in sorted(self.visible.positions.items())}}

    def close(self) -> None:
        self.conn.close()


def start_query(spark: Any, sink: BatchIndexer, *, bootstrap: str, topic: str, checkpoint_location: str | Path,
                once: bool = True, trigger_seconds: float = 1.0,
                max_records_per_partition: int | None = None, options: Iterable[tuple[str, str]] = ()) -> Any:
    """Start the streaming query (the ``dcp`` source registered on ``spark``) writing into ``sink``."""
    from connectors.spark import DcpDataSource

    spark.dataSource.register(DcpDataSource)
    r = spark.readStream.format("dcp").option("bootstrap.servers", bootstrap).option("topic", topic)
    if max_records_per_partition:
        r = r.option("maxRecordsPerPartitionPerBatch", str(max_records_per_partition))
    for k, v in options:
        r = r.option(k, v)
    w = r.load().writeStream.foreachBatch(sink).option("checkpointLocation", str(checkpoint_location))
    w = w.trigger(availableNow=True) if once else w.trigger(processingTime=f"{trigger_seconds} seconds")
    return w.start()


def _backend(args: argparse.Namespace) -> tuple[IndexBackend, str]:
    if args.backend in ("elasticsearch", "opensearch"):
        from connectors.search.elastic import ElasticsearchBackend, ElasticsearchSettings

        if not args.es_url:
            raise SystemExit(f"spark_job: --backend {args.backend} needs --es-url URL")
        # a Spark batch cannot keep consuming while the cluster is away: it waits for it (max_retries None)
        settings = ElasticsearchSettings(args.es_url, flavor=args.backend, index=args.es_index,
                                         routing=args.es_routing, max_retries=None)
        return ElasticsearchBackend(settings, args.index_dir, topic=args.topic), ""
    from connectors.search.mapping import DocumentMapping
    from connectors.search.tantivy_backend import TantivyBackend

    mapping = DocumentMapping.load(args.mapping)
    return TantivyBackend(Path(args.index_dir) / "tantivy", mapping), mapping.id


def main(argv: Sequence[str] | None = None, *, spark: Any = None) -> int:
    """The job's command. ``spark``: a running SparkSession to use (and leave running) instead of starting one
    (the tests' shared session)."""
    ap = argparse.ArgumentParser(prog="python -m connectors.search.spark_job", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--topic", required=True)
    ap.add_argument("--index-dir", required=True)
    ap.add_argument("--bootstrap", default=os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "localhost:9092"))
    ap.add_argument("--mapping", help="the tantivy backend's mapping (JSON or TOML; default: dynamic)")
    ap.add_argument("--backend", choices=["tantivy", "elasticsearch", "opensearch"], default="tantivy")
    ap.add_argument("--es-url")
    ap.add_argument("--es-index")
    ap.add_argument("--es-routing", choices=["key", "vbucket"], default="key")
    ap.add_argument("--checkpoint-location", help="Spark's checkpoint (default: INDEX_DIR/spark-checkpoint)")
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--once", action="store_true", help="index what the topic holds now, then exit")
    ap.add_argument("--trigger-seconds", type=float, default=1.0)
    ap.add_argument("--max-records-per-partition", type=int)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        backend, mapping_id = _backend(args)
    except ConnectorError as e:
        print(f"spark_job: {e}", file=sys.stderr)
        return 2
    own = spark is None
    if own:
        from pyspark.sql import SparkSession

        spark = (SparkSession.builder.master(args.master).appName(f"dcpgw-search-{args.topic}")
                 .config("spark.ui.enabled", "false").config("spark.sql.shuffle.partitions", "2").getOrCreate())
        spark.sparkContext.setLogLevel("ERROR")
    sink = BatchIndexer(args.index_dir, backend, mapping_id=mapping_id)
    chk = args.checkpoint_location or str(Path(args.index_dir) / "spark-checkpoint")
    t0 = time.monotonic()
    q = start_query(spark, sink, bootstrap=args.bootstrap, topic=args.topic, checkpoint_location=chk,
                    once=args.once, trigger_seconds=args.trigger_seconds,
                    max_records_per_partition=args.max_records_per_partition)
    try:
        q.awaitTermination()
    except KeyboardInterrupt:
        q.stop()
    finally:
        exc = q.exception()
        print(json.dumps({**sink.status(), "seconds": round(time.monotonic() - t0, 3)}), flush=True)
        sink.close()
        backend.close()
        if own:
            spark.stop()
    if exc is not None:
        print(f"spark_job: the query failed: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
