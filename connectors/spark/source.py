"""``DcpDataSource``: a PySpark (>= 4.0) Python data source reading a dcp-gateway topic, format name ``dcp``.

    from connectors.spark import DcpDataSource
    spark.dataSource.register(DcpDataSource)
    df = spark.read.format("dcp").option("bootstrap.servers", bs).option("topic", "dcp.bucket").load()
    sdf = spark.readStream.format("dcp").option("bootstrap.servers", bs).option("topic", "dcp.bucket").load()

Every micro-batch (and the batch read) holds only **complete snapshots**: its offsets are snapshot boundaries of
every vbucket of every partition (see :mod:`connectors.spark.core` and docs/spark.md). The driver finds the
boundaries by replaying the new records with the consumer core's ``VBucketReplayer``; the executors replay the
same ranges (one Spark partition per Kafka partition with new records) and emit the rows.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from pyspark.sql.datasource import DataSource, DataSourceReader, DataSourceStreamReader, InputPartition
from pyspark.sql.types import StructType

from connectors.spark.core import (
    COLUMNS,
    SCHEMA_DDL,
    PartitionPosition,
    Row,
    SourceOptions,
    from_offset,
    initial_positions,
    replay_ranges,
    scan_boundaries,
    to_offset,
    topic_partitions,
)

#: Rows per Arrow batch handed to Spark by ``read``.
ARROW_BATCH_ROWS = 8192


class DcpInputPartition(InputPartition):
    """Ranges ``[start.offset, end)`` of one or more Kafka partitions plus the replayer states at each start
    (read with one consumer)."""

    def __init__(self, opts: SourceOptions, ranges: list[tuple[int, PartitionPosition, int]]) -> None:
        super().__init__(ranges[0][0] if ranges else 0)
        self.opts = opts
        self.ranges = ranges


def _arrow_batches(rows: Iterator[Row]) -> Iterator[Any]:
    import pyarrow as pa

    schema = pa.schema([
        ("op", pa.string()), ("key", pa.binary()), ("value", pa.binary()), ("vbucket", pa.int32()),
        ("vbuuid", pa.int64()), ("seqno", pa.int64()), ("snap_start", pa.int64()), ("snap_end", pa.int64()),
        ("rev", pa.int64()), ("cas", pa.int64()), ("kafka_partition", pa.int32()), ("kafka_offset", pa.int64()),
        ("flags", pa.int64()), ("expiry", pa.int64()), ("datatype", pa.int32()),
    ])
    assert [f.name for f in schema] == [n for n, _t in COLUMNS]
    buf: list[Row] = []
    for r in rows:
        buf.append(r)
        if len(buf) >= ARROW_BATCH_ROWS:
            yield pa.RecordBatch.from_arrays([pa.array(c, type=f.type) for c, f in zip(zip(*buf, strict=True), schema, strict=True)],
                                             schema=schema)
            buf = []
    if buf:
        yield pa.RecordBatch.from_arrays([pa.array(c, type=f.type) for c, f in zip(zip(*buf, strict=True), schema, strict=True)],
                                         schema=schema)


def read_partition(partition: InputPartition, arrow: bool = True) -> Iterator[Any]:
    assert isinstance(partition, DcpInputPartition)
    rows = replay_ranges(partition.opts, partition.ranges)
    if arrow:
        try:
            yield from _arrow_batches(rows)
            return
        except ImportError:  # pragma: no cover - pyarrow is part of the spark extra
            pass
    yield from rows


def _input_partitions(opts: SourceOptions, start: dict[int, PartitionPosition],
                      end: dict[int, PartitionPosition]) -> list[DcpInputPartition]:
    """Kafka partitions with new records, dealt round-robin into at most ``opts.num_partitions`` Spark input
    partitions (a consumer per input partition: opening one costs a round trip or two)."""
    ranges = []
    for p in sorted(end):
        s = start.get(p, PartitionPosition(0))
        if end[p].offset > s.offset:
            ranges.append((p, s, end[p].offset))
    n = min(len(ranges), opts.num_partitions)
    return [DcpInputPartition(opts, ranges[i::n]) for i in range(n)]


class DcpBatchReader(DataSourceReader):
    """``spark.read.format("dcp")``: every complete snapshot in ``[startingOffsets, newest boundary)``."""

    def __init__(self, opts: SourceOptions) -> None:
        self.opts = opts

    def partitions(self) -> Sequence[InputPartition]:
        n = topic_partitions(self.opts)
        start = initial_positions(self.opts, n)
        end = scan_boundaries(self.opts, start)
        parts = _input_partitions(self.opts, start, end)
        return parts or [DcpInputPartition(self.opts, [])]

    def read(self, partition: InputPartition) -> Iterator[Any]:
        return read_partition(partition)


class DcpStreamReader(DataSourceStreamReader):
    """``spark.readStream.format("dcp")``: offsets are snapshot boundaries with the replayer states."""

    def __init__(self, opts: SourceOptions) -> None:
        self.opts = opts
        self._partitions: int | None = None
        self._last: dict[str, Any] | None = None

    def _nparts(self) -> int:
        if self._partitions is None:
            self._partitions = topic_partitions(self.opts)
        return self._partitions

    def initialOffset(self) -> dict[str, Any]:
        return to_offset(self.opts.topic, initial_positions(self.opts, self._nparts()))

    def getDefaultReadLimit(self) -> Any:
        from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows

        if self.opts.max_per_partition is not None:
            return ReadMaxRows(self.opts.max_per_partition)
        return ReadAllAvailable()

    def latestOffset(self, start: dict[str, Any] | None = None, limit: Any = None) -> dict[str, Any]:
        if start is None:  # Spark < 4.2 calls latestOffset() without arguments
            start = self._last if self._last is not None else self.initialOffset()
        n = self._nparts()
        positions = from_offset(start, n)
        for p in range(n):
            positions.setdefault(p, PartitionPosition(0))
        mx = self.opts.max_per_partition
        max_rows = getattr(limit, "max_rows", None)
        if limit is not None:  # Spark >= 4.2: ReadAllAvailable (availableNow) or our ReadMaxRows
            mx = int(max_rows) if max_rows is not None else None
        end = to_offset(self.opts.topic, scan_boundaries(self.opts, positions, mx))
        self._last = end
        return end

    def reportLatestOffset(self) -> dict[str, Any] | None:
        return self._last

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        n = self._nparts()
        self._last = end
        return _input_partitions(self.opts, from_offset(start, n), from_offset(end, n))

    def read(self, partition: InputPartition) -> Iterator[Any]:
        return read_partition(partition)

    def commit(self, end: dict[str, Any]) -> None:
        pass  # nothing to clean up: progress lives in Spark's checkpoint (the offsets), never in Kafka


class DcpDataSource(DataSource):
    """Format ``dcp``. Options: ``bootstrap.servers`` (or ``kafka.bootstrap.servers``), ``topic``,
    ``startingOffsets`` (``earliest`` | ``latest``), ``maxRecordsPerPartitionPerBatch``, ``timeout`` (s), and
    ``kafka.<librdkafka property>`` passed to the consumers (security settings...)."""

    def __init__(self, options: Any) -> None:
        super().__init__(options)
        self.opts = SourceOptions.parse(dict(options))

    @classmethod
    def name(cls) -> str:
        return "dcp"

    def schema(self) -> str:
        return SCHEMA_DDL

    def reader(self, schema: StructType) -> DataSourceReader:
        return DcpBatchReader(self.opts)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return DcpStreamReader(self.opts)
