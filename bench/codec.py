"""The record codec against fastavro: ``python -m bench.codec [--docs N]``.

Encodes N document changes (keys ``doc-<i>``, ~200-byte JSON bodies, 1024 vbuckets, snapshots of 16 items,
HLC-sized cas values) and the snapshot markers before them with :class:`schemas.codec.RecordEncoder`, then
measures on the very same records:

* ``codec.decode.data`` -- :func:`schemas.codec.decode` of each data record (key, value, headers: the whole
  contract check, its fast path inside) against fastavro's ``schemaless_reader`` of the same Avro bodies;
* ``codec.read_change`` -- the decoder's value-only fast path into a consumer's change tuple, same baseline;
* ``codec.read_control`` -- the same for the snapshot records against ``schemaless_reader`` of their bodies;
* ``codec.encode.data`` -- :meth:`RecordEncoder.data` against fastavro's ``schemaless_writer`` of the same
  records (body only; the encoder also builds the headers).

One JSON line per figure (bench/report.py's keys): records per second, the fastavro figure as the baseline,
``target`` null (information). Best of ``--repeat`` runs each.
"""

from __future__ import annotations

import argparse
import io
import json
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from fastavro import schemaless_reader, schemaless_writer

from bench.report import figure
from engine.dcp.stream import SnapshotFlags, SnapshotMarker
from engine.kv.item import Item, Op
from schemas.codec import (
    CHANGE_EVENT_NAME,
    CONTROL_EVENT_NAME,
    RecordEncoder,
    decode,
    parsed_schema,
    read_change,
    read_control,
)
from schemas.records import KafkaRecord, ValueFormat

NVB = 1024
SNAPSHOT = 16
_I64 = 1 << 63


class _Change(NamedTuple):
    """A consumer's change tuple (as connectors.client.replay.Change)."""

    type: Any
    key: bytes
    value: bytes | None
    vbucket: int
    vbuuid: int
    seqno: int
    rev_seqno: int
    cas: int
    flags: int
    expiry: int
    datatype: int
    offset: int


def _signed(u: int) -> int:
    return u - (1 << 64) if u >= _I64 else u


def _records(n: int) -> tuple[list[Item], list[KafkaRecord], list[KafkaRecord], list[dict[str, Any]]]:
    enc = RecordEncoder(ValueFormat.AVRO)
    items: list[Item] = []
    data: list[KafkaRecord] = []
    control: list[KafkaRecord] = []
    avro: list[dict[str, Any]] = []
    seqnos = [0] * NVB
    cas = 1_721_119_228_263_661_568
    for i in range(n):
        vb = i % NVB
        if seqnos[vb] % SNAPSHOT == 0:
            start = seqnos[vb] + 1
            control.append(enc.snapshot(SnapshotMarker(vb, start, start + SNAPSHOT - 1, SnapshotFlags.MEMORY),
                                        0xABCDEF000000 + vb))
        seqnos[vb] += 1
        seqno = seqnos[vb]
        snap_start = (seqno - 1) // SNAPSHOT * SNAPSHOT + 1
        body = json.dumps({"id": i, "name": f"user {i}", "email": f"user{i}@example.com", "city": "Berlin",
                           "tags": ["a", "b", "c"], "score": i * 7 % 1000, "active": True,
                           "bio": "x" * 60}).encode()
        cas += 4096
        item = Item(f"doc-{i}".encode(), body, vb, seqno, 1, cas, flags=0x02000006, datatype=1, op=Op.MUTATION)
        vbuuid = 0xABCDEF000000 + vb
        items.append(item)
        data.append(enc.data(item, vbuuid, snap_start, snap_start + SNAPSHOT - 1))
        avro.append({"op": "MUTATION", "key": item.key, "value": body, "vbucket": vb, "vbuuid": _signed(vbuuid),
                     "seqno": seqno, "rev_seqno": 1, "cas": _signed(cas), "flags": item.flags, "expiry": 0,
                     "datatype": 1, "snap_start": snap_start, "snap_end": snap_start + SNAPSHOT - 1})
    return items, data, control, avro


def _rate(fn: Callable[[], int], repeat: int) -> float:
    best = 0.0
    for _ in range(repeat):
        t0 = time.perf_counter()
        n = fn()
        dt = time.perf_counter() - t0
        best = max(best, n / dt)
    return best


def _figure(name: str, value: float, baseline: float) -> None:
    figure(name, value, "records/s", baseline, None, "higher")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=50_000, help="document changes to encode and decode")
    ap.add_argument("--repeat", type=int, default=3, help="runs per figure (the best is reported)")
    args = ap.parse_args()
    items, data, control, avro = _records(args.docs)
    change_schema = parsed_schema(CHANGE_EVENT_NAME)
    control_schema = parsed_schema(CONTROL_EVENT_NAME)
    bodies = [bytes(r.value or b"")[10:] for r in data]
    control_values = [r.value or b"" for r in control]
    control_bodies = [v[10:] for v in control_values]
    parts = [(r.key, r.value, [(k, v) for k, v in r.headers]) for r in data]

    def fastavro_read(values: list[bytes], schema: dict[str, Any]) -> Callable[[], int]:
        def run() -> int:
            for b in values:
                schemaless_reader(io.BytesIO(b), schema, None)
            return len(values)
        return run

    def run_decode() -> int:
        for k, v, h in parts:
            decode(k, v, h)
        return len(parts)

    def run_read_change() -> int:
        for i, r in enumerate(data):
            assert r.value is not None
            read_change(r.value, i, _Change)
        return len(data)

    def run_read_control() -> int:
        for v in control_values:
            read_control(v)
        return len(control_values)

    enc = RecordEncoder(ValueFormat.AVRO)

    def run_encode() -> int:
        for item, r in zip(items, avro, strict=True):
            enc.data(item, 0xABCDEF000000 + item.vbucket, r["snap_start"], r["snap_end"])
        return len(items)

    def run_fastavro_write() -> int:
        for r in avro:
            schemaless_writer(io.BytesIO(), change_schema, r)
        return len(avro)

    read_base = _rate(fastavro_read(bodies, change_schema), args.repeat)
    _figure("codec.decode.data", _rate(run_decode, args.repeat), read_base)
    _figure("codec.read_change", _rate(run_read_change, args.repeat), read_base)
    _figure("codec.read_control", _rate(run_read_control, args.repeat),
            _rate(fastavro_read(control_bodies, control_schema), args.repeat))
    _figure("codec.encode.data", _rate(run_encode, args.repeat), _rate(run_fastavro_write, args.repeat))


if __name__ == "__main__":
    main()
