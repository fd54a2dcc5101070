"""The XDCR replication as a Spark structured-streaming job (docs/xdcr.md "Spark job").

    python -m connectors.xdcr.spark_job --bootstrap K --topic T --target couchbase://HOST:KVPORT \\
        --checkpoint DIR [--user U --password P] [--master local[2]] [--available-now] \\
        [--filter-key REGEX] [--filter-skip-deletions] [--filter-skip-expirations] [--filter-skip-binary] \\
        [--restream | --no-restream] [--optimistic-threshold 256] [--batch-docs 500] [--batch-bytes 2097152]

The ``dcp`` source (``connectors.spark``) hands micro-batches of complete snapshots and rollback rows;
:class:`XdcrBatchWriter` is the ``foreachBatch`` function that writes them to the target with meta
(SET/ADD/DEL_WITH_META, the target resolves conflicts), as the standalone replicator does and with its code:
the optimistic-threshold GET_META pre-check and the answers' accounting (``batch.py``: E2BIG is dead-lettered
and the job goes on), the filters and the restream choice on a filter change (``filters.py``). The source is read
with ``corruptRecords=row``: a record that does not decode is dead-lettered as the replicator does
(``corrupt_record``) and the job goes on.

Spark keeps the source offsets in its checkpoint location; the writer keeps, under ``CHECKPOINT/xdcr/``, the
last batch id it applied (a batch id at or below it is skipped: idempotent per batch id; a batch that died
before recording its id is written again, and the target rejects what it already holds as identical), a
changelog of the versions it wrote per source vbucket and seqno, from which a rollback row restores each key
the lost branch changed to its version at the restart point with forced acceptance -- as the standalone
replicator does from its mutation log -- and the target's positions (``target_history.py``): since Spark owns
the source positions, what a target that lost history (hard failover, unclean restart) no longer holds is
written again from that record, on start and whenever the target answers with a new vbuuid.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sqlite3
import sys
import time
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import Any

from connectors.spark.core import CORRUPT_OP
from connectors.xdcr.batch import write_batch
from connectors.xdcr.connection import Credentials
from connectors.xdcr.document import ConflictMode, DocVersion
from connectors.xdcr.errors import (
    ConflictModeMismatch,
    KvError,
    TargetAuthError,
    TargetError,
    TargetUnreachable,
    XdcrError,
)
from connectors.xdcr.filters import Filters, settle_filter_change
from connectors.xdcr.mcbp import SKIP_CONFLICT_RESOLUTION_FLAG
from connectors.xdcr.metrics import Metrics
from connectors.xdcr.target import TargetCluster, TargetSpec, WriteOp, WriteResult
from connectors.xdcr.target_history import TargetLedger

__all__ = ["XdcrBatchWriter", "main"]

log = logging.getLogger(__name__)

_U64 = (1 << 64) - 1
_SCHEMA = """
CREATE TABLE IF NOT EXISTS xdcr_batches (one INTEGER PRIMARY KEY CHECK (one = 1), batch_id INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS xdcr_history (vbucket INTEGER NOT NULL, seqno INTEGER NOT NULL, key BLOB NOT NULL,
                                         version BLOB NOT NULL, PRIMARY KEY (vbucket, seqno, key)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS xdcr_meta (name TEXT PRIMARY KEY, value TEXT NOT NULL)
"""
DEAD_LETTER_FILE = "dead-letter.jsonl"
#: rounds of "resend what the target lost" in one batch (each resend may meet yet another new vbuuid)
_RESEND_ROUNDS = 5


class XdcrBatchWriter:
    """``foreachBatch`` function: ``writer(batch_df, batch_id)`` (runs on the driver). :meth:`prepare` first
    (settle the filters, connect, check the target's history)."""

    def __init__(self, target: str, checkpoint: str | Path, *, user: str | None = None,
                 password: str | None = None, conflict_resolution: ConflictMode = ConflictMode.SEQNO,
                 batch_docs: int = 500, batch_bytes: int = 2 << 20, optimistic_threshold: int = 256,
                 filters: Filters | None = None, restream: bool | None = None, give_up_after: float | None = None,
                 retry_max_delay: float = 30.0, clock: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep) -> None:
        self.target_url = target
        self.spec = TargetSpec.parse(target)
        self.creds = Credentials(user, password)
        self.checkpoint = Path(checkpoint)
        self.dir = self.checkpoint / "xdcr"
        self.mode = conflict_resolution
        self.batch_docs = batch_docs
        self.batch_bytes = batch_bytes
        self.threshold = optimistic_threshold
        self.filters = filters or Filters()
        self.restream = restream
        self.give_up_after = give_up_after
        self.retry_max_delay = retry_max_delay
        self.clock = clock
        self.sleep = sleep
        self.metrics = Metrics()
        #: batches skipped as already applied, writes sent again because the target lost them
        self.skipped_batches = 0
        self.resent = 0
        #: the error that failed a batch (Spark reports it wrapped)
        self.failure: XdcrError | None = None
        self._target: TargetCluster | None = None
        self._ledger: TargetLedger | None = None
        self._check: set[int] = set()
        self._prepared = False

    # ------------------------------------------------------------------------------------------ start
    def target(self) -> TargetCluster:
        if self._target is None:
            t = TargetCluster(self.spec, self.creds, sleep=self.sleep)
            t.connect()
            mode = t.conflict_mode()
            if mode is not None and mode is not self.mode:
                t.close()
                raise ConflictModeMismatch(f"the target bucket resolves conflicts by {mode.value}, the source by "
                                           f"{self.mode.value}")
            self._target = t
        return self._target

    def _with_retries(self, fn: Callable[[], Any]) -> Any:
        """``fn`` until the target answers: an unreachable or refusing target is retried with exponential
        backoff (0.1 s doubling up to ``retry_max_delay``) on a new connection, for ever or ``give_up_after``
        seconds, as the standalone replicator does; each new error is logged once."""
        delay = 0.1
        t0 = time.monotonic()
        last = ""
        while True:
            try:
                out = fn()
                self.metrics.target_state, self.metrics.target_error = "ok", ""
                return out
            except (TargetUnreachable, TargetAuthError) as e:
                state = "auth_failed" if isinstance(e, TargetAuthError) else "unreachable"
                if f"{state}: {e}" != last:
                    log.error("xdcr spark job: target %s: %s (retrying with backoff)", state.replace("_", " "), e)
                    last = f"{state}: {e}"
                self.metrics.target_state, self.metrics.target_error = state, str(e)
                self.metrics.retries += 1
                if self._target is not None:
                    self._target.close()
                    self._target = None
                if self.give_up_after is not None and time.monotonic() - t0 >= self.give_up_after:
                    raise
                self.sleep(delay)
                delay = min(delay * 2, self.retry_max_delay)

    def _db(self) -> sqlite3.Connection:
        self.dir.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(str(self.dir / "state.sqlite"), isolation_level=None)
        for stmt in _SCHEMA.split(";"):
            if stmt.strip():
                conn.execute(stmt)
        return conn

    def settle_filters(self) -> None:
        """A filter change over existing state is refused (FilterChanged) unless ``restream`` says: True
        forgets Spark's offsets, the batch id and the changelog (everything is replicated again; the target
        rejects what it holds as identical), False applies the new filters from the current offsets on."""
        conn = self._db()
        try:
            row = conn.execute("SELECT value FROM xdcr_meta WHERE name = 'filters'").fetchone()
            spark_dir = self.checkpoint / "spark"
            has_state = spark_dir.exists() or conn.execute("SELECT 1 FROM xdcr_batches").fetchone() is not None
            if settle_filter_change(None if row is None else str(row[0]), self.filters, has_state, self.restream,
                                    str(self.checkpoint)):
                log.warning("xdcr spark job: filters changed: replicating the topic again from its start")
                shutil.rmtree(spark_dir, ignore_errors=True)
                conn.execute("DELETE FROM xdcr_batches")
                conn.execute("DELETE FROM xdcr_history")
            conn.execute("INSERT OR REPLACE INTO xdcr_meta VALUES ('filters', ?)", (self.filters.fingerprint(),))
        finally:
            conn.close()

    def prepare(self) -> None:
        """Before the query starts: settle the filters, connect (refusing another conflict-resolution mode),
        then send again what the target lost since the last run (its failover logs vs the recorded positions)."""
        self.settle_filters()
        self._with_retries(self.target)
        conn = self._db()
        try:
            conn.execute("BEGIN IMMEDIATE")
            self._ledger = TargetLedger(conn)
            self._check = set(self._ledger.positions())
            self._resend_lost(conn)
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        finally:
            self._ledger = None
            conn.close()
        self._prepared = True

    # -------------------------------------------------------------------------------------- batches
    def __call__(self, batch_df: Any, batch_id: int) -> None:
        self.write_rows(batch_df.collect, batch_id)

    def write_rows(self, rows: Callable[[], Iterable[Any]], batch_id: int) -> bool:
        """Apply the rows ``rows()`` returns (read only when ``batch_id`` is new) as one batch, in one
        transaction of the state file with the batch id; False when the batch id was applied already."""
        if not self._prepared:
            self.prepare()
        conn = self._db()
        try:
            row = conn.execute("SELECT batch_id FROM xdcr_batches").fetchone()
            if row is not None and batch_id <= row[0]:
                self.skipped_batches += 1
                return False
            ordered = sorted(rows(), key=lambda r: (r["kafka_partition"], r["kafka_offset"]))
            conn.execute("BEGIN IMMEDIATE")
            self._ledger = TargetLedger(conn)
            self.apply(conn, ordered)
            self._resend_lost(conn)
            conn.execute("INSERT OR REPLACE INTO xdcr_batches VALUES (1, ?)", (batch_id,))
            conn.execute("COMMIT")
            return True
        except XdcrError as e:
            self.failure = e
            raise
        finally:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            self._ledger = None
            conn.close()

    def apply(self, conn: sqlite3.Connection, rows: Iterable[Any]) -> None:
        """The rows of one batch in Kafka order: data rows that pass the filters are written with meta; a
        rollback row first sends what came before it, then restores the vbucket's keys changed above its
        restart point."""
        pending: list[WriteOp] = []
        size = 0
        for r in rows:
            op = r["op"]
            if op == CORRUPT_OP:
                self._corrupt(r)
                continue
            vb = int(r["vbucket"])
            if op == "rollback":
                self._send(conn, pending)
                pending, size = [], 0
                self._rollback(conn, vb, int(r["seqno"]) & _U64)
                continue
            key = bytes(r["key"])
            datatype = int(r["datatype"] or 0)
            if not self.filters.passes_change(key, op, datatype):
                self.metrics.filtered += 1
                continue
            deleted = op != "mutation"
            v = DocVersion(key, int(r["cas"]) & _U64, int(r["rev"]) & _U64, int(r["flags"] or 0),
                           int(r["expiry"] or 0), deleted, datatype, None if deleted else bytes(r["value"] or b""))
            conn.execute("INSERT OR REPLACE INTO xdcr_history VALUES (?, ?, ?, ?)",
                         (vb, int(r["seqno"]) & _U64, v.key, v.pack()))
            w = WriteOp(vb, v, expiration=op == "expiration")
            pending.append(w)
            size += w.size
            if len(pending) >= self.batch_docs or size >= self.batch_bytes:
                self._send(conn, pending)
                pending, size = [], 0
        self._send(conn, pending)

    def _rollback(self, conn: sqlite3.Connection, vb: int, restart: int) -> None:
        self.metrics.rollbacks += 1
        keys = [bytes(k) for (k,) in conn.execute(
            "SELECT DISTINCT key FROM xdcr_history WHERE vbucket = ? AND seqno > ?", (vb, restart))]
        conn.execute("DELETE FROM xdcr_history WHERE vbucket = ? AND seqno > ?", (vb, restart))
        ops = []
        for k in keys:
            if not self.filters.passes_key(k):
                continue
            prior = conn.execute("SELECT version FROM xdcr_history WHERE vbucket = ? AND key = ? ORDER BY seqno DESC "
                                 "LIMIT 1", (vb, k)).fetchone()
            v = DocVersion.unpack(k, bytes(prior[0])) if prior else DocVersion(k, 1, 1, 0, 0, True)
            ops.append(WriteOp(vb, v, SKIP_CONFLICT_RESOLUTION_FLAG))
        self._send(conn, ops)
        self.metrics.restored += len(ops)

    def _send(self, conn: sqlite3.Connection, ops: list[WriteOp]) -> None:
        for i in range(0, len(ops), self.batch_docs):
            chunk = ops[i:i + self.batch_docs]
            self._with_retries(partial(self._write_chunk, chunk))

    def _write_chunk(self, ops: list[WriteOp]) -> None:
        write_batch(self.target(), ops, threshold=self.threshold, mode=self.mode, metrics=self.metrics,
                    dead_letter=self._dead_letter, on_written=self._written, sleep=self.sleep)

    def _failover_log(self, tvb: int) -> list[tuple[int, int]]:
        return self.target().failover_log(tvb)

    def _written(self, op: WriteOp, r: WriteResult) -> None:
        assert self._ledger is not None
        if self._ledger.record(op, r.vbucket, r.token if r.vbucket >= 0 else None):
            self._check.add(r.vbucket)  # a new vbuuid: a failover or restart of the target

    def _resend_lost(self, conn: sqlite3.Connection) -> None:
        """Every target vbucket in ``_check``: its failover log against the recorded positions; what it lost is
        written again (target_history.py)."""
        assert self._ledger is not None
        for _ in range(_RESEND_ROUNDS):
            if not self._check:
                return
            check, self._check = sorted(self._check), set()
            for tvb in check:
                try:
                    flog = self._with_retries(partial(self._failover_log, tvb))
                except KvError as e:
                    log.warning("xdcr spark job: the target gives no failover log (%s): positions not validated", e)
                    return
                lost = self._ledger.take_lost(tvb, flog)
                if lost:
                    log.warning("xdcr spark job: the target lost %d write(s) of its vbucket %d (failover log %s): "
                                "writing them again", len(lost), tvb, flog)
                    self.resent += len(lost)
                    self._send(conn, lost)

    def _corrupt(self, r: Any) -> None:
        """A record of the topic that does not decode (the ``dcp`` source's ``corrupt`` row, read with
        ``corruptRecords=row``): dead-lettered as the standalone replicator does (reason ``corrupt_record``,
        partition, offset, the decoding error), counted ``corrupt_records``; the job goes on."""
        self.metrics.corrupt_records += 1
        p, off = int(r["kafka_partition"]), int(r["kafka_offset"])
        detail = bytes(r["value"] or b"").decode("utf-8", "replace")
        self._dead_letter({"reason": "corrupt_record", "partition": p, "offset": off, "detail": detail})
        log.warning("xdcr spark job: corrupt record at partition %d offset %d sent to the dead letter: %s", p, off,
                    detail)

    def _dead_letter(self, entry: dict[str, Any]) -> None:
        self.metrics.dead_letters += 1
        entry["at"] = self.clock()
        self.dir.mkdir(parents=True, exist_ok=True)
        with (self.dir / DEAD_LETTER_FILE).open("a", encoding="utf-8") as f:
            f.write(json.dumps(entry) + "\n")

    def summary(self) -> dict[str, Any]:
        m = self.metrics.to_dict()
        return {k: m[k] for k in ("written", "rejected", "skipped", "filtered", "restored", "rollbacks", "dead_letters",
                                  "corrupt_records", "get_meta", "retries")} | {"resent": self.resent,
                                                             "skipped_batches": self.skipped_batches}

    def close(self) -> None:
        if self._target is not None:
            self._target.close()


def run(spark: Any, bootstrap: str, topic: str, writer: XdcrBatchWriter, checkpoint: str | Path, *,
        available_now: bool = True, processing_time: str = "5 seconds") -> None:
    from connectors.spark import DcpDataSource

    spark.dataSource.register(DcpDataSource)
    # a record that does not decode comes as a ``corrupt`` row, dead-lettered by the writer (the source's
    # default, corruptRecords=fail, would fail every run at it)
    stream = (spark.readStream.format("dcp").option("bootstrap.servers", bootstrap).option("topic", topic)
              .option("corruptRecords", "row").load())
    w = stream.writeStream.foreachBatch(writer).option("checkpointLocation", str(Path(checkpoint) / "spark"))
    w = w.trigger(availableNow=True) if available_now else w.trigger(processingTime=processing_time)
    w.start().awaitTermination()


def main(argv: list[str] | None = None, *, spark: Any = None) -> int:
    """The job's command. ``spark``: a running SparkSession to use (and leave running) instead of starting one
    (the tests' shared session)."""
    ap = argparse.ArgumentParser(prog="python -m connectors.xdcr.spark_job", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bootstrap", required=True)
    ap.add_argument("--topic", required=True)
    ap.add_argument("--target", required=True)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--user", default=os.environ.get("DCPGW_XDCR_USER"), help="target user (DCPGW_XDCR_USER)")
    ap.add_argument("--password", default=os.environ.get("DCPGW_XDCR_PASSWORD"),
                    help="its password (DCPGW_XDCR_PASSWORD: keeps it off the command line)")
    ap.add_argument("--conflict-resolution", choices=("seqno", "lww"),
                    default=os.environ.get("DCPGW_CONFLICT_RESOLUTION", "seqno"),
                    help="the source bucket's mode (DCPGW_CONFLICT_RESOLUTION); the target must match")
    ap.add_argument("--filter-key", default=None, help="replicate only keys matching this regular expression")
    ap.add_argument("--filter-skip-deletions", action="store_true", help="do not replicate deletions")
    ap.add_argument("--filter-skip-expirations", action="store_true", help="do not replicate expirations")
    ap.add_argument("--filter-skip-binary", action="store_true", help="do not replicate binary (non-JSON) docs")
    rs = ap.add_mutually_exclusive_group()
    rs.add_argument("--restream", dest="restream", action="store_const", const=True, default=None,
                    help="the filters changed: replicate the topic again from its start under the new ones")
    rs.add_argument("--no-restream", dest="restream", action="store_const", const=False,
                    help="the filters changed: apply them from the current offsets on")
    ap.add_argument("--optimistic-threshold", type=int, default=256,
                    help="larger documents are checked with GET_META first (256)")
    ap.add_argument("--batch-docs", type=int, default=500, help="documents per write batch (500)")
    ap.add_argument("--batch-bytes", type=int, default=2 << 20, help="bytes per write batch (2 MiB)")
    ap.add_argument("--give-up-after", type=float, default=None, metavar="SECONDS",
                    help="stop retrying an unreachable or refusing target after this many seconds (exit 3)")
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--available-now", action="store_true", help="process what is in the topic, then exit")
    a = ap.parse_args(argv)
    if a.give_up_after is not None and a.give_up_after < 0:
        ap.error("--give-up-after must be >= 0")
    for name in ("optimistic_threshold", "batch_docs", "batch_bytes"):
        if getattr(a, name) < (0 if name == "optimistic_threshold" else 1):
            ap.error(f"--{name.replace('_', '-')} must be {'>= 0' if name == 'optimistic_threshold' else '>= 1'}")
    logging.basicConfig(level=os.environ.get("DCPGW_LOG_LEVEL", "WARNING"),
                        format="%(asctime)s %(levelname)s %(message)s")
    try:
        writer = XdcrBatchWriter(a.target, a.checkpoint, user=a.user, password=a.password,
                                 conflict_resolution=ConflictMode(a.conflict_resolution), batch_docs=a.batch_docs,
                                 batch_bytes=a.batch_bytes, optimistic_threshold=a.optimistic_threshold,
                                 filters=Filters(a.filter_key, a.filter_skip_deletions, a.filter_skip_expirations,
                                                 a.filter_skip_binary), restream=a.restream,
                                 give_up_after=a.give_up_after)
    except XdcrError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        writer.prepare()  # before Spark starts: a refused filter change or target fails fast
    except TargetError as e:
        writer.close()
        print(f"error: target {a.target}: {e}", file=sys.stderr)
        return 3
    except XdcrError as e:
        writer.close()
        print(f"error: {e}", file=sys.stderr)
        return 2
    own = spark is None
    if own:
        from pyspark.sql import SparkSession

        spark = (SparkSession.builder.master(a.master).appName("dcpgw-xdcr").config("spark.ui.enabled", "false")
                 .config("spark.sql.shuffle.partitions", "2").getOrCreate())
    try:
        run(spark, a.bootstrap, a.topic, writer, a.checkpoint, available_now=a.available_now)
    except Exception as e:  # pyspark's StreamingQueryException wraps the batch's error
        if writer.failure is None and not isinstance(e, XdcrError):
            raise
        print(f"error: {writer.failure or e}", file=sys.stderr)
        return 3 if isinstance(writer.failure or e, TargetError) else 2
    finally:
        writer.close()
        if own:
            spark.stop()
    print(json.dumps(writer.summary()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
