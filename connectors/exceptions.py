"""Exceptions of the client connectors (all under :class:`schemas.errors.DcpGatewayError`)."""

from __future__ import annotations

from schemas.errors import DcpGatewayError

__all__ = ["ConnectorError", "DecodeError", "StateStoreError"]


class ConnectorError(DcpGatewayError):
    """A client connector failed (Kafka error, misuse of the consumer API)."""


class DecodeError(ConnectorError):
    """A record of the topic is corrupt or names an unknown Avro schema fingerprint.

    The raw record was copied to the dead-letter destination before this was raised; the consumer continues
    after it when iterated again.
    """

    def __init__(self, message: str, topic: str = "", partition: int = -1, offset: int = -1) -> None:
        super().__init__(message)
        self.topic = topic
        self.partition = partition
        self.offset = offset


class StateStoreError(ConnectorError):
    """The consumer state store (or the mutation log) could not be read or written."""
