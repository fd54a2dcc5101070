"""The XDCR replication as a Spark structured-streaming job (docs/xdcr.md "Spark job").

    python -m connectors.xdcr.spark_job --bootstrap K --topic T --target couchbase://HOST:KVPORT \\
        --checkpoint DIR [--user U --password P] [--master local[2]] [--available-now]

The ``dcp`` source (``connectors.spark``) hands micro-batches of complete snapshots and rollback rows;
:class:`XdcrBatchWriter` is the ``foreachBatch`` function that writes them to the target with meta
(SET_WITH_META / DEL_WITH_META, the target resolves conflicts). Spark keeps the source offsets in its
checkpoint location; the writer keeps, under ``CHECKPOINT/xdcr/``, the last batch id it applied (a batch id at
or below it is skipped: idempotent per batch id; a batch that died before recording its id is written again,
and the target rejects what it already holds as identical) and a changelog of the versions it wrote per
vbucket, from which a rollback row restores each key the lost branch changed to its version at the restart
point with forced acceptance -- as the standalone replicator does from its mutation log.
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from connectors.xdcr.connection import Credentials
from connectors.xdcr.document import ConflictMode, DocVersion
from connectors.xdcr.errors import ConflictModeMismatch, XdcrError
from connectors.xdcr.mcbp import SKIP_CONFLICT_RESOLUTION_FLAG, Status
from connectors.xdcr.target import TargetCluster, TargetSpec, WriteOp

__all__ = ["XdcrBatchWriter", "main"]

_U64 = (1 << 64) - 1
_SCHEMA = """
CREATE TABLE IF NOT EXISTS xdcr_batches (one INTEGER PRIMARY KEY CHECK (one = 1), batch_id INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS xdcr_history (vbucket INTEGER NOT NULL, seqno INTEGER NOT NULL, key BLOB NOT NULL,
                                         version BLOB NOT NULL, PRIMARY KEY (vbucket, seqno, key)) WITHOUT ROWID
"""


class XdcrBatchWriter:
    """``foreachBatch`` function: ``writer(batch_df, batch_id)`` (runs on the driver)."""

    def __init__(self, target: str, checkpoint: str | Path, *, user: str | None = None,
                 password: str | None = None, conflict_resolution: ConflictMode = ConflictMode.SEQNO,
                 batch_docs: int = 500) -> None:
        self.target_url = target
        self.creds = Credentials(user, password)
        self.dir = Path(checkpoint) / "xdcr"
        self.mode = conflict_resolution
        self.batch_docs = batch_docs
        self.counters = {"written": 0, "rejected": 0, "restored": 0, "rollbacks": 0, "skipped_batches": 0}
        self._target: TargetCluster | None = None

    def target(self) -> TargetCluster:
        if self._target is None:
            t = TargetCluster(TargetSpec.parse(self.target_url), self.creds)
            t.connect()
            mode = t.conflict_mode()
            if mode is not None and mode is not self.mode:
                t.close()
                raise ConflictModeMismatch(f"the target bucket resolves conflicts by {mode.value}, the source by "
                                           f"{self.mode.value}")
            self._target = t
        return self._target

    def _db(self) -> sqlite3.Connection:
        self.dir.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(str(self.dir / "state.sqlite"), isolation_level=None)
        for stmt in _SCHEMA.split(";"):
            if stmt.strip():
                conn.execute(stmt)
        return conn

    def __call__(self, batch_df: Any, batch_id: int) -> None:
        conn = self._db()
        try:
            row = conn.execute("SELECT batch_id FROM xdcr_batches").fetchone()
            if row is not None and batch_id <= row[0]:
                self.counters["skipped_batches"] += 1
                return
            rows = sorted(batch_df.collect(), key=lambda r: (r["kafka_partition"], r["kafka_offset"]))
            conn.execute("BEGIN IMMEDIATE")
            self.apply(conn, rows)
            conn.execute("INSERT OR REPLACE INTO xdcr_batches VALUES (1, ?)", (batch_id,))
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        finally:
            conn.close()

    def apply(self, conn: sqlite3.Connection, rows: Iterable[Any]) -> None:
        """The rows of one batch in Kafka order: data rows are written with meta; a rollback row first sends
        what came before it, then restores the vbucket's keys changed above its restart point."""
        pending: list[WriteOp] = []
        for r in rows:
            vb = int(r["vbucket"])
            if r["op"] == "rollback":
                self._send(pending)
                pending = []
                self._rollback(conn, vb, int(r["seqno"]) & _U64)
                continue
            deleted = r["op"] != "mutation"
            v = DocVersion(bytes(r["key"]), int(r["cas"]) & _U64, int(r["rev"]) & _U64, int(r["flags"] or 0),
                           int(r["expiry"] or 0), deleted, int(r["datatype"] or 0),
                           None if deleted else bytes(r["value"] or b""))
            conn.execute("INSERT OR REPLACE INTO xdcr_history VALUES (?, ?, ?, ?)",
                         (vb, int(r["seqno"]) & _U64, v.key, v.pack()))
            pending.append(WriteOp(vb, v, expiration=r["op"] == "expiration"))
            if len(pending) >= self.batch_docs:
                self._send(pending)
                pending = []
        self._send(pending)

    def _rollback(self, conn: sqlite3.Connection, vb: int, restart: int) -> None:
        self.counters["rollbacks"] += 1
        keys = [bytes(k) for (k,) in conn.execute(
            "SELECT DISTINCT key FROM xdcr_history WHERE vbucket = ? AND seqno > ?", (vb, restart))]
        conn.execute("DELETE FROM xdcr_history WHERE vbucket = ? AND seqno > ?", (vb, restart))
        ops = []
        for k in keys:
            prior = conn.execute("SELECT version FROM xdcr_history WHERE vbucket = ? AND key = ? ORDER BY seqno DESC "
                                 "LIMIT 1", (vb, k)).fetchone()
            v = DocVersion.unpack(k, bytes(prior[0])) if prior else DocVersion(k, 1, 1, 0, 0, True)
            ops.append(WriteOp(vb, v, SKIP_CONFLICT_RESOLUTION_FLAG))
        self._send(ops)
        self.counters["restored"] += len(ops)

    def _send(self, ops: list[WriteOp]) -> None:
        if not ops:
            return
        for o, res in zip(ops, self.target().write(ops), strict=True):
            if res.status == Status.SUCCESS:
                self.counters["written"] += 1
            elif res.status == Status.KEY_EEXISTS:
                self.counters["rejected"] += 1
            else:
                raise XdcrError(f"the target refused {o.version.key!r} (vbucket {o.vbucket}): status "
                                f"0x{res.status:02x}")

    def close(self) -> None:
        if self._target is not None:
            self._target.close()


def run(spark: Any, bootstrap: str, topic: str, writer: XdcrBatchWriter, checkpoint: str | Path, *,
        available_now: bool = True, processing_time: str = "5 seconds") -> None:
    from connectors.spark import DcpDataSource

    spark.dataSource.register(DcpDataSource)
    stream = (spark.readStream.format("dcp").option("bootstrap.servers", bootstrap).option("topic", topic).load())
    w = stream.writeStream.foreachBatch(writer).option("checkpointLocation", str(Path(checkpoint) / "spark"))
    w = w.trigger(availableNow=True) if available_now else w.trigger(processingTime=processing_time)
    w.start().awaitTermination()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bootstrap", required=True)
    ap.add_argument("--topic", required=True)
    ap.add_argument("--target", required=True)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--user", default=os.environ.get("DCPGW_XDCR_USER"), help="target user (DCPGW_XDCR_USER)")
    ap.add_argument("--password", default=os.environ.get("DCPGW_XDCR_PASSWORD"),
                    help="its password (DCPGW_XDCR_PASSWORD: keeps it off the command line)")
    ap.add_argument("--conflict-resolution", choices=("seqno", "lww"), default="seqno")
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--available-now", action="store_true", help="process what is in the topic, then exit")
    a = ap.parse_args(argv)
    from pyspark.sql import SparkSession

    spark = SparkSession.builder.master(a.master).appName("dcpgw-xdcr").getOrCreate()
    writer = XdcrBatchWriter(a.target, a.checkpoint, user=a.user, password=a.password,
                             conflict_resolution=ConflictMode(a.conflict_resolution))
    try:
        run(spark, a.bootstrap, a.topic, writer, a.checkpoint, available_now=a.available_now)
    except XdcrError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        writer.close()
        spark.stop()
    print(writer.counters)
    return 0


if __name__ == "__main__":
    sys.exit(main())
