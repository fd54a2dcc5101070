"""A gateway topic written by an in-process engine + publisher on the test broker (shared by the gateway,
client and Spark tests)."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Protocol, TypeVar

from engine import Bucket, BucketConfig
from engine.cluster.local import Cluster
from gateway.broker import Broker
from gateway.publisher import Publisher
from gateway.resume import ensure_topics, recover_positions
from schemas.codec import RecordEncoder
from schemas.records import ValueFormat
from tests.gateway.kafka_util import TopicChecks

#: vbuckets of a ClusterHarness
CLUSTER_NVB = 8


def process_gone(pid: int, timeout: float = 30.0) -> bool:
    """``pid`` ended within ``timeout`` (it no longer exists, or is a zombie of ours)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ")[-1].startswith("Z"):
                    return True
        except (ProcessLookupError, FileNotFoundError):
            return True
        time.sleep(0.02)
    return False


def producer_conf(broker: Broker) -> dict[str, Any]:
    return {"bootstrap.servers": broker.bootstrap_servers, "enable.idempotence": True, "acks": "all",
            "linger.ms": 5}


class Harness:
    def __init__(self, broker: Broker, tmp: Path, nvb: int = 8, partitions: int | None = None,
                 clock: Callable[[], float] | None = None, **pub_kw: Any) -> None:
        self.broker = broker
        #: the engine's clock (expiry): None for the real one
        self.bucket_kw: dict[str, Any] = {} if clock is None else {"clock": clock}
        self.nvb = nvb
        self.client = {"bootstrap.servers": broker.bootstrap_servers}
        self.topic = f"dcp.c{uuid.uuid4().hex[:10]}"
        self.cfg = BucketConfig(data_dir=tmp / "data", num_vbuckets=nvb, seed=None)
        self.bucket = Bucket(self.cfg, **self.bucket_kw)
        # fewer partitions than vbuckets: vbucket v goes to partition v mod P
        self.partitions = ensure_topics(self.client, self.topic, partitions or nvb)
        self.pub_kw = pub_kw
        self.old: list[Publisher] = []
        self.pub: Publisher = self.new_publisher()

    def new_publisher(self, **kw: Any) -> Publisher:
        prev = getattr(self, "pub", None)
        if prev is not None:
            self.old.append(prev)  # replaced (or abandoned, as after kill -9): closed at teardown
        positions = recover_positions(self.client, self.topic, self.partitions, self.nvb)
        args = {**self.pub_kw, **kw}
        fmt = args.pop("value_format", ValueFormat.AVRO)
        p = Publisher(self.bucket, producer_conf(self.broker), self.topic, self.partitions, RecordEncoder(fmt),
                      positions, **args)
        p.open()
        return p

    def settle(self, rounds: int = 10_000) -> None:
        for _ in range(rounds):
            n = self.pub.pump()
            if n == 0 and self.pub.inflight == 0 and not self.bucket.dirty_vbuckets:
                return
            if n == 0:
                self.pub.kafka.poll(0.01)
        raise AssertionError("publisher never settled")

    def publish_unpersisted(self, rounds: int = 50) -> None:
        for _ in range(rounds):
            self.pub.pump()
        self.pub.flush(10)
        self.pub.kafka.flush(10)

    def crash_engine(self) -> None:
        """kill -9 of engine and gateway: unpersisted items are lost; a new publisher recovers from Kafka."""
        self.pub.kafka.flush(10)
        self.bucket.close(clean=False)
        self.bucket = Bucket(self.cfg, **self.bucket_kw)
        self.pub = self.new_publisher()

    def restart_gateway(self) -> None:
        self.pub.kafka.flush(10)
        self.pub = self.new_publisher()

    def close(self) -> None:
        for old in self.old:
            old.kafka.flush(1)
        self.old.clear()
        self.pub.close(timeout=5)
        if not self.bucket.closed:
            self.bucket.close(clean=False)


def write(bucket: Bucket, n: int, prefix: str = "k", start: int = 0) -> None:
    for i in range(start, start + n):
        bucket.set(f"{prefix}{i}", f'{{"n": {i}}}'.encode())
        if i % 5 == 0:
            bucket.delete(f"{prefix}{i}")


class ClusterHarness(TopicChecks):
    """Three nodes, one replica, one gateway publisher following the map into a fresh topic."""

    def __init__(self, broker: Broker, tmp: Path, *, nodes: int = 3, replicas: int = 1, **pub_kw: Any) -> None:
        self.broker = broker
        self.tmp = tmp
        self.cluster = Cluster.create(tmp / "cluster", nodes=nodes, replicas=replicas, num_vbuckets=CLUSTER_NVB)
        self.client = {"bootstrap.servers": broker.bootstrap_servers}
        self.topic = f"dcp.cl{uuid.uuid4().hex[:10]}"
        self.partitions = ensure_topics(self.client, self.topic, CLUSTER_NVB)
        self.pub_kw = pub_kw
        self.old: list[Publisher] = []
        self.pub = self.new_publisher()
        self.written = 0

    def new_publisher(self) -> Publisher:
        positions = recover_positions(self.client, self.topic, self.partitions, CLUSTER_NVB)
        p = Publisher(self.cluster, producer_conf(self.broker), self.topic, self.partitions,
                      self.pub_kw.get("encoder") or RecordEncoder(ValueFormat.AVRO), positions,
                      **{k: v for k, v in self.pub_kw.items() if k != "encoder"})
        p.open()
        return p

    def write(self, n: int, prefix: str = "k") -> None:
        """``n`` writes through the map (every fifth key of the batch is deleted again)."""
        for i in range(self.written, self.written + n):
            self.cluster.write(f"{prefix}{i % 150}", f'{{"n": {i}}}'.encode())
            if i % 5 == 0:
                self.cluster.delete(f"{prefix}{i % 150}")
        self.written += n

    def publish(self, rounds: int = 20_000) -> None:
        """Pump the publisher (not replication) until it has nothing left to send and Kafka acknowledged all."""
        for _ in range(rounds):
            n = self.pub.pump()
            if n == 0 and self.pub.inflight == 0:
                return
            if n == 0:
                self.pub.kafka.poll(0.01)
        raise AssertionError("publisher never settled")

    def settle(self) -> None:
        """Replication and publishing until both are idle (mitigation waits for the replicas' persistence)."""
        for _ in range(1000):
            self.cluster.settle()
            self.publish()
            if self.pub.held == 0 and not self.cluster.pump(rounds=4):
                self.publish()
                return
        raise AssertionError("cluster + gateway never settled")

    def actives(self) -> dict[bytes, tuple[bytes, int]]:
        """Every live document of the cluster, read from each vbucket's active node."""
        out: dict[bytes, tuple[bytes, int]] = {}
        for name in sorted(self.cluster.nodes):
            node = self.cluster.nodes[name]
            if node.up and node.bucket is not None:
                out.update(node.bucket.state_snapshot())
        return out

    def close(self) -> None:
        self.pub.close(timeout=5)
        self.cluster.close()


def _encoder() -> Any:
    from schemas.codec import RecordEncoder

    return RecordEncoder(ValueFormat.AVRO)


class _Closable(Protocol):
    def close(self) -> None: ...


H = TypeVar("H", bound=_Closable)


@contextmanager
def harnesses(broker: Broker, tmp: Path, cls: Callable[..., H], prefix: str = "h") -> Iterator[Callable[..., H]]:
    """A factory of harnesses ``cls(broker, folder, **kw)`` (each in its own folder under ``tmp``), all closed on
    exit: the body of the ``harness`` and ``cluster_harness`` fixtures (tests/conftest.py,
    tests/gateway/conftest.py, and the subclasses' fixtures)."""
    made: list[H] = []

    def make(**kw: Any) -> H:
        h = cls(broker, tmp / f"{prefix}{len(made)}", **kw)
        made.append(h)
        return h

    try:
        yield make
    finally:
        with ExitStack() as closing:  # every harness is closed, also when closing an earlier one failed
            for h in reversed(made):
                closing.callback(h.close)
