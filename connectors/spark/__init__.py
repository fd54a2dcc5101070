"""PySpark connector for dcp-gateway topics (``pip install 'dcp-gateway[spark]'``); see docs/spark.md.

* :class:`~connectors.spark.source.DcpDataSource`: the ``dcp`` Python data source (batch and streaming);
* :func:`~connectors.spark.materialize.materialize`: a ``foreachBatch`` helper keeping a Parquet table of the
  latest state per key, rollback-exact and idempotent per batch;
* :func:`~connectors.spark.native.from_kafka_df`: the same rows from Spark's native ``kafka`` source.

Importing this package does not import pyspark (the source module does).
"""

from __future__ import annotations

from typing import Any

from connectors.spark.materialize import materialize, materializer, read_table

__all__ = ["DcpDataSource", "from_kafka_df", "materialize", "materializer", "read_table"]


def __getattr__(name: str) -> Any:  # lazy: pyspark is imported only when the source is used
    if name == "DcpDataSource":
        from connectors.spark.source import DcpDataSource

        return DcpDataSource
    if name == "from_kafka_df":
        from connectors.spark.native import from_kafka_df

        return from_kafka_df
    raise AttributeError(name)
