"""Exceptions of the gateway, rooted at the product-wide :class:`engine.exceptions.DcpGatewayError`.

``retriable`` follows the engine's convention: a retriable error may succeed if the caller simply tries
again later (a broker that is down now may be up in a moment); a non-retriable one will not.
"""

from __future__ import annotations

from engine.exceptions import DcpGatewayError

__all__ = ["BrokerError", "BrokerStartError", "DcpGatewayError", "GatewayError"]


class GatewayError(DcpGatewayError):
    """Root of every error raised by the gateway package."""


class BrokerError(GatewayError):
    """The Kafka-protocol broker could not be reached or managed. Retriable: brokers come back."""

    retriable = True


class BrokerStartError(BrokerError):
    """A broker this process manages (embedded Tansu, testcontainers Kafka) did not start or get ready."""
