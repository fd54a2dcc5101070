"""The engine operations the KV port added (engine/bucket.py ``append`` / ``arithmetic`` / ``store`` /
``get_and_touch`` / ``get_locked`` / ``unlock``, engine/kv/locks.py) over random histories against a model:
each accepted write is one new seqno and the document the model says; each refused one changes nothing; locks
queue nothing; what the engine holds survives a restart (the writes went through the checkpoint and the
flusher like any other)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from engine import Bucket, BucketConfig
from engine.exceptions import EngineError
from engine.kv.durability import Durability, Level
from engine.kv.vbucket import StoreMode

KEYS = [b"a", b"b", b"c"]
U64 = (1 << 64) - 1

op = st.one_of(
    st.tuples(st.just("set"), st.sampled_from(KEYS), st.binary(max_size=6)),
    st.tuples(st.just("add"), st.sampled_from(KEYS), st.binary(max_size=6)),
    st.tuples(st.just("replace"), st.sampled_from(KEYS), st.binary(max_size=6)),
    st.tuples(st.just("append"), st.sampled_from(KEYS), st.binary(max_size=4)),
    st.tuples(st.just("prepend"), st.sampled_from(KEYS), st.binary(max_size=4)),
    st.tuples(st.just("incr"), st.sampled_from(KEYS), st.integers(0, U64)),
    st.tuples(st.just("decr"), st.sampled_from(KEYS), st.integers(0, 50)),
    st.tuples(st.just("delete"), st.sampled_from(KEYS), st.none()),
    st.tuples(st.just("touch"), st.sampled_from(KEYS), st.integers(0, 1000)),
    st.tuples(st.just("lock"), st.sampled_from(KEYS), st.none()),
    st.tuples(st.just("unlock"), st.sampled_from(KEYS), st.none()),
    st.tuples(st.just("durable_set"), st.sampled_from(KEYS), st.binary(max_size=6)),
)


def _model_step(model: dict[bytes, bytes], locks: dict[bytes, int], name: str, key: bytes,
                arg: Any) -> tuple[bool, bytes | None]:
    """(whether the model accepts it as a write, the new value or None for a delete)."""
    cur = model.get(key)
    if key in locks and name not in ("lock", "unlock"):
        return False, None  # the history writes without the lock's CAS: LOCKED
    if name in ("set", "durable_set"):
        return True, arg
    if name == "add":
        return cur is None, arg
    if name in ("replace", "touch"):
        return cur is not None, cur if name == "touch" else arg
    if name in ("append", "prepend"):
        if cur is None:
            return False, None
        return True, cur + arg if name == "append" else arg + cur
    if name in ("incr", "decr"):
        if cur is None:
            return True, b"0"  # created with initial 0
        if not cur.isdigit() or len(cur) > 20 or int(cur) > U64:
            return False, None
        n = int(cur)
        return True, str((n + arg) & U64 if name == "incr" else max(0, n - arg)).encode()
    if name == "delete":
        return cur is not None, None
    return False, None


@settings(max_examples=60, deadline=None)
@given(st.lists(op, max_size=40))
def test_random_histories_match_the_model(history: list[tuple[str, bytes, Any]]) -> None:
    with tempfile.TemporaryDirectory() as d:
        cfg = BucketConfig(data_dir=Path(d), num_vbuckets=4, seed=1)
        b = Bucket(cfg)
        model: dict[bytes, bytes] = {}
        locks: dict[bytes, int] = {}
        try:
            for name, key, arg in history:
                vb = b.vbucket(b.vbucket_of(key))
                before = vb.high_seqno
                expect_write, new = _model_step(model, locks, name, key, arg)
                try:
                    if name == "set":
                        b.set(key, arg)
                    elif name == "durable_set":
                        sw = b.store(key, arg, StoreMode.SET, durability=Durability(Level.MAJORITY))
                        assert not isinstance(sw, tuple) and sw.committed
                    elif name in ("add", "replace"):
                        b.store(key, arg, StoreMode.ADD if name == "add" else StoreMode.REPLACE)
                    elif name in ("append", "prepend"):
                        b.append(key, arg, prepend=name == "prepend")
                    elif name in ("incr", "decr"):
                        _r, n = b.arithmetic(key, arg, decrement=name == "decr")
                        assert str(n).encode() == new
                    elif name == "delete":
                        b.delete(key)
                    elif name == "touch":
                        b.touch(key, arg)
                    elif name == "lock":
                        g = b.get_locked(key, 10)
                        assert key not in locks and key in model
                        locks[key] = g.cas
                    elif name == "unlock":
                        b.unlock(key, locks.pop(key))
                    ok = True
                except (EngineError, KeyError):
                    ok = False
                if name in ("lock", "unlock"):
                    assert vb.high_seqno == before  # a lock is no mutation
                    continue
                assert ok == expect_write, (name, key, arg, model, locks)
                if ok:
                    # one seqno per write (two for a sync write: its prepare and its commit)
                    assert vb.high_seqno == before + (2 if name == "durable_set" else 1)
                    if new is None:
                        model.pop(key, None)
                    else:
                        model[key] = new
                else:
                    assert vb.high_seqno == before
            state = {k: v for k, (v, _vb) in b.state_snapshot().items()}
            assert state == model
        finally:
            b.close()
        again = Bucket(cfg)  # warmup from what the flusher persisted
        try:
            assert {k: v for k, (v, _vb) in again.state_snapshot().items()} == model
        finally:
            again.close()
