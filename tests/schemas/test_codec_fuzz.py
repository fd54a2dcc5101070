"""Fuzz of the Kafka record decoders (schemas/codec.py ``decode``, ``read_change``, ``read_control``: the
paths the gateway's recovery, ``dcpgw tail`` and the client library read records with): random keys, values
and headers raise only the typed :class:`RecordFormatError` (the fast paths return None), never another
exception."""

from __future__ import annotations

import contextlib
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from engine import FailoverEntry, Item, Op, SnapshotFlags, SnapshotMarker, StreamEnd, StreamEndReason
from gateway.exceptions import RecordFormatError
from schemas.codec import RecordEncoder, decode, read_change, read_control
from schemas.records import KafkaRecord, ValueFormat

LOG = [FailoverEntry(99, 40), FailoverEntry(7, 0)]
_names = st.sampled_from(["dcp.type", "dcp.format", "dcp.vbucket", "dcp.vbuuid", "dcp.seqno", "dcp.snap.start",
                          "dcp.snap.end", "dcp.cas", "dcp.rev_seqno", "dcp.flags", "dcp.expiry",
                          "dcp.datatype", "dcp.failover_log", "dcp.snap.flags", "dcp.reason", "x"])
_header_values = st.one_of(st.none(), st.binary(max_size=24), st.text(max_size=12),
                           st.integers(0, 2**70).map(lambda n: str(n).encode()),
                           st.sampled_from([b"mutation", b"deletion", b"snapshot", b"failover_log", b"rollback",
                                            b"stream_end", b"oversize", b"avro", b"raw", b"-1", b"07"]))


def _records() -> list[KafkaRecord]:
    out = []
    for fmt in (ValueFormat.AVRO, ValueFormat.RAW):
        enc = RecordEncoder(fmt)
        for item in (Item(b"doc-1", b'{"a":1}', 7, 42, 3, 17, 5, 0, 1, Op.MUTATION),
                     Item(b"k" * 300, None, 7, 43, 3, 18, 0, 9, 0, Op.DELETION),
                     Item(b"e", None, 7, 44, 3, 19, 0, 9, 0, Op.EXPIRATION)):
            out.append(enc.data(item, 5, 40, 45))
        out.append(enc.snapshot(SnapshotMarker(7, 40, 45, SnapshotFlags.MEMORY), 5))
        out.append(enc.failover_log(7, LOG, 45, 40, 45))
        out.append(enc.rollback(7, 30, LOG[1:]))
        out.append(enc.stream_end(StreamEnd(7, StreamEndReason.OK), 5, 45, 40, 45))
    return out


RECORDS = _records()


@st.composite
def mangled(draw: st.DrawFn) -> tuple[bytes | None, bytes | None, Any]:
    rec = draw(st.sampled_from(RECORDS))
    key: bytes | None = rec.key
    value: bytes | None = rec.value
    headers: list[Any] = list(rec.headers)
    for _ in range(draw(st.integers(0, 4))):
        what = draw(st.sampled_from(["truncate", "append", "flip", "drop", "add", "replace", "key", "value"]))
        if what == "truncate" and value:
            value = value[:draw(st.integers(0, len(value)))]
        elif what == "append":
            value = (value or b"") + draw(st.binary(min_size=1, max_size=16))
        elif what == "flip" and value:
            i = draw(st.integers(0, len(value) - 1))
            value = value[:i] + bytes([draw(st.integers(0, 255))]) + value[i + 1:]
        elif what == "drop" and headers:
            headers.pop(draw(st.integers(0, len(headers) - 1)))
        elif what == "add":
            headers.append((draw(_names), draw(_header_values)))
        elif what == "replace" and headers:
            i = draw(st.integers(0, len(headers) - 1))
            headers[i] = (headers[i][0], draw(_header_values))
        elif what == "key":
            key = draw(st.one_of(st.none(), st.binary(max_size=300)))
        elif what == "value":
            value = draw(st.one_of(st.none(), st.binary(max_size=300)))
    shape = draw(st.sampled_from(["list", "list", "dict", "tuple", "junk"]))
    out: Any = headers
    if shape == "dict":
        out = dict(headers)
    elif shape == "tuple":
        out = tuple(headers)
    elif shape == "junk":
        out = [*headers, draw(st.sampled_from([("a", "b", "c"), ("only",), 5, None, b"xy"]))]
    return key, value, out


@settings(max_examples=1500, deadline=None)
@given(mangled())
def test_decode_raises_only_record_format_error(rec: tuple[bytes | None, bytes | None, Any]) -> None:
    key, value, headers = rec
    with contextlib.suppress(RecordFormatError):
        decode(key, value, headers)


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.none(), st.binary(max_size=64)), st.one_of(st.none(), st.binary(max_size=400)),
       st.lists(st.tuples(_names, _header_values), max_size=16))
def test_decode_of_random_records_raises_only_record_format_error(key: bytes | None, value: bytes | None,
                                                                   headers: list[Any]) -> None:
    with contextlib.suppress(RecordFormatError):
        decode(key, value, headers)


@settings(max_examples=1500, deadline=None)
@given(mangled())
def test_fast_paths_return_none_or_a_record_never_raise(rec: tuple[bytes | None, bytes | None, Any]) -> None:
    _key, value, _headers = rec
    if value is None:
        return
    got = read_change(value, 0, None)
    assert got is None or len(got) == 13
    ctl = read_control(value)
    assert ctl is None or ctl.vbucket >= 0


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=600))
def test_fast_paths_on_random_bytes(value: bytes) -> None:
    got = read_change(value, 0, None)
    assert got is None or len(got) == 13
    read_control(value)
