"""Replication filters (docs/xdcr.md "Filters"): a key regex and skipping deletions, expirations or binary
documents, as goxdcr's filter expression and its ``filterBypassExpiry`` / ``filterDeletion`` /
``filterBinary`` settings. A filter change is an explicit choice: restream from zero, or apply the new filter
from the current positions on."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from connectors.client.replay import Change
from connectors.xdcr.errors import FilterChanged, XdcrError
from schemas.records import RecordType

__all__ = ["Filters", "settle_filter_change"]

#: datatype bit JSON (kv_engine): a document without it is binary
_JSON = 0x01


@dataclass(frozen=True)
class Filters:
    key_regex: str | None = None
    skip_deletions: bool = False
    skip_expirations: bool = False
    skip_binary: bool = False
    _rx: re.Pattern[str] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.key_regex is not None:
            try:
                object.__setattr__(self, "_rx", re.compile(self.key_regex))
            except re.error as e:
                raise XdcrError(f"--filter-key {self.key_regex!r} is not a valid regular expression: {e}") from e

    def fingerprint(self) -> str:
        return json.dumps({"key_regex": self.key_regex, "skip_deletions": self.skip_deletions,
                           "skip_expirations": self.skip_expirations, "skip_binary": self.skip_binary},
                          sort_keys=True)

    def passes(self, ch: Change) -> bool:
        return self.passes_change(ch.key, ch.type, ch.datatype)

    def passes_change(self, key: bytes, t: RecordType | str, datatype: int) -> bool:
        """A change of type ``t`` (mutation / deletion / expiration) of ``key`` with ``datatype``: replicated?"""
        if t == RecordType.DELETION and self.skip_deletions:
            return False
        if t == RecordType.EXPIRATION and self.skip_expirations:
            return False
        if self.skip_binary and t == RecordType.MUTATION and not datatype & _JSON:
            return False
        return self.passes_key(key)

    def passes_key(self, key: bytes) -> bool:
        return self._rx is None or self._rx.search(key.decode("utf-8", "surrogateescape")) is not None


def settle_filter_change(previous: str | None, current: Filters, has_state: bool, restream: bool | None,
                         where: str) -> bool:
    """Started with ``current`` filters where ``previous`` (a fingerprint, None: never recorded) replicated
    ``where``: True when everything must be replicated again (``restream``), False to go on from the current
    positions; :class:`FilterChanged` when the filters changed over existing positions and ``restream`` is None
    (goxdcr asks the same question when a replication's filter is edited)."""
    fp = current.fingerprint()
    if previous is None or previous == fp or not has_state:
        return False
    if restream is None:
        raise FilterChanged(
            f"the filters changed since {where} was replicated ({previous} -> {fp}): pass --restream "
            "to replicate everything again under the new filters, or --no-restream to apply them from the "
            "current positions on")
    return restream
