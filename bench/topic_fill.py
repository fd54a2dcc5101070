"""The source topic of a consumer-side benchmark (bench.client, bench.xdcr, bench.search): an engine bucket (1024
vbuckets unless told) fills it through the gateway's publisher (Avro records, mitigation off: publishing from memory).

:func:`fill_topic` writes ``docs`` into a fresh bucket, publishes every record and waits for every acknowledgement;
``inspect`` sees the bucket before it closes (bench.xdcr keeps each document's metadata)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

NVB = 1024


def fill_topic(conf: dict[str, Any], client: dict[str, Any], tmp: Path, name: str,
               docs: Iterable[tuple[bytes | str, bytes]], *, num_vbuckets: int = NVB, pump_every: int = 0,
               inspect: Callable[[Any], T] | None = None) -> tuple[str, T | None]:
    """Topic ``bench-<name>-<random>`` (one partition per vbucket) holding ``docs``; ``pump_every`` > 0 publishes after that many writes
    (bounds the checkpoints' memory for large runs). Returns the topic and what ``inspect(bucket)`` returned."""
    from engine import Bucket, BucketConfig
    from gateway.publisher import Publisher
    from gateway.resume import PublishPosition, ensure_topics
    from schemas.codec import RecordEncoder
    from schemas.records import ValueFormat

    b = Bucket(BucketConfig(data_dir=tmp / "engine", num_vbuckets=num_vbuckets, checkpoint_quota_bytes=2 << 30))
    topic = f"bench-{name}-{uuid.uuid4().hex[:8]}"
    parts = ensure_topics(client, topic, num_vbuckets)
    pub = Publisher(b, conf, topic, parts, RecordEncoder(ValueFormat.AVRO),
                    {vb: PublishPosition(vb) for vb in range(num_vbuckets)}, rollback_mitigation=False)
    pub.open()
    for i, (k, v) in enumerate(docs, 1):
        b.set(k, v)
        if pump_every and i % pump_every == 0:
            while pub.pump():
                pass
    while True:
        if not pub.pump():
            if pub.inflight == 0:
                break
            pub.kafka.poll(0.005)
    pub.close()
    kept = inspect(b) if inspect is not None else None
    b.close(clean=False)
    return topic, kept


__all__ = ["NVB", "fill_topic"]
