"""dcp-gateway's gateway: streams the DCP engine's change feed into Kafka.

This package holds the broker selection shared by the product and the tests (:mod:`gateway.broker`),
the ``dcpgw`` command line (:mod:`gateway.cli`) and the gateway's exceptions (:mod:`gateway.exceptions`).
The streaming pipeline, HTTP API and Avro encoding arrive with the gateway issue.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
