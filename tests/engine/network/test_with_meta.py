"""The XDCR target's opcodes (GET_META, SET / ADD / DEL_WITH_META) against a real node process
(engine/network/server.py, engine/network/with_meta.py; docs/xdcr.md "Target side")."""

from __future__ import annotations

import socket
import struct
import subprocess
import sys
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import Bucket, BucketConfig, vbucket_of
from engine.exceptions import EngineError, InvalidArgument, KeyExists, KeyNotFound, NotMyVBucket, Status
from engine.kv.conflict_resolution import (
    FORCE_ACCEPT_WITH_META_OPS,
    FORCE_WITH_META_OP,
    IS_EXPIRATION,
    REGENERATE_CAS,
    SKIP_CONFLICT_RESOLUTION_FLAG,
    ConflictRejected,
    ItemMeta,
)
from engine.kv.vbucket import VBucketState
from engine.network.protocol import (
    HEADER_LEN,
    Opcode,
    decode_frame,
    decode_get_meta_extras,
    encode_with_meta_extras,
    request,
)
from tests.engine.nodes import NVB, drain, keys_on

CAS = 0x1234_5678_9ABC_0000


def _raw(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def _read_frame(s: socket.socket) -> Any:
    data = b""
    while len(data) < HEADER_LEN:
        chunk = s.recv(4096)
        assert chunk, "connection closed"
        data += chunk
    body = struct.unpack(">I", data[8:12])[0]
    while len(data) < HEADER_LEN + body:
        data += s.recv(4096)
    return decode_frame(data[:HEADER_LEN + body])


def test_set_with_meta_keeps_the_source_meta_and_loses_conflicts(spawn) -> None:
    c = spawn().require()
    k = keys_on(1, 1)[0]
    r = c.set_with_meta(k, b'{"a": 1}', ItemMeta(CAS, 7, flags=9, expiry=0), vbucket=1)
    assert r.cas == CAS and r.seqno == 1
    m = c.get_meta(k, vbucket=1)
    assert (m.cas, m.rev_seqno, m.flags, m.expiry, m.deleted, m.datatype) == (CAS, 7, 9, 0, False, 1)
    g = c.get(k, vbucket=1)
    assert (g.value, g.cas, g.flags) == (b'{"a": 1}', CAS, 9)
    # the echo of the same write (bidirectional loop): identical, KEY_EEXISTS
    with pytest.raises(ConflictRejected) as same:
        c.set_with_meta(k, b'{"a": 1}', ItemMeta(CAS, 7, flags=9), vbucket=1)
    assert same.value.identical and same.value.status is Status.KEY_EEXISTS
    # behind: a lower rev seqno loses even with a larger CAS (seqno mode)
    with pytest.raises(ConflictRejected) as behind:
        c.set_with_meta(k, b"old", ItemMeta(CAS + 5, 6), vbucket=1)
    assert not behind.value.identical
    # ahead: a higher rev seqno wins
    c.set_with_meta(k, b"new", ItemMeta(CAS - 5, 8), vbucket=1)
    assert c.get(k, vbucket=1).value == b"new"
    stats = c.stats()
    assert (stats["conflict_resolution"], stats["accepted"], stats["rejected_behind"],
            stats["rejected_identical"]) == ("seqno", "2", "1", "1")


def test_del_with_meta_tombstone_keeps_meta_and_rejects_older_writes(spawn) -> None:
    c = spawn().require()
    k = keys_on(2, 1)[0]
    c.set_with_meta(k, b"v", ItemMeta(CAS, 3), vbucket=2)
    c.del_with_meta(k, ItemMeta(CAS + 1, 4, expiry=1_700_000_000), vbucket=2)
    with pytest.raises(KeyNotFound):
        c.get(k, vbucket=2)
    m = c.get_meta(k, vbucket=2)
    assert (m.deleted, m.rev_seqno, m.cas, m.expiry) == (True, 4, CAS + 1, 1_700_000_000)
    with pytest.raises(ConflictRejected):
        c.set_with_meta(k, b"older", ItemMeta(CAS + 9, 3), vbucket=2)
    # an incoming deletion loses a full tie on rev seqno and CAS
    with pytest.raises(ConflictRejected) as tie:
        c.del_with_meta(k, ItemMeta(CAS + 1, 4, expiry=1_700_000_000), vbucket=2)
    assert tie.value.identical
    # add_with_meta over a tombstone runs conflict resolution against it
    c.add_with_meta(k, b"back", ItemMeta(CAS + 2, 5), vbucket=2)
    with pytest.raises(KeyExists) as live:
        c.add_with_meta(k, b"again", ItemMeta(CAS + 3, 9), vbucket=2)
    assert not isinstance(live.value, ConflictRejected)
    # IS_EXPIRATION: the tombstone is an expiration (DCP_EXPIRATION on the stream)
    c.del_with_meta(k, ItemMeta(CAS + 4, 6, expiry=1_700_000_001), IS_EXPIRATION, vbucket=2)
    with pytest.raises(KeyNotFound):
        c.get_meta(keys_on(2, 2)[1], vbucket=2)


def test_options_and_statuses(spawn) -> None:
    c = spawn().require()
    k = keys_on(0, 1)[0]
    c.set_with_meta(k, b"v", ItemMeta(CAS, 10), vbucket=0)
    # SKIP_CONFLICT_RESOLUTION_FLAG: an older write is forced in
    c.set_with_meta(k, b"forced", ItemMeta(CAS - 100, 2), SKIP_CONFLICT_RESOLUTION_FLAG, vbucket=0)
    m = c.get_meta(k, vbucket=0)
    assert (m.rev_seqno, m.cas) == (2, CAS - 100)
    # REGENERATE_CAS (with SKIP): the target's own CAS, ahead of its HLC
    r = c.set_with_meta(k, b"regen", ItemMeta(5, 3), SKIP_CONFLICT_RESOLUTION_FLAG | REGENERATE_CAS, vbucket=0)
    assert r.cas > CAS and c.get_meta(k, vbucket=0).cas == r.cas
    # FORCE_WITH_META_OP: skips conflict resolution only (kv_engine since MB-67207)
    c.set_with_meta(k, b"forced-too", ItemMeta(CAS - 200, 1), FORCE_WITH_META_OP, vbucket=0)
    assert c.get_meta(k, vbucket=0).rev_seqno == 1
    r = c.set_with_meta(k, b"regen", ItemMeta(5, 3), FORCE_WITH_META_OP | REGENERATE_CAS, vbucket=0)
    for bad in (REGENERATE_CAS, FORCE_ACCEPT_WITH_META_OPS, 0x100, 0x20, IS_EXPIRATION):
        with pytest.raises(InvalidArgument):
            c.set_with_meta(k, b"x", ItemMeta(CAS * 2, 99), bad, vbucket=0)
    with pytest.raises(KeyExists):  # a CAS of 0 in the metadata: KEY_EEXISTS, as kv_engine
        c.set_with_meta(k, b"x", ItemMeta(0, 99), vbucket=0)
    # header CAS: must match the stored document
    with pytest.raises(KeyExists):
        c.set_with_meta(k, b"x", ItemMeta(CAS * 2, 99), vbucket=0, cas=r.cas + 1)
    with pytest.raises(KeyNotFound):
        c.set_with_meta(keys_on(0, 2)[1], b"x", ItemMeta(CAS, 1), vbucket=0, cas=77)
    c.set_with_meta(k, b"cas-ok", ItemMeta(CAS * 2, 99), vbucket=0, cas=r.cas)
    with pytest.raises(NotMyVBucket):
        c.set_with_meta(k, b"x", ItemMeta(CAS, 1), vbucket=1)  # the key does not map there
    c.set_vbucket_state(3, VBucketState.REPLICA)
    with pytest.raises(NotMyVBucket):
        c.set_with_meta(keys_on(3, 1)[0], b"x", ItemMeta(CAS, 1), vbucket=3)
    with pytest.raises(NotMyVBucket):
        c.get_meta(keys_on(3, 1)[0], vbucket=3)


def test_value_too_large(spawn) -> None:
    c = spawn(max_value_size=100).require()
    with pytest.raises(Exception) as big:
        c.set_with_meta(keys_on(0, 1)[0], b"x" * 101, ItemMeta(CAS, 1), vbucket=0)
    assert getattr(big.value, "status", None) is Status.E2BIG


def test_lww_bucket_orders_by_cas_and_moves_the_hlc(spawn) -> None:
    c = spawn(conflict_resolution="lww").require()
    k = keys_on(1, 1)[0]
    far = (1 << 63) + (1 << 40)  # far ahead of the wall clock
    c.set_with_meta(k, b"a", ItemMeta(CAS, 50), vbucket=1)
    c.set_with_meta(k, b"b", ItemMeta(CAS + 1, 1), FORCE_ACCEPT_WITH_META_OPS, vbucket=1)  # CAS first
    with pytest.raises(ConflictRejected):
        c.set_with_meta(k, b"c", ItemMeta(CAS, 99), vbucket=1)
    k2 = keys_on(1, 2)[1]
    c.set_with_meta(k2, b"future", ItemMeta(far, 1), vbucket=1)
    r = c.set(k2, b"local", vbucket=1)
    assert r.cas > far  # the HLC moved past the accepted CAS
    assert c.stats()["conflict_resolution"] == "lww"


def test_accepted_writes_stream_with_the_source_meta(spawn) -> None:
    c = spawn().require()
    k, k2 = keys_on(1, 2)  # two keys: the checkpoint de-duplicates versions of one key
    c.set_with_meta(k, b"v1", ItemMeta(CAS, 11, flags=4, expiry=0), vbucket=1)
    c.del_with_meta(k2, ItemMeta(CAS + 7, 12, expiry=1_800_000_000), vbucket=1)
    p = c.dcp_producer("t")
    uuid = c.failover_log(1)[0].vbuuid
    p.stream_request(1, 0, 2**64 - 1, uuid, 0, 0)
    got = drain(p, lambda g: sum(1 for m in g if hasattr(m, "cas")) >= 2)
    items = [m for m in got if hasattr(m, "cas")]
    assert [(i.rev_seqno, i.cas, i.deleted) for i in items] == [(11, CAS, False), (12, CAS + 7, True)]
    assert items[1].expiry == 1_800_000_000
    p.close()


def test_bad_frames(spawn) -> None:
    node = spawn()
    s = _raw(node.port)
    k = keys_on(0, 1)[0].encode()
    cases = [
        request(Opcode.SET_WITH_META, key=k, extras=b"\0" * 20, value=b"v", opaque=1),  # extras size
        request(Opcode.SET_WITH_META, extras=encode_with_meta_extras(0, 0, 1, CAS), value=b"v", opaque=2),  # no key
        request(Opcode.SET_WITH_META, key=k, extras=encode_with_meta_extras(0, 0, 1, CAS) + b"\0\x09",
                value=b"v", opaque=3),  # nmeta 9 > value
        request(Opcode.SET_WITH_META, key=k, extras=encode_with_meta_extras(0, 0, 1, CAS), value=b"v",
                datatype=0x02, opaque=4),  # snappy
        request(Opcode.SET_WITH_META, key=k, extras=encode_with_meta_extras(0, 0, 1, CAS), value=b"v",
                framing=b"\x11\x01", opaque=5),  # durability frame
        request(Opcode.GET_META, key=k, extras=b"\x07", opaque=6),  # version 7
        request(Opcode.GET_META, extras=b"\x02", opaque=7),  # no key
        request(Opcode.DEL_WITH_META, key=k, extras=b"\0" * 25, opaque=8),
    ]
    for i, frame in enumerate(cases, 1):
        s.sendall(frame)
        f = _read_frame(s)
        assert (f.status, f.opaque) == (Status.EINVAL, i), i
    # the connection stays usable; nmeta bytes are stripped from the value
    s.sendall(request(Opcode.SET_WITH_META, key=k, extras=encode_with_meta_extras(0, 0, 1, CAS, 0) + b"\0\x02",
                      value=b"doc" + b"EM", opaque=20))
    assert _read_frame(s).status == Status.SUCCESS
    s.sendall(request(Opcode.GET_META, key=k, opaque=21))
    f = _read_frame(s)
    assert f.status == Status.SUCCESS and len(f.extras) == 20 and f.cas == CAS
    assert decode_get_meta_extras(f.extras)[:4] == (False, 0, 0, 1)
    s.sendall(request(Opcode.GET_META, key=b"missing", vbucket=0, opaque=22))
    assert _read_frame(s).status in (Status.KEY_ENOENT, Status.NOT_MY_VBUCKET)
    s.close()
    assert node.require().get(k.decode(), vbucket=0).value == b"doc"


def test_node_refuses_a_different_mode_on_reopen(spawn, tmp_path) -> None:
    node = spawn()
    node.require().set_with_meta(keys_on(0, 1)[0], b"v", ItemMeta(CAS, 1), vbucket=0)
    node.kill()
    proc = subprocess.run(
        [sys.executable, "-m", "engine.network.server", "--data-dir", str(tmp_path / "n0"), "--num-vbuckets", "4",
         "--conflict-resolution", "lww"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "created with conflict resolution 'seqno'" in proc.stderr and "lww" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1



# ---------------------------------------------------------------------- the wire vs the in-process bucket
_wire_meta = st.builds(ItemMeta, cas=st.sampled_from([CAS, CAS + 1, CAS + 2, 0]), rev_seqno=st.integers(1, 4),
                       flags=st.integers(0, 2), expiry=st.sampled_from([0, 4_000_000_000]))
_wire_op = st.tuples(st.sampled_from(["set_with_meta", "add_with_meta", "del_with_meta", "get_meta"]),
                     st.integers(0, 2), _wire_meta,
                     st.sampled_from([0, 0, SKIP_CONFLICT_RESOLUTION_FLAG, FORCE_ACCEPT_WITH_META_OPS,
                                      IS_EXPIRATION, 0x40]))


def _outcome(fn: Any, *args: Any, **kw: Any) -> Any:
    try:
        r = fn(*args, **kw)
    except ConflictRejected as e:
        return ("rejected", e.identical)
    except EngineError as e:
        return ("error", int(e.status))
    return ("ok", r.cas if hasattr(r, "cas") and not isinstance(r, ItemMeta) else r)


@pytest.mark.parametrize("mode", ["seqno", "lww"])
def test_wire_answers_equal_the_in_process_bucket(spawn, tmp_path, mode: str) -> None:
    c = spawn(conflict_resolution=mode).require()
    examples = iter(range(10_000))

    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(_wire_op, min_size=1, max_size=12))
    def check(ops: list[tuple[Any, ...]]) -> None:
        n = next(examples)
        b = Bucket(BucketConfig(data_dir=tmp_path / f"b{n}", num_vbuckets=NVB, conflict_resolution=mode,
                                tune_gc=False))
        try:
            for name, ki, meta, opts in ops:
                key = f"e{n}-{ki}"
                vb = vbucket_of(key.encode(), NVB)
                if name == "get_meta":
                    local = _outcome(b.get_meta, key)
                    remote = _outcome(c.get_meta, key, vbucket=vb)
                elif name == "del_with_meta":
                    local = _outcome(b.del_with_meta, key, None, meta, opts)
                    remote = _outcome(c.del_with_meta, key, meta, opts, vbucket=vb)
                else:
                    local = _outcome(getattr(b, name), key, b"v", meta, opts)
                    remote = _outcome(getattr(c, name), key, b"v", meta, opts, vbucket=vb)
                if name == "get_meta" and local[0] == "ok":
                    lm, rm = local[1], remote[1]
                    assert remote[0] == "ok" and (lm.cas, lm.rev_seqno, lm.flags, lm.deleted) == (
                        rm.cas, rm.rev_seqno, rm.flags, rm.deleted)
                    if not lm.deleted:  # (a tombstone sent without a delete time gets each side's "now")
                        assert lm.expiry == rm.expiry
                else:
                    assert local == remote, (name, meta, opts)
        finally:
            b.close()

    check()
