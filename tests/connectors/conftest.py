"""Fixtures of the connector tests.

``spark``: the one in-process SparkSession (a JVM) of a test process, shared by every Spark test module
(tests/connectors/test_spark_source.py, test_search_spark.py) with the ``dcp`` data source registered, whichever
module runs first. Those modules carry ``xdist_group("spark")``: under ``--dist loadgroup`` they run on one
worker, so one JVM starts (tests/conftest.py fails the run if the group marks are not applied).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    pytest.importorskip("pyspark", reason="pyspark is not installed (pip install -e '.[spark]')")
    from pyspark.sql import SparkSession

    from connectors.spark import DcpDataSource

    s = (SparkSession.builder.master("local[2]").appName("dcp-tests")
         .config("spark.sql.shuffle.partitions", "2")
         .config("spark.default.parallelism", "2")
         .config("spark.ui.enabled", "false")
         .config("spark.sql.streaming.stopTimeout", "5s")
         .getOrCreate())
    s.sparkContext.setLogLevel("ERROR")
    s.dataSource.register(DcpDataSource)
    yield s
    s.stop()
