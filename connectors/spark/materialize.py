"""``foreachBatch`` helper: a Parquet table of the latest state per key, exact across rollbacks.

    query = (spark.readStream.format("dcp").options(...).load()
             .writeStream.foreachBatch(materializer("/data/travel"))
             .option("checkpointLocation", "/data/travel-chk").trigger(availableNow=True).start())
    read_table(spark, "/data/travel")          # key, value, vbucket, seqno

Layout under ``path`` (a local or mounted file system path)::

    _current.json                 {"batch_id": 7, "version": "v00000007"}   (replaced atomically)
    v00000007/history/*.parquet   key, value, deleted, vbucket, seqno: every change still valid
    v00000007/state/*.parquet     key, value, vbucket, seqno: the latest live version of each key

**Rollback.** A ``rollback`` row for vbucket V to seqno B means: the changes of V above B never happened.
The history (a changelog: one row per key per seqno) makes reverting exact: drop V's history rows with
seqno > B; each key's state is then its newest remaining version, i.e. its state at B. Inside one batch,
a data row is dropped when a rollback row of its vbucket *after it* (higher Kafka offset; a vbucket lives in one
partition) goes below its seqno.

**Idempotent per batch_id.** Each batch writes a new version directory, then replaces ``_current.json``; a
batch whose id is <= the recorded one is skipped (Spark re-running a batch after a failure), and a batch that
died before replacing the pointer is simply written again.

**Bounds.** The history holds one row per change ever applied (minus rolled back ones): its size grows with
the number of changes, like a changelog, unless ``history_keep_seqnos`` is given: then, per key, versions
superseded more than that many seqnos below their vbucket's newest seqno are dropped and a rollback below that
horizon raises (it could not be reverted exactly). Every batch rewrites both tables (cost O(table size) per
batch, in Spark, not in driver memory); for very large tables use a table format with MERGE (Delta, Iceberg).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

_POINTER = "_current.json"


class MaterializeError(RuntimeError):
    pass


def _pointer(path: str) -> dict[str, Any] | None:
    p = Path(path) / _POINTER
    if not p.exists():
        return None
    result: dict[str, Any] = json.loads(p.read_text())
    return result


def table_path(path: str, table: str = "state") -> str | None:
    """Directory of the current ``state`` (or ``history``) Parquet table; None before the first batch."""
    ptr = _pointer(path)
    if ptr is None or ptr.get("version") is None:
        return None
    return str(Path(path) / ptr["version"] / table)


def read_table(spark: Any, path: str, table: str = "state") -> Any:
    """The current table as a DataFrame (empty with the right columns before the first batch)."""
    tp = table_path(path, table)
    if tp is None:
        ddl = ("key binary, value binary, vbucket int, seqno bigint" if table == "state"
               else "key binary, value binary, deleted boolean, vbucket int, seqno bigint")
        return spark.createDataFrame([], ddl)
    return spark.read.parquet(tp)


def materialize(batch_df: Any, batch_id: int, path: str, history_keep_seqnos: int | None = None) -> None:
    """Apply one micro-batch of ``dcp`` rows to the table at ``path`` (see the module docstring)."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    spark = batch_df.sparkSession
    ptr = _pointer(path)
    if ptr is not None and int(ptr["batch_id"]) >= batch_id:
        return  # already applied: Spark re-ran the batch
    Path(path).mkdir(parents=True, exist_ok=True)
    batch = batch_df.select("op", "key", "value", "vbucket", "seqno", "kafka_offset").persist()
    try:
        # data rows only: rollback rows below, ``corrupt`` rows (corruptRecords=row) change no key
        data = (batch.where(F.col("op").isin("mutation", "deletion", "expiration"))
                .select("key", "value", (F.col("op") != "mutation").alias("deleted"), "vbucket", "seqno",
                        "kafka_offset"))
        rb = batch.where(F.col("op") == "rollback").select(
            F.col("vbucket").alias("rb_vb"), F.col("seqno").alias("rb_seqno"), F.col("kafka_offset").alias("rb_off"))
        has_rb = rb.limit(1).count() > 0
        old = read_table(spark, path, "history")
        if has_rb:
            data = data.join(rb, (data.vbucket == rb.rb_vb) & (rb.rb_off > data.kafka_offset)
                             & (rb.rb_seqno < data.seqno), "left_anti")
            low = rb.groupBy("rb_vb").agg(F.min("rb_seqno").alias("rb_seqno"))
            if history_keep_seqnos is not None and ptr is not None:
                horizon = old.groupBy(F.col("vbucket").alias("h_vb")).agg(
                    (F.max("seqno") - F.lit(history_keep_seqnos)).alias("h_low"))
                bad = low.join(horizon, low.rb_vb == horizon.h_vb).where(F.col("rb_seqno") < F.col("h_low"))
                if bad.limit(1).count():
                    raise MaterializeError(
                        f"rollback below the kept history (history_keep_seqnos={history_keep_seqnos}): "
                        f"{bad.collect()}")
            old = old.join(low, (old.vbucket == low.rb_vb) & (old.seqno > low.rb_seqno), "left_anti")
        history = old.unionByName(data.drop("kafka_offset"))
        newest = Window.partitionBy("key").orderBy(F.col("seqno").desc())
        ranked = history.withColumn("_rank", F.row_number().over(newest))
        if history_keep_seqnos is not None:
            vb_max = Window.partitionBy("vbucket")
            history = (ranked.withColumn("_vbmax", F.max("seqno").over(vb_max))
                       .where((F.col("_rank") == 1) | (F.col("seqno") >= F.col("_vbmax") - history_keep_seqnos))
                       .drop("_rank", "_vbmax"))
        version = f"v{batch_id:08d}"
        out = Path(path) / version
        history.write.mode("overwrite").parquet(str(out / "history"))
        hist = spark.read.parquet(str(out / "history"))
        state = (hist.withColumn("_rank", F.row_number().over(newest))
                 .where((F.col("_rank") == 1) & ~F.col("deleted"))
                 .select("key", "value", "vbucket", "seqno"))
        state.write.mode("overwrite").parquet(str(out / "state"))
        tmp = Path(path) / (_POINTER + ".tmp")
        tmp.write_text(json.dumps({"batch_id": batch_id, "version": version}))
        os.replace(tmp, Path(path) / _POINTER)
        # keep the previous version (a reader may still be on it), drop older ones
        keep = {version, None if ptr is None else ptr.get("version")}
        for d in Path(path).iterdir():
            if d.is_dir() and d.name.startswith("v") and d.name not in keep:
                shutil.rmtree(d, ignore_errors=True)
    finally:
        batch.unpersist()


def materializer(path: str, history_keep_seqnos: int | None = None) -> Callable[[Any, int], None]:
    """``writeStream.foreachBatch(materializer(path))``."""

    def apply(batch_df: Any, batch_id: int) -> None:
        materialize(batch_df, batch_id, path, history_keep_seqnos)

    return apply
