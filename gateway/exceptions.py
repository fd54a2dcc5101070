"""Exceptions of the gateway, rooted at the product-wide :class:`schemas.errors.DcpGatewayError`.

:class:`RecordFormatError` and :class:`UnknownSchemaError` are the record contract's (:mod:`schemas.errors`),
re-exported here.

``retriable`` follows the engine's convention: a retriable error may succeed if the caller simply tries
again later (a broker that is down now may be up in a moment); a non-retriable one will not.
"""

from __future__ import annotations

from schemas.errors import DcpGatewayError, RecordFormatError, UnknownSchemaError

__all__ = [
    "BrokerError",
    "BrokerStartError",
    "ConfigError",
    "DcpGatewayError",
    "GatewayError",
    "InvariantViolation",
    "RecordFormatError",
    "UnknownSchemaError",
]


class GatewayError(DcpGatewayError):
    """Root of every error raised by the gateway package."""


class BrokerError(GatewayError):
    """The Kafka-protocol broker could not be reached or managed. Retriable: brokers come back."""

    retriable = True


class BrokerStartError(BrokerError):
    """A broker this process manages (embedded Tansu, testcontainers Kafka) did not start or get ready."""

    def __init__(self, message: str, log_path: object = None) -> None:
        super().__init__(message)
        #: the broker's log file, when there is one (its tail is also in the message)
        self.log_path = log_path


class InvariantViolation(GatewayError):
    """A partition's records break an ordering / snapshot invariant of the record format
    (:func:`gateway.invariants.check_partition`)."""

    def __init__(self, message: str, vbucket: int | None = None, seqno: int | None = None,
                 offset: int | None = None) -> None:
        super().__init__(message)
        self.vbucket = vbucket
        self.seqno = seqno
        self.offset = offset


class ConfigError(GatewayError):
    """Invalid settings: a bad value, an unknown setting, a missing, unreadable or malformed config file.

    ``problems`` lists ``(field_path, problem)`` pairs; ``field_path`` is dotted (``http_port``,
    ``kafka.sasl_mechanism``, ``kafka.extra["socket.timeout.ms"]``) and empty for a problem that concerns no
    single field (an unreadable file). The message names every problem, one per line, and never contains a
    secret value. Not retriable: the configuration has to be fixed.
    """

    def __init__(self, problems: str | list[tuple[str, str]], *, source: str | None = None) -> None:
        if isinstance(problems, str):
            problems = [("", problems)]
        self.problems: list[tuple[str, str]] = list(problems)
        #: where the settings came from, for the message header (e.g. "config file /etc/dcpgw.toml")
        self.source = source
        super().__init__(self._render())

    @property
    def fields(self) -> list[str]:
        """The dotted paths of the invalid fields, in message order (problems without a field omitted)."""
        return [path for path, _ in self.problems if path]

    def _render(self) -> str:
        where = f" ({self.source})" if self.source else ""
        lines = [f"{path}: {problem}" if path else problem for path, problem in self.problems]
        if len(lines) == 1:
            return f"invalid dcp-gateway configuration{where}: {lines[0]}"
        head = f"invalid dcp-gateway configuration{where}, {len(lines)} problems:"
        return "\n".join([head, *(f"  {line}" for line in lines)])


class Backpressure(GatewayError):
    """Too many accepted writes wait for Kafka's acknowledgement (``max_unacked_bytes``): retry later (HTTP 503
    with ``Retry-After``; docs/reliability.md "Stalled broker and health")."""

    def __init__(self, unacked_bytes: int, limit: int) -> None:
        super().__init__(f"{unacked_bytes} bytes of accepted writes are not yet acknowledged by Kafka "
                         f"(max_unacked_bytes {limit}); retry later")
        self.unacked_bytes = unacked_bytes
        self.limit = limit


class StartupInterrupted(GatewayError):
    """SIGTERM / SIGINT arrived while ``dcpgw up`` was still starting (waiting for Kafka): it stops without
    waiting for the pending call (docs/reliability.md "Fault campaign", bounded stop)."""
