"""A real node process (engine/network/server.py) driven over TCP (engine/network/remote.py)."""

from __future__ import annotations

import shutil
import socket
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from engine import (
    Bucket,
    BucketConfig,
    FailoverEntry,
    Item,
    KeyExists,
    KeyNotFound,
    NotMyVBucket,
    RangeError,
    RollbackRequired,
    StateCasMismatch,
    Status,
    StreamEnd,
    StreamEndReason,
    VBucketState,
)
from engine.exceptions import InvalidArgument, UnknownCommand
from engine.network.process_cluster import NodeProcess
from engine.network.protocol import HEADER_LEN, Opcode, decode_frame, request
from engine.network.remote import NodeUnavailable
from tests.engine.dcp_model import SnapshotConsumer
from tests.engine.nodes import CFG, NVB, drain, keys_on, wait_for


def test_front_end_ops(spawn) -> None:
    node = spawn()
    c = node.require()
    k = keys_on(1, 1)[0]
    r = c.set(k, b'{"a": 1}', vbucket=1, flags=7)
    assert r.seqno == 1 and r.vbucket == 1 and r.vbuuid == c.failover_log(1)[0].vbuuid
    g = c.get(k, vbucket=1)
    assert g.value == b'{"a": 1}' and g.cas == r.cas and g.flags == 7 and g.datatype == 1
    with pytest.raises(KeyExists):
        c.set(k, b"x", vbucket=1, cas=r.cas + 1)
    r2 = c.set(k, b"v2", vbucket=1, cas=r.cas)
    assert r2.seqno == 2
    with pytest.raises(NotMyVBucket) as nm:
        c.set(k, b"x", vbucket=2)  # the key does not map there
    assert nm.value.status is Status.NOT_MY_VBUCKET and nm.value.retriable
    d = c.delete(k, vbucket=1)
    assert d.seqno == 3
    with pytest.raises(KeyNotFound):
        c.get(k, vbucket=1)
    with pytest.raises(KeyNotFound):
        c.delete(k, vbucket=1)
    # observe: the flusher persists on its own
    wait_for(lambda: c.observe_seqno(1, d.vbuuid).persisted_seqno == 3)
    o = c.observe_seqno(1, d.vbuuid)
    assert (o.current_seqno, o.failed_over) == (3, False)
    o = c.observe_seqno(1, 12345)
    assert o.failed_over and o.old_vbuuid == 12345 and o.last_seqno == 0
    stats = c.stats()
    assert stats["name"] == "n0" and int(stats["items_flushed"]) >= 1
    # a dead vbucket answers NOT_MY_VBUCKET (kv_engine: a vbucket this node does not serve)
    c.set_vbucket_state(1, VBucketState.DEAD)
    with pytest.raises(NotMyVBucket):
        c.get(k, vbucket=1)
    with pytest.raises(NotMyVBucket):
        c.observe_seqno(1, d.vbuuid)


def test_state_commands_carry_the_partition_state_cas(spawn) -> None:
    c = spawn().require()
    cas = c.state_cas(0)
    new = c.set_vbucket_state(0, VBucketState.REPLICA, cas=cas)
    assert new != cas and c.vbucket_state(0) is VBucketState.REPLICA and c.state_cas(0) == new
    with pytest.raises(StateCasMismatch) as stale:
        c.set_vbucket_state(0, VBucketState.DEAD, cas=cas)  # docs/cluster.md "Partition-state CAS" step 6: rejected with the current CAS
    assert stale.value.current_cas == new and stale.value.retriable
    assert c.vbucket_state(0) is VBucketState.REPLICA
    entry = c.promote(0, cas=new)  # replica -> active: a failover entry (kv_engine promotion)
    assert entry is not None and c.failover_log(0)[0] == entry and c.vbucket_state(0) is VBucketState.ACTIVE
    c.set_vbucket_state(1, VBucketState.REPLICA)
    assert c.promote(1, takeover=True) is None  # takeover: no entry
    info = c.vbucket_info(1)
    assert info.state is VBucketState.ACTIVE and len(info.failover) == 1


def test_dcp_stream_over_tcp_equals_in_process_stream(spawn, tmp_path: Path) -> None:
    node = spawn()
    c = node.require()
    for vb in range(NVB):
        for i, k in enumerate(keys_on(vb, 6)):
            c.set(k, f"v{i}".encode(), vbucket=vb)
        c.delete(keys_on(vb, 1)[0], vbucket=vb)
    c.flush()
    node.stop()  # clean: everything on disk
    copy = tmp_path / "copy"
    shutil.copytree(node.data_dir, copy)
    node.start()
    c = node.require()
    p = c.dcp_producer("cmp")
    local = Bucket(BucketConfig(data_dir=copy, num_vbuckets=NVB, tune_gc=False, **CFG))
    try:
        lp = local.dcp_producer("cmp")
        for vb in range(NVB):
            remote_log = p.stream_request(vb, 0, 7)
            assert remote_log == lp.stream_request(vb, 0, 7)
            remote = drain(p, lambda got: bool(got) and isinstance(got[-1], StreamEnd))
            expected: list[Any] = []
            while True:
                msgs = lp.step()
                if not msgs:
                    break
                expected.extend(msgs)
            assert remote == expected  # markers (disk, chunked backfill), items with every field, stream end
            assert remote[-1] == StreamEnd(vb, StreamEndReason.OK)
            assert any(isinstance(m, Item) and m.value is None for m in remote)  # the deletion
    finally:
        local.close()
        p.close()


def test_live_stream_flow_control_and_client_model(spawn: Callable[..., NodeProcess]) -> None:
    node = spawn()
    c = node.require()
    p = c.dcp_producer("fc", buffer_size=300)
    for vb in range(NVB):
        p.stream_request(vb, 0)
    for vb in range(NVB):
        for i, k in enumerate(keys_on(vb, 10)):
            c.set(k, b"x" * 40 + str(i).encode(), vbucket=vb)
    time.sleep(0.3)
    first = p.step()
    more = p.step()
    # flow control: the node stops after ~300 unacknowledged bytes (one message may overshoot)
    assert first and sum(m.dcp_size for m in first + more) < 300 + 200
    p.buffer_acknowledge(sum(m.dcp_size for m in first + more))
    # the snapshot-aware reference client converges over the network
    consumer = SnapshotConsumer(list(range(NVB)))
    model = c.dcp_producer("model")
    consumer.open_streams(model)  # type: ignore[arg-type]

    def caught_up() -> bool:
        consumer.drain(model)  # type: ignore[arg-type]
        return len(consumer.state()) == 4 * 10

    wait_for(caught_up)
    assert {k: v for k, (v, _vb) in consumer.state().items()} == {
        k.encode(): b"x" * 40 + str(i).encode() for vb in range(NVB) for i, k in enumerate(keys_on(vb, 10))}
    p.close()
    model.close()


def test_stream_request_answers(spawn) -> None:
    c = spawn().require()
    k = keys_on(2, 1)[0]
    uuid = c.set(k, b"v", vbucket=2).vbuuid
    p = c.dcp_producer("answers")
    with pytest.raises(RollbackRequired) as rb:
        p.stream_request(2, 9, vbuuid=uuid, snap_start=9, snap_end=9)  # ahead of high, current uuid
    assert rb.value.seqno == 1 and rb.value.vbucket == 2 and rb.value.status is Status.ROLLBACK
    with pytest.raises(RollbackRequired) as rb:
        p.stream_request(2, 1, vbuuid=0xDEAD, snap_start=1, snap_end=1)  # unknown branch
    assert rb.value.seqno == 0
    # the client's whole log (the product's extension) is carried in the request body: its branch 0xDEAD
    # forked at 1 from uuid's history, so seqno 1 is shared and no rollback is needed
    assert p.stream_request(2, 1, vbuuid=0xDEAD, snap_start=1, snap_end=1,
                            failover_log=[FailoverEntry(0xDEAD, 1), FailoverEntry(uuid, 0)]) == [
        FailoverEntry(uuid, 0)]
    p.close_stream(2)
    p.discard_stream(2)
    with pytest.raises(RangeError):
        p.stream_request(2, 5, 2)
    with pytest.raises(NotMyVBucket):
        p.stream_request(9, 0)
    assert p.stream_request(2, 0) == [FailoverEntry(uuid, 0)]
    with pytest.raises(KeyExists):
        p.stream_request(2, 0)
    p.close_stream(2)
    p.discard_stream(2)
    with pytest.raises(NotMyVBucket):
        p.close_stream(2)
    assert p.get_failover_log(2) == [FailoverEntry(uuid, 0)]
    # a state change ends the stream with STATE_CHANGED
    p.stream_request(2, 0)
    c.set_vbucket_state(2, VBucketState.REPLICA)
    got = drain(p, lambda g: any(isinstance(m, StreamEnd) for m in g))
    assert got[-1] == StreamEnd(2, StreamEndReason.STATE_CHANGED)  # what was not sent yet is dropped
    p.close()


def _raw(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    return s


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


def test_bad_frames_get_error_answers_not_a_crash(spawn) -> None:
    node = spawn()
    s = _raw(node.port)
    # a well-framed request with bad extras: EINVAL, the connection stays usable
    s.sendall(request(Opcode.SET, key=b"k", extras=b"\0\0\0", value=b"v", opaque=5))
    f = _read_frame(s)
    assert (f.status, f.opaque) == (Status.EINVAL, 5)
    s.sendall(request(0x77, opaque=6))  # not a command of ours
    f = _read_frame(s)
    assert (f.status, f.opaque) == (Status.UNKNOWN_COMMAND, 6)
    s.sendall(request(Opcode.DCP_BUFFER_ACKNOWLEDGEMENT, extras=b"\0\0\0\1", opaque=7))  # not a DCP conn
    assert _read_frame(s).status == Status.EINVAL
    s.sendall(request(Opcode.STAT, key=b"nonsense", opaque=8))
    assert _read_frame(s).status == Status.EINVAL
    # garbage: EINVAL, then this connection (only) is dropped -- the stream cannot be resynchronised
    s.sendall(b"\x42" * 24)
    assert _read_frame(s).status == Status.EINVAL
    assert s.recv(10) == b""
    s.close()
    # a frame announcing a huge body, then a half frame and a hang-up: the node carries on
    s = _raw(node.port)
    s.sendall(request(Opcode.GET, key=b"k")[:HEADER_LEN - 4])
    s.close()
    c = node.require()
    assert c.stats()["bad_frames"] == "1"
    with pytest.raises(UnknownCommand):
        c._call(0x77)
    with pytest.raises(InvalidArgument):
        c.stats("vbucket-details x")
    assert node.up


def test_sigkill_keeps_persisted_and_warmup_adds_entry(spawn) -> None:
    node = spawn()
    c = node.require()
    ks = keys_on(0, 5)
    toks = [c.set(k, b"durable", vbucket=0) for k in ks]
    wait_for(lambda: c.observe_seqno(0, toks[-1].vbuuid).persisted_seqno == 5)
    c.stop_persistence()
    lost = c.set(keys_on(0, 6)[-1], b"lost", vbucket=0)
    assert c.observe_seqno(0, lost.vbuuid).persisted_seqno == 5
    node.kill()
    with pytest.raises(NodeUnavailable):
        node.require()
    node.start()
    c = node.require()
    for k in ks:
        assert c.get(k, vbucket=0).value == b"durable"
    with pytest.raises(KeyNotFound):
        c.get(keys_on(0, 6)[-1], vbucket=0)
    log = c.failover_log(0)
    assert log[0].seqno == 5 and log[1].vbuuid == toks[0].vbuuid  # unclean warmup: a new entry at 5
    assert c.stats()["clean_start"] == "0"
    o = c.observe_seqno(0, lost.vbuuid)
    assert o.failed_over and o.last_seqno == 5  # the lost write (seqno 6) is above the branch end


def test_two_processes_replicate_over_dcp(spawn) -> None:
    a = spawn("a")
    b = spawn("b")
    ca, cb = a.require(), b.require()
    for vb in range(NVB):
        cb.set_vbucket_state(vb, VBucketState.REPLICA)
    for vb in range(NVB):
        for i, k in enumerate(keys_on(vb, 8)):
            ca.set(k, f"v{i}".encode(), vbucket=vb)
    cb.set_replication({"a": ("127.0.0.1", a.port, list(range(NVB)))})
    ca.delete(keys_on(3, 1)[0], vbucket=3)

    def same() -> bool:
        return all(cb.vbucket_info(vb).snapshot_persisted == ca.vbucket_info(vb).high_seqno for vb in range(NVB))

    wait_for(same)
    for vb in range(NVB):
        ia, ib = ca.vbucket_info(vb), cb.vbucket_info(vb)
        assert ib.failover == ia.failover and ib.high_seqno == ia.high_seqno
        o = cb.observe_seqno(vb, ia.vbuuid)  # a replica answers its last complete snapshot
        assert o.current_seqno == ia.high_seqno
    assert "a:connects" in cb.stats("replication")
    # promote b's copy of vb 0 after a's is dead: b has the same items, a new branch at the high seqno
    ca.set_vbucket_state(0, VBucketState.DEAD)
    cb.set_replication({"a": ("127.0.0.1", a.port, [1, 2, 3])})
    entry = cb.promote(0)
    assert entry is not None and entry.seqno == ca.vbucket_info(0).high_seqno
    assert cb.get(keys_on(0, 8)[3], vbucket=0).value == b"v3"


def test_expiration_is_streamed(spawn) -> None:
    c = spawn().require()
    k = keys_on(3, 1)[0]
    c.set(k, b"short-lived", vbucket=3, expiry=1)  # relative seconds (memcached rule)
    time.sleep(2.1)
    with pytest.raises(KeyNotFound):
        c.get(k, vbucket=3)  # an expired item is expired on access: a new seqno, an expiration
    p = c.dcp_producer("exp")
    p.stream_request(3, 0)
    got = drain(p, lambda g: any(isinstance(m, Item) and m.seqno == 2 for m in g))
    exp = got[-1]  # the mutation may be de-duplicated away in the open checkpoint
    assert isinstance(exp, Item) and (exp.seqno, exp.op.name, exp.key, exp.value) == (2, "EXPIRATION", k.encode(), None)
    p.close()


def test_vbucket_persisted_stat_follows_flushes_and_state_changes(spawn) -> None:
    """``stats vbucket-persisted`` (answered from a cache between two changes, docs/scale-out.md) always equals
    OBSERVE_SEQNO: after writes that are not persisted, after a flush, and after a vbucket changes state."""
    node = spawn()
    c = node.require()

    def table() -> dict[int, tuple[int, int]]:
        out = {}
        for e in c.stats("vbucket-persisted")["vbuckets"].split():
            vb, uuid, seqno = map(int, e.split(":"))
            out[vb] = (uuid, seqno)
        return out

    def observed() -> dict[int, tuple[int, int]]:
        out = {}
        for vb in range(NVB):
            if c.vbucket_state(vb) is VBucketState.ACTIVE:
                uuid = c.failover_log(vb)[0].vbuuid
                out[vb] = (uuid, c.observe_seqno(vb, uuid).persisted_seqno)
        return out

    c.stop_persistence()
    for vb in range(NVB):
        for k in keys_on(vb, 2):
            c.set(k, b"1", vbucket=vb)
    assert table() == table() == observed() and all(seqno == 0 for _u, seqno in table().values())
    c.flush()
    assert table() == observed() and all(seqno == 2 for _u, seqno in table().values())
    c.set_vbucket_state(1, VBucketState.REPLICA)
    t = table()
    assert 1 in t and t[1][1] == c.vbucket_info(1).snapshot_persisted
    c.set_vbucket_state(2, VBucketState.DEAD)
    assert 2 not in table()
    c.set(keys_on(0, 3)[2], b"2", vbucket=0)
    c.flush()
    assert table()[0] == observed()[0] == (c.failover_log(0)[0].vbuuid, 3)



def test_packed_vbucket_states_stat_equals_the_per_vbucket_one(spawn) -> None:
    """``stats vbucket-states packed`` (one frame, what attached gateways read every 0.5 s) says what ``stats
    vbucket-states`` (one frame per vbucket) says, after state changes too."""
    c = spawn().require()

    def packed() -> dict[str, str]:
        raw = c.stats("vbucket-states packed")
        assert list(raw) == ["vbuckets"]
        return dict(e.split(":") for e in raw["vbuckets"].split())

    assert packed() == c.stats("vbucket-states") and len(packed()) == NVB
    c.set_vbucket_state(1, VBucketState.REPLICA)
    c.set_vbucket_state(2, VBucketState.DEAD)
    got = packed()
    assert got == c.stats("vbucket-states") and (got["1"], got["2"], got["0"]) == ("replica", "dead", "active")

class InProcessNode:
    """A :class:`NodeServer` on its own event loop in a thread, over a bucket of the test (as ``dcpgw up --gateways
    K`` serves its engine), and a client of it. :meth:`on_loop` runs a call on the loop that owns the bucket."""

    def __init__(self, bucket: Any, **server_args: Any) -> None:
        import asyncio
        import threading

        from engine.network.remote import connect
        from engine.network.server import NodeServer

        self.bucket = bucket
        self.server = NodeServer(bucket, "t", **server_args)
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        self._done = asyncio.Event()

        async def serve() -> None:
            await self.server.start()
            started.set()
            await self._done.wait()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()
            await asyncio.sleep(0)

        self._thread = threading.Thread(target=lambda: self.loop.run_until_complete(serve()), daemon=True)
        self._thread.start()
        assert started.wait(10)
        self.client = connect(f"127.0.0.1:{self.server.port}")

    def on_loop(self, fn: Any) -> Any:
        import asyncio

        async def call() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(call(), self.loop).result(30)

    def persisted(self) -> dict[int, int]:
        """``stats vbucket-persisted`` as vbucket -> persisted seqno."""
        return {int(vb): int(seqno) for vb, _u, seqno in
                (e.split(":") for e in self.client.stats("vbucket-persisted")["vbuckets"].split())}

    def close(self) -> None:
        self.client.close()
        self.loop.call_soon_threadsafe(self._done.set)
        self._thread.join(5)


def test_vbucket_persisted_stat_sees_a_flush_this_server_did_not_make(make_bucket) -> None:
    """In ``dcpgw up --gateways K`` the gateway service flushes the bucket its node server serves, and the server
    is not told (docs/scale-out.md). Its cached ``stats vbucket-persisted`` answer must still move with the
    bucket's persisted seqnos: a stale answer held every member's rollback mitigation back forever (the
    up --gateways test's lost writes)."""
    bucket = make_bucket(num_vbuckets=4)
    node = InProcessNode(bucket, flush_interval=3600.0)  # its own flusher never runs in this test
    try:
        assert node.persisted() == {0: 0, 1: 0, 2: 0, 3: 0}
        for round_ in (1, 2):
            for vb in range(4):
                node.on_loop(lambda vb=vb, round_=round_: bucket.set(keys_on(vb, 2)[round_ - 1], b"v", vbucket=vb))
            assert node.persisted() == dict.fromkeys(range(4), round_ - 1)  # not persisted yet
            node.on_loop(bucket.flush_all)  # as the gateway service's pump does: the server is not kicked
            assert node.persisted() == dict.fromkeys(range(4), round_)
        node.on_loop(lambda: bucket.set_vbucket_state(3, VBucketState.DEAD))
        assert 3 not in node.persisted()
    finally:
        node.close()


def test_a_flush_backlog_is_persisted_in_steps_with_requests_answered_between(make_bucket, monkeypatch) -> None:
    """docs/scale-out.md: after START_PERSISTENCE with a large backlog the node's flusher persists
    ``FLUSH_STEP_ITEMS`` at a time and serves its connections between two steps -- a gateway's STAT was left
    unanswered past its timeout while a 1M-item backlog was flushed in one call (the member exited)."""
    import engine.network.server as server_mod

    monkeypatch.setattr(server_mod, "FLUSH_STEP_ITEMS", 100)  # 300 steps: a STAT lands between two of them
    bucket = make_bucket(num_vbuckets=4)
    node = InProcessNode(bucket, flush_interval=0.005)
    try:
        node.server.persistence = False  # STOP_PERSISTENCE
        keys = [f"k{i}" for i in range(30_000)]
        node.on_loop(lambda: [bucket.set(k, b"x" * 100) for k in keys])
        total = len(keys)
        assert sum(node.persisted().values()) == 0
        node.server.persistence = True  # START_PERSISTENCE (an attribute write: the loop reads it next turn)
        seen: list[int] = []
        while not seen or seen[-1] < total:
            seen.append(sum(node.persisted().values()))
        partial = [n for n in seen if 0 < n < total]
        assert partial, f"no STAT answered while the backlog was flushed: {seen[:5]}...{seen[-5:]}"
        assert node.on_loop(lambda: bucket.dirty_vbuckets) == 0
    finally:
        node.close()


def test_stop_persistence_answers_after_the_step_in_flight_landed_and_nothing_persists_after_it(spawn) -> None:
    """The node's flusher persists in the background (docs/engine.md "Background flush"): STOP_PERSISTENCE
    lands the step in flight before it answers, so the persisted seqnos it leaves are final -- they do not move
    afterwards, and a SIGKILL then keeps exactly the items up to them."""
    node = spawn()
    c = node.require()
    written: dict[int, list[tuple[str, int]]] = {vb: [] for vb in range(NVB)}
    for vb in range(NVB):
        for k in keys_on(vb, 400):
            written[vb].append((k, c.set(k, b"v", vbucket=vb).seqno))
    c.stop_persistence()  # while the flusher is most likely persisting what was just written
    persisted = {vb: c.vbucket_info(vb).persisted_seqno for vb in range(NVB)}
    time.sleep(0.3)  # many flush intervals
    assert {vb: c.vbucket_info(vb).persisted_seqno for vb in range(NVB)} == persisted
    node.kill()
    node.start()
    c = node.require()
    for vb in range(NVB):
        assert c.vbucket_info(vb).high_seqno == persisted[vb]
        for k, seqno in written[vb]:
            if seqno <= persisted[vb]:
                assert c.get(k, vbucket=vb).value == b"v"
            else:
                with pytest.raises(KeyNotFound):
                    c.get(k, vbucket=vb)
