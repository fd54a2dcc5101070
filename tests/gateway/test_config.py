"""gateway.config: defaults, environment variables, config files and their precedence, the librdkafka
pass-through, secret masking and ConfigError messages. Real pydantic, real files, real (monkeypatched) env."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, KafkaException, Producer
from pydantic import ValidationError

from engine.config import BucketConfig
from gateway.config import (
    MASK,
    PRODUCER_QUEUE_MAX_KBYTES,
    GatewaySettings,
    KafkaConnection,
    is_secret_property,
    load_settings,
)
from gateway.exceptions import ConfigError, GatewayError
from gateway.kafka.properties import librdkafka_property_names

SECRET = "s3cr3t-hunter2"
KEY_SECRET = "k3y-passphrase-42"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """No DCPGW_* / KAFKA_BOOTSTRAP_SERVERS from the outside, and a scratch working directory."""
    for name in list(os.environ):
        if name.upper().startswith("DCPGW_") or name == "KAFKA_BOOTSTRAP_SERVERS":
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    yield


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def config_error(**kwargs: Any) -> ConfigError:
    config_file = kwargs.pop("config_file", None)
    with pytest.raises(ConfigError) as info:
        load_settings(config_file, **kwargs)
    return info.value


def sasl_connection() -> KafkaConnection:
    return KafkaConnection.from_librdkafka({
        "bootstrap.servers": "k1:9092,k2:9092",
        "security.protocol": "SASL_SSL",
        "sasl.mechanism": "SCRAM-SHA-512",
        "sasl.username": "gateway",
        "sasl.password": SECRET,
        "ssl.ca.location": "/etc/ssl/ca.pem",
        "ssl.key.location": "/etc/ssl/client.key",
        "ssl.key.password": KEY_SECRET,
        "ssl.endpoint.identification.algorithm": "https",
        "client.id": "gw-1",
        "socket.timeout.ms": 30000,
        "enable.ssl.certificate.verification": True,
        "ssl.keystore.password": "keystore-pw-77",
        "sasl.oauthbearer.client.secret": "oauth-secret-88",
    })


# ---------------------------------------------------------------------------------------------- defaults
def test_defaults() -> None:
    s = load_settings()
    assert s.bucket == "default"
    assert s.data_dir == Path("./data")  # issue 3: "data in ./data"
    assert s.num_vbuckets == 1024
    assert s.topic_prefix == "dcp"
    assert s.value_format == "avro"
    assert s.stream_from == "saved-offset-or-beginning"
    assert s.key_filter_prefix is None and s.key_filter_regex is None
    assert s.flow_control_buffer_bytes == 16 * 1024 * 1024
    assert (s.checkpoint_interval_s, s.flush_interval_s) == (1.0, 0.05)
    assert (s.expiry_pager_interval_s, s.compaction_interval_s) == (60.0, 600.0)
    assert s.create_topic_partitions is None and s.topic_replication_factor == 1
    assert (s.producer_linger_ms, s.producer_batch_size, s.producer_compression) == (20, 1_048_576, "lz4")
    assert (s.http_host, s.http_port) == ("127.0.0.1", 8091)  # issue 3: "HTTP API on 127.0.0.1:8091"
    k = s.kafka
    assert k.bootstrap_servers is None  # the embedded / auto-selected broker
    assert k.security_protocol == "PLAINTEXT" and k.sasl_mechanism is None and k.sasl_password is None
    assert k.client_id == "dcp-gateway" and k.extra == {}
    assert k.to_librdkafka() == {"security.protocol": "PLAINTEXT", "client.id": "dcp-gateway"}
    assert GatewaySettings() == s


def test_engine_config_maps_bucket_settings(tmp_path: Path) -> None:
    s = load_settings(bucket="beer-sample", data_dir=tmp_path / "d", num_vbuckets=64)
    cfg = s.engine_config()
    assert isinstance(cfg, BucketConfig)
    assert (cfg.name, cfg.data_dir, cfg.num_vbuckets) == ("beer-sample", tmp_path / "d", 64)


def test_producer_config_pins_delivery_guarantees_and_bounds_memory() -> None:
    s = load_settings(producer_linger_ms=7, producer_batch_size=65536, producer_compression="zstd",
                      kafka={"bootstrap_servers": "k:9092", "extra": {"socket.timeout.ms": 1234,
                                                                       "fetch.min.bytes": 10}})
    p = s.producer_config()
    assert p["enable.idempotence"] is True and p["acks"] == "all"
    assert p["max.in.flight.requests.per.connection"] == 5
    assert (p["linger.ms"], p["batch.size"], p["compression.type"]) == (7, 65536, "zstd")
    assert p["queue.buffering.max.kbytes"] == PRODUCER_QUEUE_MAX_KBYTES
    assert p["bootstrap.servers"] == "k:9092" and p["socket.timeout.ms"] == 1234
    assert "fetch.min.bytes" not in p  # consumer-only: would only make librdkafka warn
    # the bound can be changed through the pass-through
    s2 = load_settings(kafka={"extra": {"queue.buffering.max.kbytes": 1024}})
    assert s2.producer_config()["queue.buffering.max.kbytes"] == 1024


def test_consumer_and_admin_configs() -> None:
    s = load_settings(kafka={"extra": {"socket.timeout.ms": 1234, "fetch.min.bytes": 10,
                                       "message.timeout.ms": 5}})
    c = s.consumer_config("readers")
    assert c["group.id"] == "readers" and c["enable.auto.commit"] is False
    assert c["auto.offset.reset"] == "earliest"
    assert c["fetch.min.bytes"] == 10 and c["socket.timeout.ms"] == 1234 and "message.timeout.ms" not in c
    a, b = s.consumer_config(None)["group.id"], s.consumer_config()["group.id"]
    assert a != b and str(a).startswith("dcpgw-default-")
    admin = s.admin_config()
    assert admin["socket.timeout.ms"] == 1234
    assert "fetch.min.bytes" not in admin and "message.timeout.ms" not in admin  # client-only properties


def test_librdkafka_accepts_the_generated_configs() -> None:
    # creating a client validates every property and value; no broker is contacted
    s = load_settings(kafka={"bootstrap_servers": "127.0.0.1:1", "extra": {"log_level": 0}})
    Producer(s.producer_config()).flush(0)
    Consumer(s.consumer_config()).close()
    sasl = load_settings(kafka={"bootstrap_servers": "127.0.0.1:1", "security_protocol": "SASL_PLAINTEXT",
                                "sasl_mechanism": "SCRAM-SHA-256", "sasl_username": "u",
                                "sasl_password": SECRET, "extra": {"log_level": 0}})
    Producer(sasl.producer_config()).flush(0)


def test_property_names_come_from_the_installed_librdkafka() -> None:
    # no copied table: the names (for suggestions) are librdkafka's own, and librdkafka takes each of them
    names = librdkafka_property_names()
    assert {"socket.timeout.ms", "fetch.min.bytes", "linger.ms", "sasl.oauthbearer.config"} <= names
    for name in sorted(names):
        conf: dict[str, Any] = {name: "0"}
        if name != "log_level":
            conf["log_level"] = 0
        try:
            Producer(conf).flush(0)
        except (KafkaException, ValueError, TypeError) as exc:  # a bad value for this property is fine
            assert "No such configuration property" not in str(exc), name


def test_librdkafka_refuses_invalid_values_at_start() -> None:
    err = config_error(kafka={"extra": {"socket.timeout.ms": 1, "debug": "bogus", "linger.ms": 5}})
    assert err.fields == ['kafka.extra["socket.timeout.ms"]', 'kafka.extra["debug"]']
    assert "outside allowed range" in str(err) and "Invalid value" in str(err)
    # a property's secret value never appears in the message
    err = config_error(kafka={"extra": {"sasl.oauthbearer.client.secret": SECRET, "ssl.keystore.password": 7,
                                        "enable.ssl.certificate.verification": SECRET}})
    assert SECRET not in str(err) and "enable.ssl.certificate.verification" in str(err)


def test_cli_prints_a_refused_librdkafka_property_in_one_line(tmp_path: Path) -> None:
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("DCPGW_")}
    env["DCPGW_KAFKA__EXTRA"] = json.dumps({"socket.timeout.msx": 5, "queue.buffering.max.ms": -3})
    res = subprocess.run([sys.executable, "-m", "gateway.cli", "up", "--no-progress", "--data-dir",
                          str(tmp_path / "d")], env=env, capture_output=True, text=True, timeout=60)
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 2, res
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert "socket.timeout.msx" in lines[0] and "did you mean 'socket.timeout.ms'" in lines[0]
    assert "queue.buffering.max.ms" in lines[0] and "outside allowed range" in lines[0]


# ---------------------------------------------------------------------------------------------- env vars
def test_environment_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DCPGW_HTTP_PORT", "9000")
    monkeypatch.setenv("DCPGW_BUCKET", "travel")
    monkeypatch.setenv("DCPGW_STREAM_FROM", "now")
    monkeypatch.setenv("DCPGW_KEY_FILTER_REGEX", "^user::")
    monkeypatch.setenv("DCPGW_KAFKA__SECURITY_PROTOCOL", "SASL_SSL")
    monkeypatch.setenv("DCPGW_KAFKA__SASL_MECHANISM", "scram-sha-256")
    monkeypatch.setenv("DCPGW_KAFKA__SASL_USERNAME", "gw")
    monkeypatch.setenv("DCPGW_KAFKA__SASL_PASSWORD", SECRET)
    monkeypatch.setenv("DCPGW_KAFKA__EXTRA", json.dumps({"socket.timeout.ms": 5000, "debug": "broker"}))
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", "b1:9092, b2:9092")
    monkeypatch.setenv("DCPGW_BROKER", "embedded")  # gateway.broker's variable: not a setting, not an error
    monkeypatch.setenv("DCPGW_PURE_PYTHON", "1")  # engine/compiled.py's: neither
    s = load_settings()
    assert (s.http_port, s.bucket, s.stream_from, s.key_filter_regex) == (9000, "travel", "now", "^user::")
    k = s.kafka
    assert k.security_protocol == "SASL_SSL" and k.sasl_mechanism == "SCRAM-SHA-256"
    assert k.sasl_password is not None and k.sasl_password.get_secret_value() == SECRET
    assert k.bootstrap_servers == "b1:9092,b2:9092"
    assert k.extra == {"socket.timeout.ms": 5000, "debug": "broker"}
    assert k.to_librdkafka()["sasl.password"] == SECRET
    # KafkaConnection on its own reads the same variables
    assert KafkaConnection() == k


def test_bootstrap_servers_sources(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cfg = write(tmp_path / "c.toml", '[kafka]\nbootstrap_servers = "file:9092"\n')
    assert load_settings(cfg).kafka.bootstrap_servers == "file:9092"
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", "plain:9092")  # env beats the file
    assert load_settings(cfg).kafka.bootstrap_servers == "plain:9092"
    assert KafkaConnection().bootstrap_servers == "plain:9092"
    monkeypatch.setenv("DCPGW_KAFKA__BOOTSTRAP_SERVERS", "specific:9092")  # the namespaced variable wins
    assert load_settings(cfg).kafka.bootstrap_servers == "specific:9092"
    assert KafkaConnection().bootstrap_servers == "specific:9092"
    assert load_settings(cfg, kafka={"bootstrap_servers": "arg:1"}).kafka.bootstrap_servers == "arg:1"
    monkeypatch.delenv("DCPGW_KAFKA__BOOTSTRAP_SERVERS")
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", "  ")  # blank = not set, as in gateway.broker
    assert load_settings().kafka.bootstrap_servers is None


# ---------------------------------------------------------------------------------------------- files
TOML = f"""
bucket = "filebucket"
http_port = 9100
num_vbuckets = 64
topic_prefix = "cdc.prod"

[kafka]
security_protocol = "SASL_PLAINTEXT"
sasl_mechanism = "PLAIN"
sasl_username = "file-user"
sasl_password = "{SECRET}"

[kafka.extra]
"socket.timeout.ms" = 20000
"enable.ssl.certificate.verification" = false
"""


def test_toml_file_and_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cfg = write(tmp_path / "dcpgw.toml", TOML)
    s = load_settings(cfg)
    assert (s.bucket, s.http_port, s.num_vbuckets, s.topic_prefix) == ("filebucket", 9100, 64, "cdc.prod")
    assert s.kafka.sasl_username == "file-user"
    assert s.kafka.extra == {"socket.timeout.ms": 20000, "enable.ssl.certificate.verification": False}
    assert s.http_host == "127.0.0.1"  # not in the file: default
    # env beats file, and nested tables merge field by field
    monkeypatch.setenv("DCPGW_HTTP_PORT", "9200")
    monkeypatch.setenv("DCPGW_KAFKA__SASL_USERNAME", "env-user")
    s = load_settings(cfg)
    assert s.http_port == 9200 and s.bucket == "filebucket"
    assert s.kafka.sasl_username == "env-user" and s.kafka.sasl_mechanism == "PLAIN"
    assert s.kafka.sasl_password is not None and s.kafka.sasl_password.get_secret_value() == SECRET
    # overrides beat env
    s = load_settings(cfg, http_port=0, kafka={"sasl_username": "arg-user"})
    assert s.http_port == 0 and s.kafka.sasl_username == "arg-user"
    assert s.kafka.extra["socket.timeout.ms"] == 20000
    # the file may also come from DCPGW_CONFIG_FILE; an explicit path wins over it
    monkeypatch.delenv("DCPGW_HTTP_PORT")
    monkeypatch.setenv("DCPGW_CONFIG_FILE", str(cfg))
    assert load_settings().http_port == 9100
    assert GatewaySettings().http_port == 9100
    other = write(tmp_path / "other.toml", "http_port = 9300\n")
    assert load_settings(other).http_port == 9300


def test_json_file(tmp_path: Path) -> None:
    cfg = write(tmp_path / "dcpgw.json", json.dumps({
        "value_format": "raw", "create_topic_partitions": 8, "key_filter_prefix": "user::",
        "kafka": {"bootstrap_servers": "j:9092", "extra": {"retries": 3}},
    }))
    s = load_settings(cfg)
    assert (s.value_format, s.create_topic_partitions, s.key_filter_prefix) == ("raw", 8, "user::")
    assert s.kafka.bootstrap_servers == "j:9092" and s.kafka.extra == {"retries": 3}


# ---------------------------------------------------------------------------------------------- librdkafka
def test_librdkafka_round_trip() -> None:
    k = sasl_connection()
    assert k.sasl_mechanism == "SCRAM-SHA-512" and k.ssl_ca_location == Path("/etc/ssl/ca.pem")
    assert k.extra == {"socket.timeout.ms": 30000, "enable.ssl.certificate.verification": True,
                       "ssl.keystore.password": "keystore-pw-77",
                       "sasl.oauthbearer.client.secret": "oauth-secret-88"}
    d = k.to_librdkafka()
    assert d["sasl.password"] == SECRET and d["ssl.key.password"] == KEY_SECRET
    assert d["ssl.ca.location"] == "/etc/ssl/ca.pem" and d["client.id"] == "gw-1"
    assert KafkaConnection.from_librdkafka(d) == k
    assert KafkaConnection.from_librdkafka(d).to_librdkafka() == d
    # extra is merged last, None fields are omitted
    assert list(d)[-4:] == list(k.extra)
    assert "sasl.username" not in KafkaConnection.from_librdkafka({}).to_librdkafka()


def test_from_librdkafka_aliases_and_case() -> None:
    k = KafkaConnection.from_librdkafka({"metadata.broker.list": "a:1", "security.protocol": "sasl_ssl",
                                         "sasl.mechanisms": "OAUTHBEARER"})
    assert (k.bootstrap_servers, k.security_protocol, k.sasl_mechanism) == ("a:1", "SASL_SSL", "OAUTHBEARER")
    assert KafkaConnection.from_librdkafka({"bootstrap.servers": "a:1", "metadata.broker.list": "a:1"}) \
        .bootstrap_servers == "a:1"
    with pytest.raises(ConfigError, match=r"metadata\.broker\.list"):
        KafkaConnection.from_librdkafka({"bootstrap.servers": "a:1", "metadata.broker.list": "b:2"})


def test_unknown_librdkafka_property_is_rejected_with_a_suggestion() -> None:
    with pytest.raises(ConfigError) as info:
        KafkaConnection.from_librdkafka({"socket.timeout.msx": 1000})
    msg = str(info.value)
    assert 'extra["socket.timeout.msx"]' in msg and "unknown librdkafka property" in msg
    assert "did you mean 'socket.timeout.ms'" in msg
    err = config_error(kafka={"extra": {"linger_ms": 5, "sasl.mechanismz": "PLAIN"}})
    assert err.fields == ['kafka.extra["linger_ms"]', 'kafka.extra["sasl.mechanismz"]']
    assert "'linger.ms'" in str(err) and "'sasl.mechanism'" in str(err)
    # callbacks cannot be passed through (and are no librdkafka string property)
    assert "unknown librdkafka property" in str(config_error(kafka={"extra": {"error_cb": "x"}}))


def test_extra_duplicating_a_typed_field_is_rejected() -> None:
    err = config_error(kafka={"extra": {"sasl.password": SECRET, "bootstrap.servers": "x:1",
                                        "metadata.broker.list": "y:1"}})
    msg = str(err)
    assert err.fields == ['kafka.extra["sasl.password"]', 'kafka.extra["bootstrap.servers"]',
                          'kafka.extra["metadata.broker.list"]']
    assert "'sasl_password'" in msg and "DCPGW_KAFKA__SASL_PASSWORD" in msg and "'bootstrap_servers'" in msg
    assert SECRET not in msg


def test_extra_owned_by_the_gateway_is_rejected() -> None:
    err = config_error(kafka={"extra": {"linger.ms": 5, "compression.codec": "gzip", "acks": 1,
                                        "enable.idempotence": False}})
    msg = str(err)
    assert 'kafka.extra["linger.ms"]' in msg and "producer_linger_ms" in msg
    assert "producer_compression" in msg and "acks=all" in msg
    assert len(err.fields) == 4


def test_extra_values_must_be_scalars() -> None:
    err = config_error(kafka={"extra": {"debug": ["broker"]}})
    assert err.fields == ['kafka.extra["debug"]'] and "string, number or boolean" in str(err)


# ---------------------------------------------------------------------------------------------- secrets
def test_secrets_are_masked_everywhere_but_to_librdkafka(tmp_path: Path) -> None:
    k = sasl_connection()
    s = load_settings(kafka=k)
    secrets = [SECRET, KEY_SECRET, "keystore-pw-77", "oauth-secret-88"]
    shown = [repr(k), str(k), repr(s), str(s), repr(k.model_dump()), repr(s.model_dump()),
             k.model_dump_json(), s.model_dump_json(), repr(k.masked_dict()), f"{s!r} {k}"]
    for text in shown:
        for secret in secrets:
            assert secret not in text
    assert k.model_dump()["sasl_password"] == MASK and k.model_dump()["ssl_key_password"] == MASK
    assert k.model_dump()["extra"]["ssl.keystore.password"] == MASK
    assert k.model_dump()["extra"]["socket.timeout.ms"] == 30000
    masked = k.masked_dict()
    assert masked["sasl.password"] == masked["ssl.key.password"] == MASK
    assert masked["sasl.oauthbearer.client.secret"] == masked["ssl.keystore.password"] == MASK
    assert masked["sasl.username"] == "gateway" and masked["bootstrap.servers"] == "k1:9092,k2:9092"
    assert set(masked) == set(k.to_librdkafka())
    assert s.producer_config()["sasl.password"] == SECRET  # clients get the real value


@pytest.mark.parametrize("name", ["sasl.password", "ssl.key.password", "ssl.keystore.password",
                                  "sasl.oauthbearer.client.secret", "ssl.key.pem", "some.token",
                                  "sasl.oauthbearer.assertion.private.key.passphrase", "x.key"])
def test_secret_property_names(name: str) -> None:
    assert is_secret_property(name)


@pytest.mark.parametrize("name", ["sasl.username", "ssl.key.location", "bootstrap.servers", "ssl.ca.pem"])
def test_public_property_names(name: str) -> None:
    assert not is_secret_property(name)


def test_error_messages_never_echo_secrets(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cfg = write(tmp_path / "c.toml", f'[kafka]\nsasl_passwd = "{SECRET}"\nsasl_password = 5\n'
                                     f'[kafka.extra]\n"ssl.key.pem" = ["{KEY_SECRET}"]\n')
    err = config_error(config_file=cfg)
    msg = str(err)
    assert "kafka.sasl_passwd: unknown setting" in msg and "kafka.sasl_password" in msg
    assert SECRET not in msg and KEY_SECRET not in msg
    monkeypatch.setenv("DCPGW_KAFKA__SECURITY_PROTOCOL", "SASL_SSL")
    monkeypatch.setenv("DCPGW_KAFKA__SASL_PASSWORD", SECRET)
    assert SECRET not in str(config_error())


# ---------------------------------------------------------------------------------------------- SASL rule
@pytest.mark.parametrize("protocol", ["SASL_SSL", "SASL_PLAINTEXT"])
def test_sasl_protocol_requires_a_mechanism(protocol: str) -> None:
    err = config_error(kafka={"security_protocol": protocol})
    assert err.fields == ["kafka.sasl_mechanism"] and protocol in str(err)
    with pytest.raises(ConfigError, match="sasl_mechanism"):
        KafkaConnection(security_protocol=protocol)


@pytest.mark.parametrize("mechanism", ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"])
def test_password_mechanisms_require_credentials(mechanism: str) -> None:
    err = config_error(kafka={"security_protocol": "SASL_SSL", "sasl_mechanism": mechanism})
    assert err.fields == ["kafka.sasl_username", "kafka.sasl_password"]
    err = config_error(kafka={"security_protocol": "SASL_SSL", "sasl_mechanism": mechanism,
                              "sasl_username": "u"})
    assert err.fields == ["kafka.sasl_password"]


@pytest.mark.parametrize("mechanism", ["OAUTHBEARER", "GSSAPI"])
def test_token_and_kerberos_mechanisms_need_no_password(mechanism: str) -> None:
    s = load_settings(kafka={"security_protocol": "SASL_SSL", "sasl_mechanism": mechanism})
    assert s.kafka.to_librdkafka()["sasl.mechanism"] == mechanism


# ---------------------------------------------------------------------------------------------- bad values
@pytest.mark.parametrize(("overrides", "field", "fragment"), [
    ({"http_port": 70000}, "http_port", "65535"),
    ({"http_port": -1}, "http_port", "greater than or equal to 0"),
    ({"topic_prefix": "dcp/prod"}, "topic_prefix", "Kafka topic"),
    ({"topic_prefix": ""}, "topic_prefix", "at least 1"),
    ({"checkpoint_interval_s": -1}, "checkpoint_interval_s", "greater than 0"),
    ({"flush_interval_s": 0}, "flush_interval_s", "greater than 0"),
    ({"compaction_interval_s": float("inf")}, "compaction_interval_s", "finite"),
    ({"key_filter_regex": "user[::"}, "key_filter_regex", "regular expression"),
    ({"num_vbuckets": 0}, "num_vbuckets", "greater than or equal to 1"),
    ({"flow_control_buffer_bytes": 1000}, "flow_control_buffer_bytes", "65536"),
    ({"bucket": "bad bucket!"}, "bucket", "pattern"),
    ({"bucket": "50%off"}, "bucket", "'%'"),
    ({"topic_prefix": "p" * 200, "bucket": "b" * 40}, "topic_prefix", "249"),
    ({"value_format": "json"}, "value_format", "'avro' or 'raw'"),
    ({"stream_from": "latest"}, "stream_from", "saved-offset-or-now"),
    ({"producer_compression": "brotli"}, "producer_compression", "zstd"),
    ({"create_topic_partitions": 0}, "create_topic_partitions", "greater than or equal to 1"),
    ({"kafka": {"security_protocol": "TLS"}}, "kafka.security_protocol", "SASL_SSL"),
    ({"kafka": {"sasl_mechanism": "MD5"}}, "kafka.sasl_mechanism", "SCRAM-SHA-256"),
    ({"kafka": {"bootstrap_servers": "a:1,,b:2"}}, "kafka.bootstrap_servers", "comma-separated"),
    ({"kafka": {"client_id": ""}}, "kafka.client_id", "at least 1"),
    ({"htp_port": 1}, "htp_port", "did you mean 'http_port'"),
    ({"sasl_username": "u"}, "sasl_username", "did you mean 'kafka.sasl_username'"),
    ({"kafka": {"sasl_user": "u"}}, "kafka.sasl_user", "did you mean 'sasl_username'"),
])
def test_bad_values_name_the_field(overrides: dict[str, Any], field: str, fragment: str) -> None:
    err = config_error(**overrides)
    assert err.fields == [field]
    msg = str(err)
    assert msg.startswith("invalid dcp-gateway configuration") and f"{field}: " in msg and fragment in msg
    assert "validation error" not in msg and "errors.pydantic.dev" not in msg
    assert err.__suppress_context__  # no pydantic traceback chained under it
    assert isinstance(err, GatewayError) and not err.retriable


def test_all_problems_are_listed_at_once_with_their_origin(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    cfg = write(tmp_path / "c.toml", 'topic_prefix = "a/b"\nbogus = 1\n')
    monkeypatch.setenv("DCPGW_HTTP_PORT", "70000")
    monkeypatch.setenv("DCPGW_HTTP_PROT", "1")
    err = config_error(config_file=cfg, checkpoint_interval_s=-2)
    lines = str(err).splitlines()
    assert lines[0] == f"invalid dcp-gateway configuration (config file {cfg}), 5 problems:"
    assert sorted(err.fields) == ["bogus", "checkpoint_interval_s", "http_port", "http_prot", "topic_prefix"]
    text = "\n".join(lines)
    assert "http_port: Input should be less than or equal to 65535 (got '70000', from environment variable " \
           "DCPGW_HTTP_PORT)" in text
    assert f"topic_prefix: may contain only ASCII letters, digits, '.', '_' and '-', as Kafka topic names " \
           f"(got 'a/b', in {cfg})" in text
    assert "checkpoint_interval_s: Input should be greater than 0 (got -2, from an override argument)" in text
    assert f"bogus: unknown setting (in {cfg})" in text
    assert "http_prot: unknown setting (did you mean 'http_port' or 'http_host'?) " \
           "(from environment variable DCPGW_HTTP_PROT)" in text


def test_unknown_setting_in_file(tmp_path: Path) -> None:
    err = config_error(config_file=write(tmp_path / "c.toml", "http_prot = 1\n[kafka]\nclient = 'x'\n"))
    assert sorted(err.fields) == ["http_prot", "kafka.client"]
    assert "did you mean 'http_port'" in str(err) and "did you mean 'client_id'" in str(err)


def test_unknown_setting_in_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DCPGW_NUM_VBUCKET", "8")
    monkeypatch.setenv("DCPGW_KAFKA__SASL_PASWORD", SECRET)
    err = config_error()
    assert sorted(err.fields) == ["kafka.sasl_pasword", "num_vbucket"]
    msg = str(err)
    assert "DCPGW_NUM_VBUCKET" in msg and "did you mean 'num_vbuckets'" in msg
    assert "DCPGW_KAFKA__SASL_PASWORD" in msg
    assert SECRET not in msg
    with pytest.raises(ConfigError, match="sasl_pasword"):
        KafkaConnection()


def test_env_json_table_that_does_not_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DCPGW_KAFKA__EXTRA", "{not json")
    msg = str(config_error())
    assert "kafka" in msg and "JSON" in msg


@pytest.mark.parametrize(("name", "content", "fragment"), [
    ("bad.toml", "http_port = = 1\n", "is not valid TOML"),
    ("bad.toml", "[kafka\n", "is not valid TOML"),
    ("bad.json", "{'http_port': 1}", "is not valid JSON"),
    ("list.json", "[1, 2]", "must hold a table of settings"),
])
def test_malformed_file(tmp_path: Path, name: str, content: str, fragment: str) -> None:
    path = write(tmp_path / name, content)
    err = config_error(config_file=path)
    assert fragment in str(err) and str(path) in str(err)
    assert "line 1" in str(err) or "table" in str(err)


def test_missing_or_unreadable_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    assert f"config file {missing} does not exist" in str(config_error(config_file=missing))
    assert "is a directory" in str(config_error(config_file=tmp_path))
    monkeypatch.setenv("DCPGW_CONFIG_FILE", str(missing))
    assert "does not exist" in str(config_error())
    binary = write(tmp_path / "bin.toml", "")
    binary.write_bytes(b"\xff\xfe")
    assert "not UTF-8" in str(config_error(config_file=binary))


def test_data_dir_that_is_a_file(tmp_path: Path) -> None:
    f = write(tmp_path / "f", "x")
    err = config_error(data_dir=f)
    assert err.fields == ["data_dir"] and "not a directory" in str(err)


# ---------------------------------------------------------------------------------------------- misc
def test_key_filters() -> None:
    s = load_settings(key_filter_prefix="user::", key_filter_regex=r"::\d+$")
    assert (s.key_filter_prefix, s.key_filter_regex) == ("user::", r"::\d+$")
    s = load_settings(key_filter_prefix="", key_filter_regex="")
    assert s.key_filter_prefix is None and s.key_filter_regex is None  # empty = no filter


def test_settings_are_immutable() -> None:
    s = load_settings()
    with pytest.raises(ValidationError, match="frozen"):
        s.http_port = 1  # type: ignore[misc]
    assert s.model_copy(update={"http_port": 1}).http_port == 1


# ---------------------------------------------------------------------------------------------- docs
DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_documented_example_toml_is_valid(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    example = DOC.read_text().split("```toml\n", 1)[1].split("```", 1)[0]
    monkeypatch.setenv("DCPGW_KAFKA__SASL_PASSWORD", SECRET)
    s = load_settings(write(tmp_path / "dcpgw.toml", example))
    assert s.topic_prefix == "cdc.prod" and s.kafka.sasl_mechanism == "SCRAM-SHA-512"
    assert s.kafka.extra["queue.buffering.max.kbytes"] == 32768


def test_every_setting_is_documented() -> None:
    doc = DOC.read_text()
    for name in GatewaySettings.model_fields:
        if name != "kafka":
            assert f"| `{name}` | `DCPGW_{name.upper()}` |" in doc, name
    for name in KafkaConnection.model_fields:
        assert f"| `kafka.{name}` | `DCPGW_KAFKA__{name.upper()}" in doc, name
