"""librdkafka client properties, checked by the installed librdkafka itself (docs/configuration.md, "Kafka").

The gateway keeps no copy of librdkafka's property table: :func:`check_properties` builds a throwaway client
configuration through confluent-kafka (a ``Producer`` with no ``bootstrap.servers``: it never connects), so
"No such configuration property", an invalid value or a value out of range come from librdkafka, whatever its
version. :func:`consumer_only` / :func:`producer_only` ask a throwaway producer / consumer which properties it
would ignore (librdkafka's ``CONFWARN`` "is a consumer property and will be ignored by this producer
instance"), so each client gets only the properties that apply to it.

Only the suggestion for a misspelt name ("did you mean ...?") reads librdkafka's own property table, through
``rd_kafka_conf_properties_show``; when that is not reachable there is no suggestion, the check stands.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import difflib
import functools
import logging
import os
import re
import tempfile
from collections.abc import Callable, Mapping
from typing import Any, Final

from confluent_kafka import Consumer, KafkaException, Producer

__all__ = [
    "CLIENT_CALLBACKS",
    "PropertyValue",
    "check_properties",
    "consumer_only",
    "librdkafka_property_names",
    "producer_only",
]

#: A librdkafka property value as confluent-kafka takes it.
PropertyValue = str | int | float | bool

#: confluent-kafka's own (Python-level) configuration keys: callbacks and objects, never librdkafka
#: properties given as text. The Kafka layer sets ``logger`` and ``error_cb`` itself (gateway.kafka.clients).
CLIENT_CALLBACKS: Final = frozenset({
    "logger", "error_cb", "stats_cb", "throttle_cb", "oauth_cb", "on_delivery", "on_commit",
    "default.topic.config",
})

_NO_SUCH = re.compile(r'No such configuration property: "([^"]+)"')
_IGNORED = re.compile(r"Configuration property \S+ is a (consumer|producer) property and will be ignored")
#: properties that would make a throwaway client connect somewhere; the typed settings own them
_CONNECTING: Final = frozenset({"bootstrap.servers", "metadata.broker.list"})


class _Collect:
    """A confluent-kafka ``logger`` that keeps librdkafka's lines (nothing reaches stderr)."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def log(self, level: int, fmt: str, *args: Any) -> None:
        with contextlib.suppress(TypeError, ValueError):
            self.lines.append(fmt % args if args else fmt)


def _error_text(exc: BaseException) -> str:
    err = exc.args[0] if exc.args else exc
    text = err.str() if hasattr(err, "str") else str(err)
    return " ".join(str(text).split())


def _librdkafka_error(properties: Mapping[str, PropertyValue]) -> str | None:
    """librdkafka's complaint about ``properties`` as one client configuration, None when it takes them."""
    conf: dict[str, Any] = {k: v for k, v in properties.items() if k not in _CONNECTING}
    conf["logger"] = _Collect()
    try:
        Producer(conf)
    except KafkaException as exc:
        return _error_text(exc)
    except (TypeError, ValueError) as exc:  # confluent-kafka's own checks of a value's type
        return str(exc)
    return None


def check_properties(
    properties: Mapping[str, PropertyValue], *, secret: Callable[[str], bool] = lambda name: False,
) -> list[tuple[str, str]]:
    """(property, problem) for every property librdkafka refuses: an unknown name (with a suggestion from
    librdkafka's own names), an invalid or out-of-range value. Empty when librdkafka takes them all.

    ``secret(name)``: the value of that property never appears in a problem."""
    problems: list[tuple[str, str]] = []
    rest: dict[str, PropertyValue] = {}
    for name, value in properties.items():
        if name in CLIENT_CALLBACKS:
            problems.append((name, "unknown librdkafka property" + _did_you_mean(name)))
        else:
            rest[name] = value
    if not rest or _librdkafka_error(rest) is None:
        return problems
    # librdkafka stops at the first property it refuses: ask about each one to name them all
    named = False
    for name, value in rest.items():
        text = _librdkafka_error({name: value})
        if text is None:
            continue
        named = True
        if _NO_SUCH.search(text):
            problems.append((name, "unknown librdkafka property" + _did_you_mean(name)))
            continue
        if secret(name):
            text = text.replace(str(value), "**********")
        problems.append((name, f"refused by librdkafka: {text}"))
    if not named:  # each alone is fine, together they are not
        text = _librdkafka_error(rest) or ""
        problems.append(("", f"refused by librdkafka: {text}"))
    order = {name: i for i, name in enumerate(properties)}
    return sorted(problems, key=lambda p: order.get(p[0], len(order)))


#: (client kind, property name) -> ignored by that kind of client; a property's scope is librdkafka's, not
#: its value's, so one answer per name (bounded by librdkafka's property count)
_ROLES: dict[tuple[str, str], bool] = {}


def _ignored(kind: str, name: str, value: PropertyValue) -> bool:
    """Whether a ``kind`` client ("producer" / "consumer") ignores the property."""
    known = _ROLES.get((kind, name))
    if known is None:
        known = _ask_ignored(kind, name, value)
        if known is not None:
            _ROLES[(kind, name)] = known
    return bool(known)


def _ask_ignored(kind: str, name: str, value: PropertyValue) -> bool | None:
    """A throwaway client's answer; None when librdkafka refuses the value (the real client will say why)."""
    log = _Collect()
    conf: dict[str, Any] = {name: value, "logger": log}
    try:
        if kind == "producer":
            Producer(conf).poll(0)  # poll serves the log queue: the CONFWARN lines
        else:
            conf.setdefault("group.id", "dcpgw-property-check")
            c = Consumer(conf)
            c.poll(0)
            c.close()
    except (KafkaException, TypeError, ValueError):
        return None
    other = "consumer" if kind == "producer" else "producer"
    return any((m := _IGNORED.search(line)) is not None and m.group(1) == other for line in log.lines)


def consumer_only(properties: Mapping[str, PropertyValue]) -> frozenset[str]:
    """The names among ``properties`` that librdkafka's producers ignore (consumer-only properties)."""
    return frozenset(k for k, v in properties.items()
                     if k not in CLIENT_CALLBACKS and k not in _CONNECTING and _ignored("producer", k, v))


def producer_only(properties: Mapping[str, PropertyValue]) -> frozenset[str]:
    """The names among ``properties`` that librdkafka's consumers ignore (producer-only properties)."""
    return frozenset(k for k, v in properties.items()
                     if k not in CLIENT_CALLBACKS and k not in _CONNECTING and _ignored("consumer", k, v))


# ------------------------------------------------------------------------------------------------ names
@functools.lru_cache(maxsize=1)
def librdkafka_property_names() -> frozenset[str]:
    """Every property name of the installed librdkafka (its ``rd_kafka_conf_properties_show`` table);
    empty when the library's C interface is not reachable from here. Used for suggestions only."""
    try:
        from confluent_kafka import cimpl

        lib = ctypes.CDLL(cimpl.__file__)  # its symbols resolve through to the librdkafka it links
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.fopen.restype = ctypes.c_void_p
        libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
        libc.fclose.argtypes = [ctypes.c_void_p]
        show = lib.rd_kafka_conf_properties_show
        show.argtypes = [ctypes.c_void_p]
        fd, path = tempfile.mkstemp(prefix="dcpgw-librdkafka-")
        os.close(fd)
        try:
            fp = libc.fopen(os.fsencode(path), b"w")
            if not fp:
                return frozenset()
            show(fp)
            libc.fclose(fp)
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read()
        finally:
            os.unlink(path)
    except (OSError, AttributeError, ImportError, TypeError):
        logging.getLogger(__name__).debug("librdkafka's property table is not reachable", exc_info=True)
        return frozenset()
    names = set()
    for line in text.splitlines():
        name, sep, _ = line.partition("|")
        name = name.strip()
        if "see dedicated API" in line:  # callbacks and pointers: not settable as text
            continue
        if sep and name and " " not in name and not name.startswith("-") and name != "Property":
            names.add(name)
    return frozenset(names)


def _did_you_mean(name: str) -> str:
    candidates = sorted(librdkafka_property_names() - CLIENT_CALLBACKS)
    close = difflib.get_close_matches(name, candidates, n=3, cutoff=0.6)
    return f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
