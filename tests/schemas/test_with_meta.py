"""The with-meta wire contract (schemas/with_meta.py): extras layouts round-trip, bad sizes and ranges are
InvalidArgument."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from schemas.errors import InvalidArgument
from schemas.with_meta import (
    decode_get_meta_extras,
    decode_with_meta_extras,
    encode_get_meta_extras,
    encode_with_meta_extras,
)

u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)


@given(u32, u32, u64, u64, u32)
def test_with_meta_extras_round_trip(flags: int, expiry: int, rev: int, cas: int, options: int) -> None:
    ex = encode_with_meta_extras(flags, expiry, rev, cas, options)
    assert len(ex) == (28 if options else 24)
    assert decode_with_meta_extras(ex) == (flags, expiry, rev, cas, options, 0)
    assert decode_with_meta_extras(ex + b"\x01\x02")[5] == 0x0102  # 26 / 30 bytes: + extended-meta length
    assert decode_with_meta_extras(ex + b"\x01\x02")[4] == options


@given(st.booleans(), u32, u32, u64, st.none() | st.integers(0, 255))
def test_get_meta_extras_round_trip(deleted: bool, flags: int, expiry: int, rev: int, datatype: int | None) -> None:
    ex = encode_get_meta_extras(deleted, flags, expiry, rev, datatype)
    assert decode_get_meta_extras(ex) == (deleted, flags, expiry, rev, datatype or 0)


def test_bad_extras() -> None:
    for n in (0, 23, 25, 27, 29, 31):
        with pytest.raises(InvalidArgument):
            decode_with_meta_extras(b"\0" * n)
    for n in (0, 19, 22):
        with pytest.raises(InvalidArgument):
            decode_get_meta_extras(b"\0" * n)
    with pytest.raises(InvalidArgument):
        encode_with_meta_extras(0, 0, -1, 1)
    with pytest.raises(InvalidArgument):
        encode_with_meta_extras(0, 0, 1, 1, 1 << 32)
