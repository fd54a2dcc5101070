"""Property tests (hypothesis): random histories of writes, flushes, streams, consumer restarts, compaction
and engine crashes. A consumer that applies whole snapshots only always converges to the engine's state."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import Bucket, BucketConfig, KeyNotFound
from tests.engine.dcp_model import SnapshotConsumer

KEYS = [f"k{i}" for i in range(12)]

op = st.one_of(
    st.tuples(st.just("set"), st.sampled_from(KEYS), st.binary(min_size=0, max_size=8)),
    st.tuples(st.just("delete"), st.sampled_from(KEYS)),
    st.tuples(st.just("flush")),
    st.tuples(st.just("stream"), st.integers(min_value=0, max_value=6)),
    st.tuples(st.just("consumer_restart")),
    st.tuples(st.just("compact")),
    st.tuples(st.just("crash")),
    st.tuples(st.just("clean_restart")),
    st.tuples(st.just("memory_pressure")),
)


class Harness:
    def __init__(self, data_dir: Path, use_client_log: bool) -> None:
        self.cfg: dict[str, Any] = {
            "data_dir": data_dir, "num_vbuckets": 3, "seed": 11, "checkpoint_max_items": 4,
            "history_seqnos": 5, "tombstone_purge_age_s": 0, "backfill_chunk_items": 3,
            "checkpoint_quota_bytes": 64 * 1024,
        }
        self.bucket = Bucket(BucketConfig(**self.cfg))
        self.consumer = SnapshotConsumer([0, 1, 2], use_client_log=use_client_log)
        self.producer = self.bucket.dcp_producer("prop")
        self.n = 0

    def reopen(self, clean: bool) -> None:
        self.bucket.close(clean=clean)
        self.bucket = Bucket(BucketConfig(**self.cfg))
        self.consumer.disconnect()
        self.new_producer()

    def new_producer(self) -> None:
        self.n += 1
        self.producer = self.bucket.dcp_producer(f"prop{self.n}")

    def stream(self, steps: int) -> None:
        self.consumer.open_streams(self.producer)
        for _ in range(steps):
            msgs = self.producer.step(max_messages=5)
            if not msgs:
                break
            for m in msgs:
                self.consumer.handle(m)
            self.producer.buffer_acknowledge(sum(m.dcp_size for m in msgs))

    def run(self, ops: list[tuple[Any, ...]]) -> None:
        b = self.bucket
        for o in ops:
            b = self.bucket
            kind = o[0]
            if kind == "set":
                b.set(o[1], o[2])
            elif kind == "delete":
                with contextlib.suppress(KeyNotFound):
                    b.delete(o[1])
            elif kind == "flush":
                b.flush()
            elif kind == "stream":
                self.stream(o[1])
            elif kind == "consumer_restart":
                self.consumer.disconnect()
                self.new_producer()
            elif kind == "compact":
                b.flush()
                b.compact()
            elif kind == "crash":
                self.reopen(clean=False)
            elif kind == "clean_restart":
                self.reopen(clean=True)
            elif kind == "memory_pressure":
                for c in b.vbuckets():
                    for name in list(c.ckpt.cursors):
                        if c.ckpt.drop_cursor(name):
                            for s in c.streams:
                                s.notify()
        # final catch-up
        self.stream(100_000)
        assert self.consumer.state() == self.bucket.state_snapshot()
        self.bucket.close()


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(op, max_size=60), use_client_log=st.booleans())
def test_consumer_converges_to_engine_state(tmp_path_factory, ops, use_client_log) -> None:
    d = tmp_path_factory.mktemp("prop")
    Harness(d, use_client_log).run(ops)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(op, max_size=60))
def test_every_stream_obeys_snapshot_and_order_invariants(tmp_path_factory, ops) -> None:
    # SnapshotConsumer.handle asserts: items inside their marker, strictly increasing seqnos, no duplicate key
    # within a snapshot, no marker inside an incomplete snapshot. A fresh consumer from zero at the end also
    # converges (full backfill of whatever history survived).
    d = tmp_path_factory.mktemp("inv")
    h = Harness(d, True)
    h.run(ops)
    b = Bucket(BucketConfig(**h.cfg))
    fresh = SnapshotConsumer([0, 1, 2])
    p = b.dcp_producer("fresh")
    fresh.open_streams(p)
    fresh.drain(p)
    assert fresh.state() == b.state_snapshot()
    b.close()
