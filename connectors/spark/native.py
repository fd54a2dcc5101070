"""Rows from Spark's native ``kafka`` source (clusters with spark-sql-kafka on the classpath).

    raw = (spark.readStream.format("kafka").option("kafka.bootstrap.servers", bs)
           .option("subscribe", topic).option("includeHeaders", "true").load())
    rows = from_kafka_df(raw)        # same columns as the ``dcp`` source

The Kafka source jar needs Maven (not reachable here): CI runs this helper on a DataFrame with exactly the
native source's columns and types, built from the topic with confluent-kafka. Unlike the ``dcp`` source, the native source
cuts micro-batches at arbitrary offsets, so this helper decodes records one by one (``schemas.codec.decode``):
data rows and a ``rollback`` row per rollback record (seqno = its restart point B); snapshot, failover-log and
stream-end records are dropped. Batches are NOT snapshot-atomic: a batch can end inside a snapshot (use
``snap_end`` to hold back incomplete snapshots, or use the ``dcp`` source).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from connectors.spark.core import COLUMNS, SCHEMA_DDL, signed64
from schemas.codec import decode
from schemas.records import RecordType


def _decode_frames(frames: Iterator[Any]) -> Iterator[Any]:
    import pandas as pd

    for pdf in frames:
        out: list[tuple[Any, ...]] = []
        for key, value, headers, part, off in zip(pdf["key"], pdf["value"], pdf["headers"], pdf["partition"],
                                                  pdf["offset"], strict=True):
            # Arrow hands the headers array over as a numpy array (no truth value): test for None
            hs = [(h["key"], None if h["value"] is None else bytes(h["value"]))
                  for h in (() if headers is None else headers)]
            r = decode(None if key is None else bytes(key), None if value is None else bytes(value), hs)
            if r.is_data:
                out.append((r.type.value, r.key, r.value, r.vbucket, signed64(r.vbuuid), signed64(r.seqno),
                            signed64(r.snap_start), signed64(r.snap_end), signed64(r.rev_seqno or 0),
                            signed64(r.cas or 0), int(part), int(off), r.flags or 0, r.expiry or 0, r.datatype or 0))
            elif r.type is RecordType.ROLLBACK:
                out.append(("rollback", None, None, r.vbucket, signed64(r.vbuuid), signed64(r.snap_end),
                            signed64(r.snap_end), signed64(r.snap_end), None, None, int(part), int(off), None, None,
                            None))
        yield pd.DataFrame(out, columns=[n for n, _t in COLUMNS])


def from_kafka_df(df: Any) -> Any:
    """The ``dcp`` rows of a native ``kafka`` DataFrame (read with ``includeHeaders=true``)."""
    return df.select("key", "value", "headers", "partition", "offset").mapInPandas(_decode_frames, SCHEMA_DDL)
