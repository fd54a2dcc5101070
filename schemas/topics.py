"""Topic and partition naming of the record contract (docs/record-format.md "Topic and partitions")."""

from __future__ import annotations

from typing import Final

from schemas.errors import InvalidArgument

__all__ = ["DEFAULT_TOPIC_PREFIX", "partition_for", "topic_name"]

DEFAULT_TOPIC_PREFIX: Final = "dcp"


def topic_name(prefix: str, bucket: str) -> str:
    """The topic of ``bucket``: ``{prefix}.{bucket}`` (the default prefix is ``dcp``).

    Raises :class:`InvalidArgument` when the result is not a legal Kafka topic name.
    """
    if not prefix or not bucket:
        raise InvalidArgument(f"topic prefix and bucket must be non-empty (prefix={prefix!r}, bucket={bucket!r})")
    name = f"{prefix}.{bucket}"
    if len(name) > 249 or any(not (c.isascii() and (c.isalnum() or c in "._-")) for c in name):
        raise InvalidArgument(
            f"{name!r} is not a valid Kafka topic name (at most 249 of the characters a-z A-Z 0-9 . _ -)"
        )
    return name


def partition_for(vbucket: int, num_partitions: int) -> int:
    """The partition of ``vbucket``: ``vbucket`` itself, or ``vbucket mod num_partitions`` when the topic has
    fewer partitions than the bucket has vbuckets (consumers then demultiplex by ``dcp.vbucket``)."""
    if num_partitions < 1:
        raise InvalidArgument(f"a topic has at least one partition, got {num_partitions}")
    if vbucket < 0:
        raise InvalidArgument(f"vbucket must be >= 0, got {vbucket}")
    return vbucket % num_partitions

