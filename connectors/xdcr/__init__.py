"""XDCR from a dcp-gateway topic into a Couchbase-compatible target cluster (docs/xdcr.md).

``connectors.xdcr.replicator.XdcrReplicator`` (``dcpgw xdcr``), its target client (``mcbp``, ``sasl``,
``connection``, ``target``), checkpoints, filters, metrics and the Spark job (``spark_job``).
"""
