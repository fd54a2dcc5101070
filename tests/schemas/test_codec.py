"""The Kafka record format (schemas/codec.py, docs/record-format.md): encoding, decoding, validation."""

from __future__ import annotations

import io
import json
from dataclasses import replace
from typing import Any

import pytest
from fastavro import parse_schema, schemaless_reader, schemaless_writer
from fastavro.schema import fingerprint as fastavro_fingerprint
from fastavro.schema import to_parsing_canonical_form
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import FailoverEntry, Item, Op, SnapshotFlags, SnapshotMarker, StreamEnd, StreamEndReason
from engine.kv.item import DATA_OPS
from schemas.codec import (
    CHANGE_EVENT_FINGERPRINT,
    CHANGE_EVENT_NAME,
    CONTROL_EVENT_FINGERPRINT,
    CONTROL_EVENT_NAME,
    OVERSIZE_EVENT_FINGERPRINT,
    OVERSIZE_EVENT_NAME,
    SCHEMA_FINGERPRINTS,
    RecordEncoder,
    crc64_avro,
    decode,
    parsed_schema,
    read_change,
    read_change_value,
    read_control,
    schema_fingerprint,
    schemas_dir,
    single_object_decode,
    single_object_encode,
)
from schemas.errors import InvalidArgument, RecordFormatError, UnknownSchemaError
from schemas.headers import COMMON_HEADERS, DATA_HEADERS
from schemas.records import DecodedRecord, KafkaRecord, RecordType, ValueFormat
from schemas.topics import partition_for, topic_name

CHANGE_EVENT_SCHEMA = parsed_schema(CHANGE_EVENT_NAME)
CONTROL_EVENT_SCHEMA = parsed_schema(CONTROL_EVENT_NAME)

U64 = (1 << 64) - 1
FORMATS = [ValueFormat.AVRO, ValueFormat.RAW]
BIG = 2**63 + 12345  # above the signed range: stored as a negative Avro long

# Avro specification test vectors (share/test/data/schema-tests.txt of apache/avro): canonical form and
# CRC-64-AVRO fingerprint as a signed 64-bit integer.
AVRO_SPEC_VECTORS = [
    ('"null"', 7195948357588979594),
    ('"boolean"', -6970731678124411036),
    ('"int"', 8247732601305521295),
    ('"long"', -3434872931120570953),
    ('"bytes"', 5746618253357095269),
    ('"string"', -8142146995180207161),
    ("[]", -1241056759729112623),
    ('["int","boolean"]', 5392556393470105090),
    ('{"name":"foo","type":"record","fields":[]}', -4824392279771201922),
    ('{"name":"x.y.foo","type":"record","fields":[]}', 5916914534497305771),
    ('{"name":"foo","type":"record","fields":[{"name":"f1","type":"boolean"}]}', 7843277075252814651),
    ('{"name":"x.y.z.foo","type":"enum","symbols":["A1","A2"]}', -4448647247586288245),
    ('{"type":"array","items":"null"}', -589620603366471059),
    ('{"type":"map","values":"string"}', -8732877298790414990),
    (
        '{"name":"PigValue","type":"record","fields":[{"name":"value","type":["null","int","long","PigValue"]}]}',
        -1759257747318642341,
    ),
]


def headers_of(rec: KafkaRecord) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for name, value in rec.headers:
        assert name not in out, f"duplicate header {name}"
        assert isinstance(value, bytes)
        out[name] = value
    return out


def mutation(**kw: Any) -> Item:
    args: dict[str, Any] = dict(
        key=b"doc-1", value=b'{"name":"x"}', vbucket=7, seqno=42, rev_seqno=3, cas=1_700_000_000_123_456_789,
        flags=0xDEADBEEF, expiry=1_900_000_000, datatype=1, op=Op.MUTATION,
    )
    args.update(kw)
    return Item(**args)


LOG = [FailoverEntry(0xABCDEF123456, 40), FailoverEntry(BIG, 10), FailoverEntry(99, 0)]


# ---------------------------------------------------------------------------------------------- topic / partition
def test_topic_name() -> None:
    assert topic_name("dcp", "travel-sample") == "dcp.travel-sample"
    assert topic_name("cdc_1", "b.x") == "cdc_1.b.x"
    for prefix, bucket in [("", "b"), ("dcp", ""), ("dcp", "a b"), ("dcp", "x/y"), ("dcp", "é"), ("d", "b" * 300)]:
        with pytest.raises(InvalidArgument):
            topic_name(prefix, bucket)


def test_partition_for() -> None:
    assert [partition_for(v, 1024) for v in (0, 1, 1023)] == [0, 1, 1023]
    assert [partition_for(v, 64) for v in (0, 63, 64, 1023)] == [0, 63, 0, 63]
    assert partition_for(5, 1) == 0
    with pytest.raises(InvalidArgument):
        partition_for(1, 0)
    with pytest.raises(InvalidArgument):
        partition_for(-1, 4)


# ---------------------------------------------------------------------------------------------- schemas
def test_schema_files_and_names() -> None:
    d = schemas_dir()
    change = json.loads((d / "change_event.avsc").read_text())
    control = json.loads((d / "control_event.avsc").read_text())
    assert (change["namespace"], change["name"]) == ("com.dcpgateway", "ChangeEvent")
    assert (control["namespace"], control["name"]) == ("com.dcpgateway", "ControlEvent")
    assert [f["name"] for f in change["fields"]] == [
        "op", "key", "value", "vbucket", "vbuuid", "seqno", "rev_seqno", "cas", "flags", "expiry", "datatype",
        "snap_start", "snap_end",
    ]
    assert [f["name"] for f in control["fields"]] == [
        "type", "vbucket", "vbuuid", "seqno", "snap_start", "snap_end", "snapshot_flags", "failover_log",
        "rollback_seqno", "stream_end_reason",
    ]
    assert SCHEMA_FINGERPRINTS == {
        CHANGE_EVENT_FINGERPRINT: CHANGE_EVENT_NAME,
        CONTROL_EVENT_FINGERPRINT: CONTROL_EVENT_NAME,
        OVERSIZE_EVENT_FINGERPRINT: OVERSIZE_EVENT_NAME,
    }
    oversize = json.loads((d / "oversize_event.avsc").read_text())
    assert (oversize["namespace"], oversize["name"]) == ("com.dcpgateway", "OversizeEvent")
    # docs/record-format.md publishes it
    assert OVERSIZE_EVENT_FINGERPRINT.hex() == "f0a6b337b042ac48"
    assert CHANGE_EVENT_NAME == "com.dcpgateway.ChangeEvent"
    assert CONTROL_EVENT_NAME == "com.dcpgateway.ControlEvent"


@pytest.mark.parametrize(("canonical", "signed_fp"), AVRO_SPEC_VECTORS)
def test_crc64_avro_matches_the_avro_spec_vectors(canonical: str, signed_fp: int) -> None:
    assert crc64_avro(canonical.encode()) == signed_fp & U64
    # fastavro's CRC-64-AVRO is the little-endian hex of the same number
    assert fastavro_fingerprint(canonical, "CRC-64-AVRO") == (signed_fp & U64).to_bytes(8, "little").hex()


def test_single_object_header_of_the_spec_example() -> None:
    # Avro spec / Ruby test: the single-object header of schema "int" is C3 01 8F 5C 39 3F 1A D5 75 72.
    assert single_object_encode("int", 0)[:10] == bytes.fromhex("c3018f5c393f1ad57572")  # type: ignore[arg-type]


@pytest.mark.parametrize("schema", [CHANGE_EVENT_SCHEMA, CONTROL_EVENT_SCHEMA])
def test_fingerprints_are_crc64_avro_of_the_canonical_form(schema: dict[str, Any]) -> None:
    name = schema["name"]
    raw = json.loads((schemas_dir() / ("change_event.avsc" if "Change" in name else "control_event.avsc")).read_text())
    canonical = to_parsing_canonical_form(raw)
    fp = schema_fingerprint(raw)
    assert fp == schema_fingerprint(schema) == crc64_avro(canonical.encode()).to_bytes(8, "little")
    assert fp.hex() == fastavro_fingerprint(canonical, "CRC-64-AVRO")
    # docs/record-format.md publishes these values: changing a schema changes them (and the docs).
    assert {CHANGE_EVENT_FINGERPRINT.hex(), CONTROL_EVENT_FINGERPRINT.hex()} == {
        "2935570acc1b6139", "1d493d2ed6162990",
    }


# ---------------------------------------------------------------------------------------------- round trips
def check_common(rec: KafkaRecord, fmt: ValueFormat, rtype: RecordType) -> dict[str, bytes]:
    h = headers_of(rec)
    assert h["dcp.type"] == rtype.value.encode()
    assert h["dcp.format"] == fmt.value.encode()
    for name in COMMON_HEADERS:
        assert name in h
        if name not in ("dcp.type", "dcp.format"):
            assert h[name].isdigit(), (name, h[name])
    if fmt is ValueFormat.AVRO:
        assert rec.value is not None and rec.value[:2] == b"\xc3\x01"
    return h


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("op", list(DATA_OPS))
def test_data_round_trip(fmt: ValueFormat, op: Op) -> None:
    enc = RecordEncoder(fmt)
    item = mutation(op=op, value=b'{"name":"x"}' if op is Op.MUTATION else b"xattr-or-nothing")
    rec = enc.data(item, BIG, 40, 45)
    rtype = RecordType(op.name.lower())
    h = check_common(rec, fmt, rtype)
    assert set(DATA_HEADERS) <= h.keys()
    assert rec.key == b"doc-1"
    assert h["dcp.vbucket"] == b"7" and h["dcp.vbuuid"] == str(BIG).encode() and h["dcp.seqno"] == b"42"
    assert (h["dcp.snap.start"], h["dcp.snap.end"]) == (b"40", b"45")
    assert (h["dcp.rev"], h["dcp.cas"], h["dcp.flags"]) == (b"3", b"1700000000123456789", str(0xDEADBEEF).encode())
    assert (h["dcp.expiry"], h["dcp.datatype"]) == (b"1900000000", b"1")
    if fmt is ValueFormat.AVRO:
        assert rec.value is not None and rec.value[2:10] == CHANGE_EVENT_FINGERPRINT
    else:
        assert rec.value == (b'{"name":"x"}' if op is Op.MUTATION else None)
    d = decode(rec.key, rec.value, rec.headers)
    assert d == DecodedRecord(
        type=rtype, vbucket=7, vbuuid=BIG, seqno=42, snap_start=40, snap_end=45, key=b"doc-1",
        value=b'{"name":"x"}' if op is Op.MUTATION else None, rev_seqno=3, cas=1_700_000_000_123_456_789,
        flags=0xDEADBEEF, expiry=1_900_000_000, datatype=1, snapshot_flags=None, failover_log=None,
        rollback_seqno=None, stream_end_reason=None, value_format=fmt,
    )
    assert d.is_data and not d.is_control and d.op is op


@pytest.mark.parametrize("fmt", FORMATS)
def test_snapshot_round_trip(fmt: ValueFormat) -> None:
    flags = SnapshotFlags.DISK | SnapshotFlags.CHK
    rec = RecordEncoder(fmt).snapshot(SnapshotMarker(3, 101, 250, flags), BIG)
    h = check_common(rec, fmt, RecordType.SNAPSHOT)
    assert rec.key is None
    assert (h["dcp.seqno"], h["dcp.snap.start"], h["dcp.snap.end"]) == (b"101", b"101", b"250")
    d = decode(rec.key, rec.value, rec.headers)
    assert (d.type, d.vbucket, d.vbuuid, d.seqno, d.snap_start, d.snap_end) == (
        RecordType.SNAPSHOT, 3, BIG, 101, 101, 250,
    )
    assert d.snapshot_flags == 0x06 and d.snapshot_flag_names == ["DISK", "CHK"]
    assert d.key is None and d.value is None and d.failover_log is None and d.rev_seqno is None
    assert d.is_control and not d.is_data and d.op is None and d.value_format is fmt


@pytest.mark.parametrize("fmt", FORMATS)
def test_failover_log_round_trip(fmt: ValueFormat) -> None:
    rec = RecordEncoder(fmt).failover_log(3, LOG, 44, 40, 45)
    h = check_common(rec, fmt, RecordType.FAILOVER_LOG)
    assert h["dcp.vbuuid"] == str(LOG[0].vbuuid).encode() and h["dcp.seqno"] == b"44"
    d = decode(rec.key, rec.value, rec.headers)
    assert (d.type, d.vbuuid, d.seqno, d.snap_start, d.snap_end) == (RecordType.FAILOVER_LOG, LOG[0].vbuuid, 44, 40, 45)
    assert d.failover_log == tuple(LOG)
    assert d.rollback_seqno is None and d.stream_end_reason is None and d.snapshot_flags is None


@pytest.mark.parametrize("fmt", FORMATS)
def test_rollback_round_trip(fmt: ValueFormat) -> None:
    enc = RecordEncoder(fmt)
    new_log = [FailoverEntry(BIG + 1, 30), *LOG[1:]]
    d = decode(*_parts(enc.rollback(3, 30, new_log)))
    assert (d.type, d.vbuuid, d.seqno, d.rollback_seqno) == (RecordType.ROLLBACK, BIG + 1, 30, 30)
    assert (d.snap_start, d.snap_end) == (30, 30)  # default restart point: the rollback seqno
    assert d.failover_log == tuple(new_log)
    d = decode(*_parts(enc.rollback(3, 30, new_log, snap_start=20, snap_end=20)))
    assert (d.seqno, d.snap_start, d.snap_end, d.rollback_seqno) == (30, 20, 20, 30)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("reason", list(StreamEndReason))
def test_stream_end_round_trip(fmt: ValueFormat, reason: StreamEndReason) -> None:
    rec = RecordEncoder(fmt).stream_end(StreamEnd(9, reason), 77, 45, 40, 45)
    check_common(rec, fmt, RecordType.STREAM_END)
    d = decode(rec.key, rec.value, rec.headers)
    assert (d.type, d.vbucket, d.vbuuid, d.seqno, d.snap_start, d.snap_end) == (RecordType.STREAM_END, 9, 77, 45, 40, 45)
    assert d.stream_end_reason == int(reason) and d.stream_end_reason_name == reason.name


def test_raw_control_value_is_compact_json_with_the_schema_fields() -> None:
    enc = RecordEncoder(ValueFormat.RAW)
    rec = enc.failover_log(3, LOG, 44, 40, 45)
    assert rec.value is not None and b" " not in rec.value
    doc = json.loads(rec.value)
    assert doc == {
        "type": "FAILOVER_LOG", "vbucket": 3, "vbuuid": LOG[0].vbuuid, "seqno": 44, "snap_start": 40,
        "snap_end": 45, "snapshot_flags": 0,
        "failover_log": [{"vbuuid": e.vbuuid, "seqno": e.seqno} for e in LOG],
        "rollback_seqno": None, "stream_end_reason": None,
    }
    assert doc["failover_log"][1]["vbuuid"] == BIG  # u64 as a plain JSON integer
    control_fields = [f["name"] for f in json.loads((schemas_dir() / "control_event.avsc").read_text())["fields"]]
    assert list(doc) == control_fields


def test_avro_values_read_with_fastavro_and_the_published_schemas() -> None:
    """A consumer with only schemas/*.avsc and a generic Avro library reads the values."""
    enc = RecordEncoder()
    rec = enc.data(mutation(cas=U64, rev_seqno=BIG), U64 - 1, 0, 2**64 - 2)
    schemas = {schema_fingerprint(s): parse_schema(s) for s in (
        json.loads((schemas_dir() / n).read_text()) for n in ("change_event.avsc", "control_event.avsc"))}
    assert rec.value is not None
    body = schemaless_reader(io.BytesIO(rec.value[10:]), schemas[rec.value[2:10]], None)
    assert isinstance(body, dict)
    assert body["op"] == "MUTATION" and body["key"] == b"doc-1" and body["value"] == b'{"name":"x"}'
    assert body["cas"] == -1 and body["cas"] & U64 == U64  # u64 as two's complement
    assert body["vbuuid"] & U64 == U64 - 1 and body["rev_seqno"] & U64 == BIG
    assert body["snap_end"] & U64 == 2**64 - 2


@pytest.mark.parametrize("fmt", FORMATS)
def test_u64_above_2_63_round_trip(fmt: ValueFormat) -> None:
    enc = RecordEncoder(fmt)
    for v in (2**63 - 1, 2**63, BIG, U64 - 1, U64):
        d = decode(*_parts(enc.data(mutation(cas=v, rev_seqno=v, seqno=v), v, v, v)))
        assert (d.vbuuid, d.cas, d.rev_seqno, d.seqno, d.snap_start, d.snap_end) == (v, v, v, v, v, v)
        d = decode(*_parts(enc.failover_log(1, [FailoverEntry(v, v)], v, v, v)))
        assert d.vbuuid == v and d.failover_log == (FailoverEntry(v, v),)
        d = decode(*_parts(enc.rollback(1, v, [FailoverEntry(v, v)])))
        assert d.rollback_seqno == v


def _parts(rec: KafkaRecord) -> tuple[bytes | None, bytes | None, list[tuple[str, str | bytes | None]]]:
    return rec.key, rec.value, rec.headers


def avro_record(item: Item, vbuuid: int, snap_start: int, snap_end: int) -> dict[str, Any]:
    def s(u: int) -> int:
        return u - 2**64 if u >= 2**63 else u

    return {
        "op": item.op.name, "key": item.key, "value": item.value if item.op is Op.MUTATION else None,
        "vbucket": item.vbucket, "vbuuid": s(vbuuid), "seqno": s(item.seqno), "rev_seqno": s(item.rev_seqno),
        "cas": s(item.cas), "flags": item.flags, "expiry": item.expiry, "datatype": item.datatype,
        "snap_start": s(snap_start), "snap_end": s(snap_end),
    }


u64s = st.one_of(st.integers(0, 300), st.integers(0, 2**32), st.integers(0, U64), st.sampled_from([2**63, U64]))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    key=st.binary(min_size=1, max_size=300),
    value=st.one_of(st.none(), st.binary(max_size=20_000)),
    vbucket=st.integers(0, 0xFFFF),
    seqno=u64s, rev=u64s, cas=u64s, vbuuid=u64s, snap_start=u64s, snap_end=u64s,
    flags=st.integers(0, 2**32 - 1), expiry=st.integers(0, 2**32 - 1), datatype=st.integers(0, 7),
    op=st.sampled_from(list(DATA_OPS)),
)
def test_hand_rolled_avro_equals_fastavro(
    key: bytes, value: bytes | None, vbucket: int, seqno: int, rev: int, cas: int, vbuuid: int, snap_start: int,
    snap_end: int, flags: int, expiry: int, datatype: int, op: Op,
) -> None:
    """The hot-path encoder writes exactly what fastavro's writer writes (and fastavro reads it back)."""
    item = Item(key, value, vbucket, seqno, rev, cas, flags, expiry, datatype, op)
    rec = RecordEncoder().data(item, vbuuid, snap_start, snap_end)
    buf = io.BytesIO()
    schemaless_writer(buf, CHANGE_EVENT_SCHEMA, avro_record(item, vbuuid, snap_start, snap_end))
    assert rec.value == b"\xc3\x01" + CHANGE_EVENT_FINGERPRINT + buf.getvalue()
    d = decode(*_parts(rec))
    assert (d.key, d.seqno, d.rev_seqno, d.cas, d.vbuuid, d.snap_start, d.snap_end) == (
        key, seqno, rev, cas, vbuuid, snap_start, snap_end,
    )
    assert d.value == (value if op is Op.MUTATION else None)
    raw = decode(*_parts(RecordEncoder(ValueFormat.RAW).data(item, vbuuid, snap_start, snap_end)))
    assert replace(raw, value_format=ValueFormat.AVRO) == d
    # the consumers' value-only reader reads exactly what decode() reads
    assert read_change_value(rec.value) == (d.type, d.key, d.value, d.vbucket, d.vbuuid, d.seqno, d.rev_seqno,
                                            d.cas, d.flags, d.expiry, d.datatype, d.snap_start, d.snap_end)



@settings(max_examples=200, deadline=None)
@given(base=u64s, deltas=st.lists(st.one_of(st.integers(0, 2**14), st.integers(0, 2**30), st.integers(0, U64)),
                                  min_size=1, max_size=20))
def test_one_encoder_equals_fastavro_over_a_sequence_of_cas_values(base: int, deltas: list[int]) -> None:
    """RecordEncoder.data_fields remembers the varint of the CAS above its low 28 bits from one record to the next
    (close CAS values share it): one encoder over a sequence of CAS values, near and far apart, writes exactly
    what fastavro writes for each, and data() is data_fields() as a KafkaRecord."""
    enc = RecordEncoder()
    cas = base
    for d in deltas:
        cas = (cas + d) % (U64 + 1)
        item = Item(b"k", b"v", 3, 7, 1, cas)
        rec = enc.data(item, 5, 1, 9)
        buf = io.BytesIO()
        schemaless_writer(buf, CHANGE_EVENT_SCHEMA, avro_record(item, 5, 1, 9))
        assert rec.value == b"\xc3\x01" + CHANGE_EVENT_FINGERPRINT + buf.getvalue()
        assert enc.data_fields(item, 5, 1, 9) == (rec.key, rec.value, rec.headers)


def test_read_change_value_rejects_what_is_not_a_well_formed_change_event() -> None:
    enc = RecordEncoder()
    rec = enc.data(mutation(), 5, 40, 45)
    v = rec.value
    assert v is not None and read_change_value(v) is not None
    control = enc.snapshot(SnapshotMarker(7, 40, 45, SnapshotFlags.MEMORY), 5).value
    assert control is not None
    bad = {
        "control record": control,
        "empty": b"",
        "truncated": v[:-1],
        "trailing byte": v + b"\x00",
        "unknown op": v[:10] + b"\x06" + v[11:],
        "negative key length": v[:11] + b"\x01" + v[12:],
        "bad union branch": v[:12 + len(rec.key or b"")] + b"\x04" + v[13 + len(rec.key or b""):],
        "raw value": b"not avro",
    }
    big = io.BytesIO()
    schemaless_writer(big, CHANGE_EVENT_SCHEMA, {**avro_record(mutation(), 5, 40, 45), "vbucket": 70_000})
    bad["vbucket above u16"] = b"\xc3\x01" + CHANGE_EVENT_FINGERPRINT + big.getvalue()
    for what, value in bad.items():
        assert read_change_value(value) is None, what


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_read_change_value_accepts_only_what_fastavro_reads_the_same(data: st.DataObject) -> None:
    """On arbitrary corruption the fast reader returns None, or exactly the ChangeEvent fastavro reads (every
    byte consumed)."""
    rec = RecordEncoder().data(Item(data.draw(st.binary(min_size=1, max_size=100)),
                                    data.draw(st.binary(max_size=300)), data.draw(st.integers(0, 1023)),
                                    data.draw(u64s), data.draw(u64s), data.draw(u64s)), data.draw(u64s), 40, 45)
    value = bytearray(rec.value or b"")
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(value) - 1))
        value[i] = data.draw(st.integers(0, 255))
    got = read_change_value(bytes(value))
    if got is None:
        return
    buf = io.BytesIO(bytes(value[10:]))
    d = schemaless_reader(buf, CHANGE_EVENT_SCHEMA, None)
    assert isinstance(d, dict)  # a record schema: fastavro reads a dict
    assert buf.tell() == len(value) - 10
    m = 2**64 - 1
    assert got[1:] == (d["key"], d["value"], d["vbucket"], d["vbuuid"] & m, d["seqno"] & m, d["rev_seqno"] & m,
                       d["cas"] & m, d["flags"] & m, d["expiry"] & m, d["datatype"], d["snap_start"] & m,
                       d["snap_end"] & m)
    assert got[0].name == d["op"]


def test_single_object_encode_decode_generic() -> None:
    rec = {"type": "SNAPSHOT", "vbucket": 1, "vbuuid": -1, "seqno": 5, "snap_start": 5, "snap_end": 9,
           "snapshot_flags": 1, "failover_log": [], "rollback_seqno": None, "stream_end_reason": None}
    data = single_object_encode(CONTROL_EVENT_SCHEMA, rec)
    assert data[:10] == b"\xc3\x01" + CONTROL_EVENT_FINGERPRINT
    assert single_object_decode(data) == (CONTROL_EVENT_NAME, rec)
    # another schema encodes fine but is not one of ours
    other = {"type": "record", "name": "Other", "fields": [{"name": "x", "type": "long"}]}
    data = single_object_encode(other, {"x": 5})
    assert data[2:10] == schema_fingerprint(other)
    with pytest.raises(UnknownSchemaError) as e:
        single_object_decode(data)
    assert data[2:10].hex() in str(e.value) and e.value.fingerprint == data[2:10]


# ---------------------------------------------------------------------------------------------- errors
def test_unknown_fingerprint_raises_unknown_schema_error() -> None:
    rec = RecordEncoder().data(mutation(), 5, 40, 45)
    assert rec.value is not None
    bad = rec.value[:2] + bytes(8) + rec.value[10:]
    with pytest.raises(UnknownSchemaError, match="0000000000000000"):
        decode(rec.key, bad, rec.headers)
    assert issubclass(UnknownSchemaError, RecordFormatError)


@pytest.mark.parametrize("fmt", FORMATS)
def test_truncated_values_raise_record_format_error(fmt: ValueFormat) -> None:
    enc = RecordEncoder(fmt)
    records = [
        enc.data(mutation(), 5, 40, 45),
        enc.snapshot(SnapshotMarker(7, 40, 45, SnapshotFlags.MEMORY), 5),
        enc.failover_log(7, LOG, 45, 40, 45),
        enc.rollback(7, 30, LOG[1:]),
        enc.stream_end(StreamEnd(7, StreamEndReason.OK), 5, 45, 40, 45),
    ]
    for rec in records:
        assert rec.value is not None
        if fmt is ValueFormat.RAW and rec.key is not None:
            continue  # a raw document body has no structure to truncate
        for n in range(len(rec.value)):
            with pytest.raises(RecordFormatError):
                decode(rec.key, rec.value[:n], rec.headers)
        with pytest.raises(RecordFormatError):
            decode(rec.key, rec.value + b"\x00", rec.headers)  # trailing bytes / not JSON


def test_corrupt_avro_raises_record_format_error() -> None:
    rec = RecordEncoder().data(mutation(), 5, 40, 45)
    assert rec.value is not None
    v = rec.value
    corrupt = {
        "bad marker": b"\xc3\x02" + v[2:],
        "bad enum index": v[:10] + b"\x7e" + v[11:],
        "bad union branch": v[:17] + b"\x04" + v[18:],  # after op (1), key length (1), key (5)
        "huge bytes length": v[:11] + b"\xfe\xff\xff\xff\x0f" + v[12:],
        "negative bytes length": v[:11] + b"\x03" + v[12:],
        "not avro at all": b"{}",
    }
    for what, value in corrupt.items():
        with pytest.raises(RecordFormatError):
            decode(rec.key, value, rec.headers)
            pytest.fail(what)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_decode_raises_only_record_format_error_on_arbitrary_corruption(data: st.DataObject) -> None:
    enc = RecordEncoder(data.draw(st.sampled_from(FORMATS)))
    rec = data.draw(st.sampled_from([
        enc.data(mutation(), 5, 40, 45),
        enc.snapshot(SnapshotMarker(7, 40, 45, SnapshotFlags.MEMORY), 5),
        enc.failover_log(7, LOG, 45, 40, 45),
        enc.rollback(7, 30, LOG[1:]),
        enc.stream_end(StreamEnd(7, StreamEndReason.OK), 5, 45, 40, 45),
    ]))
    value = bytearray(rec.value or b"")
    for _ in range(data.draw(st.integers(1, 4))):
        if value:
            i = data.draw(st.integers(0, len(value) - 1))
            value[i] = data.draw(st.integers(0, 255))
    try:
        d = decode(rec.key, bytes(value), rec.headers)
    except RecordFormatError:
        return
    # whatever survived still agrees with its headers
    assert d.vbucket == int(dict(rec.headers)["dcp.vbucket"])  # type: ignore[arg-type]


@pytest.mark.parametrize("missing", list(COMMON_HEADERS) + list(DATA_HEADERS))
def test_missing_header_raises(missing: str) -> None:
    rec = RecordEncoder().data(mutation(), 5, 40, 45)
    headers = [(n, v) for n, v in rec.headers if n != missing]
    with pytest.raises(RecordFormatError, match=missing):
        decode(rec.key, rec.value, headers)


@pytest.mark.parametrize("bad", [b"", b"-1", b" 1", b"1 ", b"+1", b"1.0", b"0x10", b"1_000", b"\xd9\xa1", b"abc", None,
                                 b"18446744073709551616", b"123456789012345678901"])
@pytest.mark.parametrize("name", ["dcp.seqno", "dcp.vbuuid", "dcp.cas", "dcp.vbucket", "dcp.snap.end"])
def test_non_decimal_or_out_of_range_header_raises(name: str, bad: bytes | None) -> None:
    rec = RecordEncoder().data(mutation(), 5, 40, 45)
    headers = [(n, bad if n == name else v) for n, v in rec.headers]
    with pytest.raises(RecordFormatError, match=name.replace(".", r"\.")):
        decode(rec.key, rec.value, headers)


def test_vbucket_header_above_u16_raises() -> None:
    rec = RecordEncoder().data(mutation(), 5, 40, 45)
    headers = [(n, b"65536" if n == "dcp.vbucket" else v) for n, v in rec.headers]
    with pytest.raises(RecordFormatError, match="out of range"):
        decode(rec.key, rec.value, headers)


def test_unknown_type_or_format_and_no_headers() -> None:
    rec = RecordEncoder().data(mutation(), 5, 40, 45)
    for name, bad in [("dcp.type", b"upsert"), ("dcp.format", b"json")]:
        headers = [(n, bad if n == name else v) for n, v in rec.headers]
        with pytest.raises(RecordFormatError, match=name):
            decode(rec.key, rec.value, headers)
    no_headers: list[tuple[str, bytes]] | None
    for no_headers in (None, []):
        with pytest.raises(RecordFormatError, match="no headers"):
            decode(rec.key, rec.value, no_headers)
    with pytest.raises(RecordFormatError, match="more than once"):
        decode(rec.key, rec.value, [*rec.headers, ("dcp.seqno", b"42")])


def test_headers_may_be_a_dict_or_str_and_foreign_headers_are_ignored() -> None:
    rec = RecordEncoder().data(mutation(), 5, 40, 45)
    expected = decode(rec.key, rec.value, rec.headers)
    as_dict = dict(rec.headers)
    assert decode(rec.key, rec.value, as_dict) == expected
    as_str = [(n, v.decode() if isinstance(v, bytes) else v) for n, v in rec.headers]
    assert decode(rec.key, rec.value, as_str) == expected
    assert decode(rec.key, rec.value, [("trace-id", b"x"), *rec.headers, ("trace-id", None)]) == expected


@pytest.mark.parametrize("header", ["dcp.seqno", "dcp.vbuuid", "dcp.cas", "dcp.rev", "dcp.snap.start", "dcp.datatype",
                                    "dcp.vbucket", "dcp.flags", "dcp.expiry"])
def test_avro_body_must_agree_with_headers(header: str) -> None:
    rec = RecordEncoder().data(mutation(), 5, 40, 45)
    headers = [(n, b"41" if n == header else v) for n, v in rec.headers]
    with pytest.raises(RecordFormatError, match="disagrees"):
        decode(rec.key, rec.value, headers)


def test_avro_body_must_agree_with_type_and_key() -> None:
    rec = RecordEncoder().data(mutation(), 5, 40, 45)
    with pytest.raises(RecordFormatError, match="disagrees"):
        decode(b"other-key", rec.value, rec.headers)
    headers = [(n, b"deletion" if n == "dcp.type" else v) for n, v in rec.headers]
    with pytest.raises(RecordFormatError, match="op"):
        decode(rec.key, rec.value, headers)
    snap = RecordEncoder().snapshot(SnapshotMarker(7, 40, 45, SnapshotFlags.MEMORY), 5)
    with pytest.raises(RecordFormatError, match="ControlEvent"):
        decode(rec.key, snap.value, rec.headers)  # a control value under data headers


@pytest.mark.parametrize("fmt", FORMATS)
def test_control_consistency(fmt: ValueFormat) -> None:
    enc = RecordEncoder(fmt)
    snap = enc.snapshot(SnapshotMarker(7, 40, 45, SnapshotFlags.MEMORY), 5)
    with pytest.raises(RecordFormatError, match="null key"):
        decode(b"k", snap.value, snap.headers)
    with pytest.raises(RecordFormatError, match="needs a value"):
        decode(None, None, snap.headers)
    headers = [(n, b"41" if n == "dcp.seqno" else v) for n, v in snap.headers]
    with pytest.raises(RecordFormatError, match="disagrees"):
        decode(None, snap.value, headers)
    fl = enc.failover_log(7, LOG, 45, 40, 45)
    headers = [(n, b"1" if n == "dcp.vbuuid" else v) for n, v in fl.headers]
    with pytest.raises(RecordFormatError, match="disagrees"):
        decode(None, fl.value, headers)
    # a failover-log value under rollback headers
    headers = [(n, b"rollback" if n == "dcp.type" else v) for n, v in fl.headers]
    with pytest.raises(RecordFormatError, match="type"):
        decode(None, fl.value, headers)


def test_raw_data_needs_a_key_and_raw_control_needs_json() -> None:
    enc = RecordEncoder(ValueFormat.RAW)
    rec = enc.data(mutation(), 5, 40, 45)
    with pytest.raises(RecordFormatError, match="key"):
        decode(None, rec.value, rec.headers)
    snap = enc.snapshot(SnapshotMarker(7, 40, 45, SnapshotFlags.MEMORY), 5)
    for bad in (b"not json", b"[1,2]", b'{"type":"SNAPSHOT"}', b"\xff\xfe"):
        with pytest.raises(RecordFormatError):
            decode(None, bad, snap.headers)
    doc = json.loads(snap.value or b"")
    doc["vbuuid"] = -1
    with pytest.raises(RecordFormatError, match="vbuuid"):
        decode(None, json.dumps(doc).encode(), snap.headers)
    doc["vbuuid"] = True
    with pytest.raises(RecordFormatError, match="vbuuid"):
        decode(None, json.dumps(doc).encode(), snap.headers)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(vbucket=st.integers(0, 0xFFFF), vbuuid=u64s, start=u64s, end=u64s,
       flags=st.one_of(st.sampled_from([0, 1, 2, 4, 5, 6, 0x3F]), st.integers(0, 2**31 - 1)))
def test_hand_rolled_snapshot_equals_fastavro(vbucket: int, vbuuid: int, start: int, end: int, flags: int) -> None:
    """The snapshot record's hand-rolled body (one per snapshot, on the hot path) is byte for byte the generic
    fastavro ControlEvent, with the same headers; an encoder reused over many snapshots keeps that."""
    enc = RecordEncoder()
    for _ in range(2):  # the second time from the encoder's cached pieces
        rec = enc.snapshot(SnapshotMarker(vbucket, start, end, SnapshotFlags(flags)), vbuuid)
        generic = RecordEncoder()._control(RecordType.SNAPSHOT, vbucket, vbuuid, start, start, end,
                                           snapshot_flags=flags)
        assert rec == generic
    d = decode(*_parts(rec))
    assert (d.type, d.vbucket, d.vbuuid, d.seqno, d.snap_start, d.snap_end, d.snapshot_flags) == (
        RecordType.SNAPSHOT, vbucket, vbuuid, start, start, end, flags)


def test_snapshot_encoder_rejects_out_of_range_values() -> None:
    enc = RecordEncoder()
    mem = SnapshotFlags.MEMORY
    for marker, vbuuid in ((SnapshotMarker(70000, 1, 2, mem), 5), (SnapshotMarker(1, -1, 2, mem), 5),
                           (SnapshotMarker(1, 1, 2**64, mem), 5), (SnapshotMarker(1, 1, 2, mem), 2**64),
                           (SnapshotMarker(1, 1, 2, SnapshotFlags(2**31)), 5)):
        with pytest.raises(RecordFormatError):
            enc.snapshot(marker, vbuuid)


def test_encoder_rejects_out_of_range_values() -> None:
    for fmt in FORMATS:
        enc = RecordEncoder(fmt)
        for item in (mutation(seqno=-1), mutation(cas=2**64), mutation(vbucket=70000)):
            with pytest.raises(RecordFormatError):
                enc.data(item, 5, 0, 0)
        with pytest.raises(RecordFormatError):
            enc.data(mutation(), -5, 0, 0)
        with pytest.raises(RecordFormatError):
            enc.failover_log(1, [], 0, 0, 0)
        with pytest.raises(RecordFormatError):
            enc.rollback(1, 0, [])


def test_encoding_10k_data_records() -> None:
    """A sanity loop over the hot path (benchmarks live elsewhere): both formats, caches cycling."""
    for fmt in FORMATS:
        enc = RecordEncoder(fmt)
        value = b'{"a":1,"b":"hello world"}' * 8
        n = 0
        for i in range(10_000):
            s = (i // 100) * 100
            rec = enc.data(Item(b"key%d" % i, value, i % 1024, i + 1, 1, 1_700_000_000_000_000_000 + i, 0, 0, 1),
                           0xABCDEF123456, s, s + 100)
            n += len(rec.value or b"")
        assert n >= 10_000 * len(value)
        d = decode(*_parts(rec))
        assert d.seqno == 10_000 and d.key == b"key9999"


def test_sync_items_are_refused_by_the_encoder() -> None:
    # docs/durability.md "DCP": prepares and aborts never reach the gateway; if one did, it is a typed error, not a record
    enc = RecordEncoder(ValueFormat.AVRO)
    for op in (Op.PREPARE, Op.PREPARE_DELETION, Op.ABORT):
        with pytest.raises(InvalidArgument):
            enc.data(mutation(op=op, value=None), BIG, 40, 45)


# ---------------------------------------------------------------------------------------------- oversize records
@pytest.mark.parametrize("fmt", list(ValueFormat))
def test_oversize_record_round_trip(fmt: ValueFormat) -> None:
    """The record that takes the place of a data record Kafka refused as too large (docs/record-format.md)."""
    enc = RecordEncoder(fmt)
    item = mutation(cas=U64, rev_seqno=BIG)
    rec = enc.oversize(item, U64 - 1, item.seqno - 1, item.seqno + 3, 1_000_512, "MSG_SIZE_TOO_LARGE: too big")
    assert rec.key == item.key
    h = headers_of(rec)
    assert h["dcp.type"] == b"oversize" and h["dcp.seqno"] == str(item.seqno).encode()
    assert set(h) == {"dcp.type", "dcp.format", "dcp.vbucket", "dcp.vbuuid", "dcp.seqno", "dcp.snap.start",
                      "dcp.snap.end"}
    d = decode(rec.key, rec.value, rec.headers)
    assert d.type is RecordType.OVERSIZE and not d.is_data and d.is_control
    assert (d.key, d.value, d.vbucket, d.vbuuid, d.seqno) == (item.key, None, item.vbucket, U64 - 1, item.seqno)
    assert (d.snap_start, d.snap_end, d.rev_seqno, d.cas) == (item.seqno - 1, item.seqno + 3, BIG, U64)
    assert d.size == len(item.value or b"") and d.reason == "MSG_SIZE_TOO_LARGE: too big"
    # the fast readers of data / control records leave it to decode()
    assert rec.value is not None
    assert read_change(rec.value, 0, None) is None
    assert read_control(rec.value) is None


def test_oversize_record_whose_value_disagrees_is_malformed() -> None:
    enc = RecordEncoder()
    item = mutation()
    rec = enc.oversize(item, 7, item.seqno, item.seqno, 10, "r")
    bad = [(n, b"999" if n == "dcp.seqno" else v) for n, v in rec.headers]
    with pytest.raises(RecordFormatError, match="seqno"):
        decode(rec.key, rec.value, bad)
    with pytest.raises(RecordFormatError, match="key"):
        decode(b"other", rec.value, rec.headers)
