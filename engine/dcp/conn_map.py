"""The bucket's DCP connections (kv_engine ``DcpConnMap``): named producer connections, one per name.

Opening a connection under a name in use closes the old one first (kv_engine: a new connection with an
existing name replaces it); a connection that closes leaves the map.
"""

from __future__ import annotations

from engine.dcp.producer import DcpProducer, ProducerBucket


class DcpConnMap:
    """The DCP producer connections of ``bucket``, by name."""

    def __init__(self, bucket: ProducerBucket) -> None:
        self.bucket = bucket
        self.producers: dict[str, DcpProducer] = {}

    def __len__(self) -> int:
        return len(self.producers)

    def new_producer(self, name: str, *, buffer_size: int = 0) -> DcpProducer:
        """Open a named producer connection; an existing connection of that name is closed first."""
        old = self.producers.pop(name, None)
        if old is not None:
            old.close()
        p = DcpProducer(self.bucket, name, buffer_size=buffer_size)
        self.producers[name] = p
        return p

    def close(self, name: str) -> None:
        """Close the connection ``name`` (if open)."""
        p = self.producers.pop(name, None)
        if p is not None:
            p.close()

    def disconnected(self, producer: DcpProducer) -> None:
        """``producer`` closed: it leaves the map (unless a newer connection took its name)."""
        if self.producers.get(producer.name) is producer:
            del self.producers[producer.name]

    def close_all(self) -> None:
        """Disconnect every connection (the bucket closes)."""
        for p in list(self.producers.values()):
            p.close()
        self.producers.clear()


__all__ = ["DcpConnMap"]
