"""The ``dcp`` source's engine room (connectors/spark/core.py, no Spark) on a topic holding a corrupt record (one
that does not decode: here a record with no headers): planning the micro-batch offsets passes over it, and reading
the range that holds it either fails naming it (``corruptRecords=fail``, the default) or hands it over as a
``corrupt`` row (``corruptRecords=row``) with every other row as on a clean topic."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import Producer

from connectors.spark.core import (
    CORRUPT_OP,
    DcpSourceError,
    PartitionPosition,
    SourceOptions,
    initial_positions,
    replay_ranges,
    scan_boundaries,
)
from gateway.broker import Broker
from tests.harness import Harness, write

PARTITION = 3


@pytest.fixture
def harness(kafka_broker: Broker, tmp_path: Path) -> Iterator[Harness]:
    h = Harness(kafka_broker, tmp_path / "h")
    yield h
    h.close()


def _corrupt_topic(h: Harness) -> int:
    """Writes, one headerless record into partition 3, more writes; the corrupt record's offset."""
    write(h.bucket, 80)
    h.bucket.flush_all()
    h.settle()
    p = Producer({"bootstrap.servers": h.broker.bootstrap_servers})
    delivered: list[int] = []
    p.produce(h.topic, value=b"not a gateway record", key=b"junk", partition=PARTITION,
              on_delivery=lambda err, m: delivered.append(m.offset() or 0))
    p.flush(10)
    write(h.bucket, 80, start=1000)
    h.bucket.flush_all()
    h.settle()
    return delivered[0]


def _opts(h: Harness, **extra: str) -> SourceOptions:
    return SourceOptions.parse({"bootstrap.servers": h.broker.bootstrap_servers, "topic": h.topic, "timeout": "30",
                                **extra})


def _rows(opts: SourceOptions, start: dict[int, PartitionPosition],
          end: dict[int, PartitionPosition]) -> list[tuple[object, ...]]:
    return list(replay_ranges(opts, [(p, start[p], end[p].offset) for p in sorted(end)]))


def test_planning_passes_over_a_corrupt_record_and_reading_fails_or_hands_it_over(harness: Harness) -> None:
    h = harness
    bad = _corrupt_topic(h)
    opts = _opts(h)
    start = initial_positions(opts, h.partitions)
    end = scan_boundaries(opts, start)  # raised RecordFormatError ("record has no headers") before
    assert end[PARTITION].offset > bad  # the boundary is past the corrupt record: the partition's later records
    # the default: the read of the range fails with one clear line naming the record
    with pytest.raises(DcpSourceError, match=rf"corrupt record at {h.topic}\[{PARTITION}\]@{bad}: .*no headers.*"
                                             r"corruptRecords=row"):
        _rows(opts, start, end)
    rows = _rows(_opts(h, corruptRecords="row"), start, end)
    corrupt = [r for r in rows if r[0] == CORRUPT_OP]
    assert len(corrupt) == 1
    _op, key, value, vb, *_rest = corrupt[0]
    assert (key, vb, corrupt[0][10], corrupt[0][11]) == (b"junk", None, PARTITION, bad)
    assert isinstance(value, bytes) and b"no headers" in value
    # every other row is what the topic without the corrupt record gives: every key's changes, complete snapshots
    data = [r for r in rows if r[0] != CORRUPT_OP]
    keys = {r[1] for r in data}
    assert keys == {f"k{i}".encode() for i in (*range(80), *range(1000, 1080))}
    latest: dict[object, str] = {}
    for r in sorted(data, key=lambda r: (r[10], r[11])):
        latest[r[1]] = str(r[0])
    assert latest[b"k1000"] == "deletion" and latest[b"k1001"] == "mutation"


def test_bad_corrupt_records_option_is_refused() -> None:
    with pytest.raises(DcpSourceError, match="corruptRecords must be 'fail' or 'row', got 'skip'"):
        SourceOptions.parse({"bootstrap.servers": "x:1", "topic": "t", "corruptRecords": "skip"})
