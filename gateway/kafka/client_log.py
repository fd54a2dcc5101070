"""librdkafka's log lines and client errors, rate-limited, for every Kafka client the gateway builds.

librdkafka repeats the same line for every reconnect attempt (``Connect to ipv4#127.0.0.1:1 failed: Connection
refused``, several a second per broker and client). :class:`ClientLog` is the confluent-kafka ``logger`` and
``error_cb`` of the gateway's producers, consumers and admin clients: it logs the first occurrence of each
distinct message through Python logging, then only a count of its repetitions once per ``interval_s``
(docs/reliability.md, "Start-up failures and command-line errors"). Messages that differ only in librdkafka's
timing details (``after 25ms in state UP``, ``3 identical error(s) suppressed``) count as the same message.

It also remembers the last error of each client, which :func:`gateway.resume.wait_for_kafka` uses to say
which address failed.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["DEFAULT_INTERVAL_S", "ClientLog", "with_client_log"]

#: Seconds between two "repeated N times" lines of one message.
DEFAULT_INTERVAL_S = 30.0
#: Distinct messages remembered; beyond it the oldest is forgotten (logged again when it recurs).
_MAX_KEYS = 1024

_TIMING = re.compile(r"\s*\((?:after \d+ms in state \w+)?(?:, )?(?:\d+ identical error\(s\) suppressed)?\)")


_BROKERS_DOWN = re.compile(r"\d+/\d+ brokers are down")


def _normalise(message: str) -> str:
    return _BROKERS_DOWN.sub("N/M brokers are down", _TIMING.sub("", message)).strip()


class ClientLog:
    """A confluent-kafka ``logger`` (``log(level, fmt, *args)``) and ``error_cb`` that rate-limits repeats.

    Thread-safe: librdkafka's log lines are served by whichever thread polls the client.
    """

    def __init__(self, logger: logging.Logger | None = None, *, interval_s: float = DEFAULT_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic, quiet: bool = False) -> None:
        self.logger = logger or logging.getLogger("gateway.kafka")
        self.interval_s = interval_s
        self._clock = clock
        #: collect only (errors kept for :attr:`last_error`, nothing logged): a connection probe
        self.quiet = quiet
        self._lock = threading.Lock()
        #: normalised message -> [window start, repeats in this window, level of the last repeat]
        self._seen: dict[str, list[float]] = {}
        #: the newest client error (librdkafka's text, timing details removed); None before any
        self.last_error: str | None = None
        #: lines actually emitted / repeats swallowed (for tests and metrics)
        self.emitted = 0
        self.suppressed = 0

    # confluent-kafka calls logger.log(level, "%s [%s] %s", facility, client name, message)
    def log(self, level: int, fmt: str, *args: Any) -> None:
        try:
            message = fmt % args if args else fmt
        except (TypeError, ValueError):
            message = f"{fmt} {args!r}"
        self._emit(level, message)

    def error_cb(self, err: Any) -> None:
        """confluent-kafka ``error_cb``: client-level errors (transport failures, all brokers down)."""
        text = err.str() if hasattr(err, "str") else str(err)
        if not _BROKERS_DOWN.search(text):  # keep the error that names an address
            with self._lock:
                self.last_error = _TIMING.sub("", text).strip()
        fatal = bool(getattr(err, "fatal", lambda: False)())
        self._emit(logging.ERROR if fatal else logging.WARNING, f"kafka client error: {text}")

    def _emit(self, level: int, message: str) -> None:
        key = _normalise(message)
        now = self._clock()
        with self._lock:
            entry = self._seen.get(key)
            if entry is None:
                if len(self._seen) >= _MAX_KEYS:
                    self._seen.pop(next(iter(self._seen)))
                self._seen[key] = [now, 0, level]
                line = message
            else:
                entry[1] += 1
                entry[2] = level
                if now - entry[0] < self.interval_s:
                    self.suppressed += 1
                    return
                line = f"{key} (repeated {int(entry[1])} times in the last {now - entry[0]:.0f}s)"
                entry[0], entry[1] = now, 0
            self.emitted += 1
        if not self.quiet:
            self.logger.log(level, "%s", line)


    def flush_due(self) -> int:
        """Log the count of every message whose window has ended with repeats not yet logged (call it
        periodically: without it a count is only logged when the message occurs again after the window).
        Returns the lines logged."""
        return self._flush(due_only=True)

    def flush(self) -> int:
        """Log every pending repeat count now, whatever its window (when the client or service stops)."""
        return self._flush(due_only=False)

    def _flush(self, *, due_only: bool) -> int:
        now = self._clock()
        lines: list[tuple[int, str]] = []
        with self._lock:
            for key, entry in self._seen.items():
                if entry[1] <= 0 or (due_only and now - entry[0] < self.interval_s):
                    continue
                lines.append((int(entry[2]), f"{key} (repeated {int(entry[1])} times in the last "
                                             f"{max(0.0, now - entry[0]):.0f}s)"))
                entry[0], entry[1] = now, 0
            self.emitted += len(lines)
        if not self.quiet:
            for level, line in lines:
                self.logger.log(level, "%s", line)
        return len(lines)


def with_client_log(config: Mapping[str, Any], client_log: ClientLog) -> dict[str, Any]:
    """``config`` plus ``logger`` and ``error_cb`` of ``client_log`` (kept when the caller set its own)."""
    out = dict(config)
    out.setdefault("logger", client_log)
    out.setdefault("error_cb", client_log.error_cb)
    return out
