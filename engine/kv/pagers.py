"""The expiry pager (kv_engine ``ExpiredItemPager``): turns every expired document into an expiration.

kv_engine's item pager (value eviction) has no counterpart: every current document stays resident
(docs/engine.md "No value eviction"). Checkpoint memory is recovered by engine/kv/memory_recovery.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from engine.kv.vbucket import VBucket


class ExpiryPager:
    """Expires the documents of ``vbuckets`` whose expiry passed by ``clock``."""

    def __init__(self, vbuckets: Sequence[VBucket], clock: Callable[[], float]) -> None:
        self.vbuckets = vbuckets
        self.clock = clock

    def run(self) -> int:
        """One pass over every vbucket; returns how many documents expired."""
        now = self.clock()
        return sum(vb.expire_items(now) for vb in self.vbuckets)


__all__ = ["ExpiryPager"]
