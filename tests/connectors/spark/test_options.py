"""The ``dcp`` source's options and topic lookup (connectors/spark/core.py, no Spark): every bad option is a
``DcpSourceError`` naming it, unknown option names are refused with the list of known ones (Spark's own ``path`` /
``paths`` excepted), and a missing topic is an error that creates nothing."""

from __future__ import annotations

import uuid

import pytest
from confluent_kafka.admin import AdminClient

from connectors.spark.core import OPTION_NAMES, DcpSourceError, SourceOptions, topic_partitions
from gateway.broker import Broker

BASE = {"bootstrap.servers": "localhost:1", "topic": "dcp.t"}


@pytest.mark.parametrize(("extra", "match"), [
    ({"timeout": "abc"}, r"option timeout must be a positive number of seconds, got 'abc'"),
    ({"timeout": "-1"}, r"option timeout must be a positive number of seconds, got '-1'"),
    ({"timeout": "0"}, r"option timeout .* got '0'"),
    ({"timeout": "nan"}, r"option timeout .* got 'nan'"),
    ({"timeout": "inf"}, r"option timeout .* got 'inf'"),
    ({"numPartitions": "-2"}, r"option numPartitions must be a positive integer, got '-2'"),
    ({"numPartitions": "2.5"}, r"option numPartitions must be a positive integer"),
    ({"maxRecordsPerPartitionPerBatch": "x"}, r"option maxRecordsPerPartitionPerBatch must be a positive integer"),
    ({"startingOffsets": "earliset"}, r"option startingOffsets must be 'earliest' or 'latest'"),
    ({"corruptRecords": "skip"}, r"option corruptRecords must be 'fail' or 'row', got 'skip'"),
    ({"subscribe": "dcp.other"}, r"options 'topic' and 'subscribe' disagree"),
    ({"kafka.bootstrap.servers": "other:1"}, r"options 'bootstrap.servers' and 'kafka.bootstrap.servers' disagree"),
    ({"kafka.no.such.property": "1"}, r"kafka.<property> option is refused .*no\.such\.property"),
    ({"kafka.session.timeout.ms": "soon"}, r"kafka.<property> option is refused .*session\.timeout\.ms"),
    ({"kafka.group.id": "g"}, r"option 'kafka.group.id' cannot be set"),
    ({"kafka.allow.auto.create.topics": "true"}, r"option 'kafka.allow.auto.create.topics' cannot be set"),
])
def test_bad_option_values_are_refused_naming_the_option(extra: dict[str, str], match: str) -> None:
    with pytest.raises(DcpSourceError, match=match):
        SourceOptions.parse({**BASE, **extra})


@pytest.mark.parametrize("name", ["startingOffset", "topic_", "maxRecordsPerBatch", "timeOut_s"])
def test_unknown_option_names_are_refused_with_the_known_ones(name: str) -> None:
    with pytest.raises(DcpSourceError, match=rf"unknown option '{name}'; the options are bootstrap\.servers, "
                                             r"topic, startingOffsets, .*kafka\.<librdkafka consumer property>"):
        SourceOptions.parse({**BASE, name: "latest"})


def test_good_options_in_any_case_and_sparks_own_options_are_accepted() -> None:
    o = SourceOptions.parse({"BOOTSTRAP.SERVERS": "localhost:1", "Topic": "dcp.t", "startingoffsets": "Latest",
                             "TIMEOUT": "2.5", "numpartitions": "3", "maxRecordsPerPartitionPerBatch": "10",
                             "corruptRecords": "row", "kafka.Fetch.Wait.Max.Ms": "20",
                             "path": "/ignored", "paths": '["/a"]'})  # Spark adds path/paths for load(path)
    assert (o.bootstrap, o.topic, o.starting, o.timeout, o.num_partitions, o.max_per_partition, o.corrupt) == (
        "localhost:1", "dcp.t", "latest", 2.5, 3, 10, "row")
    assert o.kafka == {"fetch.wait.max.ms": "20"}
    assert {n.lower() for n in OPTION_NAMES} >= {"topic", "timeout", "startingoffsets"}
    assert SourceOptions.parse({"kafka.bootstrap.servers": "localhost:1", "subscribe": "dcp.t"}).topic == "dcp.t"


def test_a_missing_topic_is_an_error_and_is_not_created(kafka_broker: Broker) -> None:
    topic = f"no.such.{uuid.uuid4().hex[:8]}"
    opts = SourceOptions.parse({"bootstrap.servers": kafka_broker.bootstrap_servers, "topic": topic,
                                "timeout": "20"})
    with pytest.raises(DcpSourceError, match=rf"topic '{topic}' not found on "):
        topic_partitions(opts)
    admin = AdminClient({"bootstrap.servers": kafka_broker.bootstrap_servers, "allow.auto.create.topics": False})
    assert topic not in admin.list_topics(timeout=20).topics  # before: created with 4 partitions, read as empty
