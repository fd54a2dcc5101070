"""The consumers' hot path: ``schemas.codec.read_change`` decodes a ChangeEvent value straight into the
client's :class:`~connectors.client.replay.Change`, ``read_control`` a ControlEvent value into a
``DecodedRecord``. Each must read exactly what the full, header-checking ``decode`` reads, and on corrupt input
return None or exactly what fastavro reads (never a wrong record)."""

from __future__ import annotations

import io

from fastavro import schemaless_reader
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from connectors.client.replay import Change
from engine.dcp.stream import SnapshotFlags, SnapshotMarker, StreamEnd, StreamEndReason
from engine.kv.item import Item, Op
from schemas.codec import (
    CHANGE_EVENT_NAME,
    CONTROL_EVENT_FINGERPRINT,
    CONTROL_EVENT_NAME,
    SINGLE_OBJECT_MARKER,
    RecordEncoder,
    decode,
    parsed_schema,
    read_change,
    read_change_value,
    read_control,
)
from schemas.failover_log import FailoverEntry
from schemas.records import KafkaRecord, RecordType, ValueFormat

CHANGE_EVENT_SCHEMA = parsed_schema(CHANGE_EVENT_NAME)
CONTROL_EVENT_SCHEMA = parsed_schema(CONTROL_EVENT_NAME)

U64 = 2**64 - 1
#: small (table) values, 15..32-bit values (the general path), any u64 (negative Avro longs: odd zigzag), edges
u64s = st.one_of(st.integers(0, 300), st.integers(2**14, 2**32), st.integers(0, U64),
                 st.sampled_from([2**63 - 1, 2**63, U64]))
#: HLC-like cas values (9-byte varints, the table path) and any other
cases = st.one_of(st.integers(2**60, 2**62), u64s)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    key=st.binary(min_size=1, max_size=200),  # one- and two-byte key lengths
    value=st.one_of(st.none(), st.binary(max_size=3000)),
    vbucket=st.integers(0, 0xFFFF),
    seqno=u64s, rev=u64s, cas=cases, vbuuid=u64s, snap_start=u64s, snap_end=u64s,
    flags=st.integers(0, 2**32 - 1), expiry=st.integers(0, 2**32 - 1), datatype=st.integers(0, 7),
    op=st.sampled_from([Op.MUTATION, Op.DELETION, Op.EXPIRATION]),
    offset=st.integers(0, 2**63 - 1),
)
def test_read_change_reads_what_decode_reads(
    key: bytes, value: bytes | None, vbucket: int, seqno: int, rev: int, cas: int, vbuuid: int, snap_start: int,
    snap_end: int, flags: int, expiry: int, datatype: int, op: Op, offset: int,
) -> None:
    item = Item(key, value, vbucket, seqno, rev, cas, flags, expiry, datatype, op)
    rec = RecordEncoder().data(item, vbuuid, snap_start, snap_end)
    assert rec.value is not None
    d = decode(rec.key, rec.value, rec.headers)
    for _ in range(2):  # the second read hits the caches the first one filled
        ch = read_change(rec.value, offset, Change)
        assert type(ch) is Change
        assert ch == Change(d.type, d.key or b"", d.value, d.vbucket, d.vbuuid, d.seqno, d.rev_seqno or 0,
                            d.cas or 0, d.flags or 0, d.expiry or 0, d.datatype or 0, offset)
        assert ch.offset == offset and ch.seqno == seqno and ch.cas == cas
    assert ch is not None
    assert read_change_value(rec.value) == (*ch[:11], snap_start, snap_end)


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_corrupt_values_read_as_none_or_as_fastavro_reads_them(data: st.DataObject) -> None:
    item = Item(data.draw(st.binary(min_size=1, max_size=100)), data.draw(st.binary(max_size=300)),
                data.draw(st.integers(0, 1023)), data.draw(u64s), data.draw(u64s), data.draw(cases))
    rec = RecordEncoder().data(item, data.draw(u64s), 40, 45)
    read_change(rec.value or b"", 0, Change)  # fill the caches with the good record's groups first
    value = bytearray(rec.value or b"")
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(value) - 1))
        value[i] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        del value[data.draw(st.integers(0, len(value) - 1)):]  # truncated
    got = read_change(bytes(value), 7, Change)
    if got is None:
        return
    buf = io.BytesIO(bytes(value[10:]))
    d = schemaless_reader(buf, CHANGE_EVENT_SCHEMA, None)
    assert isinstance(d, dict)  # a record schema: fastavro reads a dict
    assert buf.tell() == len(value) - 10  # every byte read: nothing may follow the record
    assert got[1:] == (d["key"], d["value"], d["vbucket"], d["vbuuid"] & U64, d["seqno"] & U64,
                       d["rev_seqno"] & U64, d["cas"] & U64, d["flags"] & U64, d["expiry"] & U64, d["datatype"], 7)
    assert got.type.name == d["op"]


def test_not_a_change_event_reads_as_none() -> None:
    enc = RecordEncoder()
    rec = enc.data(Item(b"k" * 70, b"v", 3, 5, 1, 1 << 61), 9, 5, 5)  # a two-byte key length
    v = rec.value
    assert v is not None and read_change(v, 0, Change) is not None
    control = enc.snapshot(SnapshotMarker(7, 40, 45, SnapshotFlags.MEMORY), 5).value
    assert control is not None
    for what, bad in {
        "empty": b"", "short": v[:11], "raw JSON": b'{"a": 1}', "control record": control,
        "odd key length": v[:11] + bytes([v[11] | 1]) + v[12:], "unknown op": v[:10] + b"\x06" + v[11:],
        "trailing byte": v + b"\x00", "truncated tail": v[:-3],
    }.items():
        assert read_change(bad, 0, Change) is None, what


# ------------------------------------------------------------------------- control records: read_control
def _control(data: st.DataObject) -> KafkaRecord:
    enc = RecordEncoder()
    vb = data.draw(st.integers(0, 0xFFFF))
    log = tuple(FailoverEntry(data.draw(u64s), data.draw(u64s)) for _ in range(data.draw(st.integers(1, 4))))
    kind = data.draw(st.sampled_from(["snapshot", "failover-log", "rollback", "stream-end"]))
    if kind == "snapshot":
        start = data.draw(u64s)
        flags = SnapshotFlags(data.draw(st.integers(0, 0x3F)))
        return enc.snapshot(SnapshotMarker(vb, start, max(start, data.draw(u64s)), flags), data.draw(u64s))
    if kind == "failover-log":
        return enc.failover_log(vb, log, data.draw(u64s), data.draw(u64s), data.draw(u64s))
    if kind == "rollback":
        return enc.rollback(vb, data.draw(u64s), log, snap_start=data.draw(u64s), snap_end=data.draw(u64s))
    return enc.stream_end(StreamEnd(vb, data.draw(st.sampled_from(list(StreamEndReason)))), data.draw(u64s),
                          data.draw(u64s), data.draw(u64s), data.draw(u64s))


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_read_control_reads_what_decode_reads(data: st.DataObject) -> None:
    rec = _control(data)
    assert rec.value is not None
    d = decode(rec.key, rec.value, rec.headers)
    for _ in range(2):  # the second read hits the vbuuid cache the first one filled
        assert read_control(rec.value) == d


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_corrupt_control_values_read_as_none_or_as_fastavro_reads_them(data: st.DataObject) -> None:
    """A corrupt control value is never read as something else: either None (the consumer then runs the full
    decoder, which raises and dead-letters it) or exactly what fastavro reads from those bytes."""
    rec = _control(data)
    read_control(rec.value or b"")  # fill the cache with the good record's vbuuid first
    value = bytearray(rec.value or b"")
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(value) - 1))
        value[i] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        del value[data.draw(st.integers(0, len(value) - 1)):]  # truncated
    got = read_control(bytes(value))
    if got is None:
        return
    assert bytes(value[:10]) == SINGLE_OBJECT_MARKER + CONTROL_EVENT_FINGERPRINT
    buf = io.BytesIO(bytes(value[10:]))
    d = schemaless_reader(buf, CONTROL_EVENT_SCHEMA, None)
    assert isinstance(d, dict)  # a record schema: fastavro reads a dict
    assert buf.tell() == len(value) - 10  # every byte read: nothing may follow the record
    assert (got.vbucket, got.vbuuid, got.seqno, got.snap_start, got.snap_end) == (
        d["vbucket"], d["vbuuid"] & U64, d["seqno"] & U64, d["snap_start"] & U64, d["snap_end"] & U64)
    assert got.type.value.upper().replace("-", "_") == d["type"]
    log = tuple(FailoverEntry(e["vbuuid"] & U64, e["seqno"] & U64) for e in d["failover_log"])
    assert got.failover_log in (None, log)
    if got.failover_log is not None:
        assert log and log[0].vbuuid == got.vbuuid
    if got.type is RecordType.ROLLBACK:
        assert d["rollback_seqno"] is not None and d["rollback_seqno"] & U64 == got.seqno == got.rollback_seqno
    if got.type is RecordType.SNAPSHOT:
        assert got.snapshot_flags == d["snapshot_flags"] and got.snap_start == got.seqno
    if got.type is RecordType.STREAM_END:
        assert got.stream_end_reason == d["stream_end_reason"] is not None


def test_not_a_well_formed_control_value_reads_as_none() -> None:
    enc = RecordEncoder()
    v = enc.failover_log(7, (FailoverEntry(5, 10), FailoverEntry(4, 0)), 12, 10, 12).value
    assert v is not None and read_control(v) is not None
    data = enc.data(Item(b"k", b"v", 3, 5, 1, 1 << 61), 9, 5, 5).value
    raw = RecordEncoder(ValueFormat.RAW).snapshot(SnapshotMarker(7, 40, 45, SnapshotFlags.MEMORY), 5).value
    for what, bad in {
        "empty": b"", "short": v[:11], "data record": data, "raw JSON": raw, "trailing byte": v + b"\x00",
        "truncated": v[:-1], "cut varint": v[:-1] + b"\x80", "unknown type": v[:10] + b"\x08" + v[11:],
        # the first failover entry's vbuuid (its first byte follows count 2 = b"\x04") must be the record's
        "log vbuuid differs": v.replace(b"\x04\x0a", b"\x04\x0c", 1),
    }.items():
        assert read_control(bad or b"") is None, what
