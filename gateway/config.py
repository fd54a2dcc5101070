"""Gateway settings: one validated tree read from keyword overrides, ``DCPGW_*`` environment variables, a TOML
or JSON file and defaults, in that order of precedence.

Quick use::

    from gateway.config import load_settings
    settings = load_settings(Path("dcpgw.toml"), http_port=0)   # raises ConfigError, never ValidationError
    Producer(settings.producer_config())

Environment variables are ``DCPGW_<SETTING>`` and, for the Kafka connection, ``DCPGW_KAFKA__<SETTING>``
(``DCPGW_KAFKA__SECURITY_PROTOCOL=SASL_SSL``). The product-wide broker switch ``KAFKA_BOOTSTRAP_SERVERS`` is
honoured too (``DCPGW_KAFKA__BOOTSTRAP_SERVERS`` wins when both are set). ``DCPGW_CONFIG_FILE`` names the
settings file when none is passed. docs/configuration.md lists every setting.

:class:`KafkaConnection` follows quix-streams' ``ConnectionConfig``: typed fields for the connection and
security settings, plus ``extra`` for any other librdkafka property. ``extra`` is checked by the installed
librdkafka itself (gateway.kafka.properties): an unknown name (with a suggestion) or a value librdkafka refuses
is a ConfigError at start, before any client is created. Secrets
never appear in ``repr``/``str``/``model_dump()``/error messages; only :meth:`KafkaConnection.to_librdkafka`
(and the client configs built from it) reveal them.
"""

from __future__ import annotations

import contextvars
import difflib
import json
import os
import re
import tomllib
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Final, Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    Field,
    PlainValidator,
    SecretStr,
    ValidationError,
    field_serializer,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, SettingsError

from engine.compiled import PURE_PYTHON_ENV
from engine.config import BucketConfig
from gateway.exceptions import ConfigError
from gateway.kafka.properties import check_properties, consumer_only, producer_only

__all__ = [
    "BOOTSTRAP_ENV",
    "CONFIG_FILE_ENV",
    "ENV_PREFIX",
    "MASK",
    "PRODUCER_QUEUE_MAX_KBYTES",
    "RESERVED_ENV_VARS",
    "ConfigError",
    "GatewaySettings",
    "KafkaConnection",
    "LibrdkafkaConfig",
    "LibrdkafkaValue",
    "SaslMechanism",
    "SecurityProtocol",
    "is_secret_property",
    "load_settings",
    "mask_librdkafka",
]

KIB: Final = 1024
MIB: Final = 1024 * 1024

#: Prefix of every environment variable of the settings tree; ``__`` separates nested levels.
ENV_PREFIX: Final = "DCPGW_"
#: The product-wide broker switch (see gateway.broker); also sets ``kafka.bootstrap_servers``.
BOOTSTRAP_ENV: Final = "KAFKA_BOOTSTRAP_SERVERS"
#: Path of the settings file when :func:`load_settings` is given none.
CONFIG_FILE_ENV: Final = "DCPGW_CONFIG_FILE"
#: ``DCPGW_*`` variables that are not settings; any other unknown ``DCPGW_*`` variable is an error (a typo).
RESERVED_ENV_VARS: frozenset[str] = frozenset({CONFIG_FILE_ENV, "DCPGW_BROKER",
                                              # the CLI's credentials and CA (docs/security.md "CLI")
                                              "DCPGW_USER", "DCPGW_PASSWORD", "DCPGW_CACERT",
                                              # the engine's sources instead of its compiled modules
                                              PURE_PYTHON_ENV})
#: What a secret value is replaced with wherever settings are shown.
MASK: Final = "**********"
#: Bound on the producer's local queue (librdkafka ``queue.buffering.max.kbytes``): 64 MiB, so that the
#: gateway's memory stays bounded when the broker is slow or down; ``kafka.extra`` may override it.
PRODUCER_QUEUE_MAX_KBYTES: Final = 64 * 1024
#: What a data record adds to the document body: key (<= 250 bytes), dcp.* headers, Avro fields and Kafka record
#: and batch framing -- with a wide margin. The producer's ``message.max.bytes`` and the created topics'
#: ``max.message.bytes`` are the engine's largest value plus this (docs/reliability.md "Large documents").
RECORD_OVERHEAD_BYTES: Final = 64 * 1024

#: KafkaConnection field -> librdkafka property, in to_librdkafka() order.
_FIELD_TO_PROPERTY: Final[dict[str, str]] = {
    "bootstrap_servers": "bootstrap.servers",
    "security_protocol": "security.protocol",
    "sasl_mechanism": "sasl.mechanism",
    "sasl_username": "sasl.username",
    "sasl_password": "sasl.password",
    "ssl_ca_location": "ssl.ca.location",
    "ssl_certificate_location": "ssl.certificate.location",
    "ssl_key_location": "ssl.key.location",
    "ssl_key_password": "ssl.key.password",
    "ssl_endpoint_identification_algorithm": "ssl.endpoint.identification.algorithm",
    "client_id": "client.id",
}
#: librdkafka property (and alias) -> the KafkaConnection field that owns it.
_PROPERTY_TO_FIELD: Final[dict[str, str]] = {
    **{prop: name for name, prop in _FIELD_TO_PROPERTY.items()},
    "metadata.broker.list": "bootstrap_servers",
    "sasl.mechanisms": "sasl_mechanism",
}
#: Producer properties GatewaySettings owns through its own fields.
_PRODUCER_FIELD_PROPERTIES: Final[dict[str, str]] = {
    "linger.ms": "producer_linger_ms",
    "queue.buffering.max.ms": "producer_linger_ms",
    "batch.size": "producer_batch_size",
    "compression.type": "producer_compression",
    "compression.codec": "producer_compression",
}
#: Properties the gateway fixes because its delivery guarantees depend on them.
_PINNED_PROPERTIES: Final[dict[str, str]] = {
    "enable.idempotence": "the gateway always produces with enable.idempotence=true (ordered, no duplicates)",
    "acks": "the gateway always produces with acks=all",
    "request.required.acks": "the gateway always produces with acks=all",
    "max.in.flight.requests.per.connection": "the gateway fixes it at 5 (the idempotent producer's maximum)",
    "max.in.flight": "the gateway fixes max.in.flight.requests.per.connection at 5",
    "transactional.id": "the gateway does not use transactions",
    "group.id": "consumer group ids are chosen per consumer (GatewaySettings.consumer_config)",
    "enable.auto.commit": "the gateway never commits offsets (its positions live in the checkpoint topic)",
}

_SECRET_WORDS: Final = ("password", "secret", "passphrase")
_SECRET_SUFFIXES: Final = (".key", "token", "key.pem")
_SECRET_NAMES: Final = frozenset({"sasl.oauthbearer.config"})


def is_secret_property(name: str) -> bool:
    """Whether a setting or librdkafka property name holds a secret that must never be shown.

    True when the name contains "password", "secret" or "passphrase", ends with ".key", "token" or
    "key.pem" (a PEM private key), or is ``sasl.oauthbearer.config`` (may carry credentials).
    """
    n = name.lower()
    return any(w in n for w in _SECRET_WORDS) or n.endswith(_SECRET_SUFFIXES) or n in _SECRET_NAMES


def mask_librdkafka(config: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a librdkafka configuration with every secret value replaced by :data:`MASK`."""
    return {k: (MASK if is_secret_property(k) and v is not None else v) for k, v in config.items()}


def _scalar(value: Any) -> str | int | float | bool:
    if isinstance(value, str | int | float | bool):
        return value
    raise ValueError(f"must be a string, number or boolean, not {type(value).__name__}")


#: A librdkafka property value: confluent-kafka passes strings through and converts numbers and booleans.
LibrdkafkaValue = Annotated[str | int | float | bool, PlainValidator(_scalar)]
#: A librdkafka client configuration, as confluent-kafka's Producer/Consumer/AdminClient take it.
LibrdkafkaConfig = dict[str, str | int | float | bool]

SecurityProtocol = Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]
SaslMechanism = Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER", "GSSAPI"]
StreamFrom = Literal["saved-offset-or-beginning", "saved-offset-or-now", "beginning", "now"]
ValueFormat = Literal["avro", "raw"]
Compression = Literal["none", "lz4", "zstd", "snappy", "gzip"]
#: what the gateway does when Kafka still refuses a record as too large (docs/configuration.md)
OversizePolicy = Literal["skip", "fail"]

Problem = tuple[tuple[str | int, ...], str]


def _problems_error(kind: str, problems: Sequence[Problem]) -> PydanticCustomError:
    """One validation error carrying several (relative location, message) problems for ConfigError."""
    summary = "; ".join(f"{'.'.join(map(str, loc))}: {msg}" if loc else msg for loc, msg in problems)
    return PydanticCustomError(kind, "{summary}", {"summary": summary, "problems": list(problems)})


# ============================================================================================================
# Kafka connection


class KafkaConnection(BaseSettings):
    """How to reach and authenticate to the Kafka cluster (librdkafka connection and security settings).

    Standalone, it reads ``DCPGW_KAFKA__*`` variables (and ``KAFKA_BOOTSTRAP_SERVERS``); inside
    :class:`GatewaySettings` it is the ``kafka`` table. Construction errors raise :class:`ConfigError`.
    """

    model_config = SettingsConfigDict(
        env_prefix=f"{ENV_PREFIX}KAFKA__",
        env_nested_delimiter="__",
        extra="forbid",
        frozen=True,
        validate_by_name=True,
        validate_by_alias=True,
    )

    #: librdkafka bootstrap.servers; None = no external broker: `dcpgw up` selects one (gateway.broker)
    bootstrap_servers: str | None = Field(
        default=None,
        validation_alias=AliasChoices(f"{ENV_PREFIX}KAFKA__BOOTSTRAP_SERVERS", BOOTSTRAP_ENV),
        description="Comma-separated host:port list; None lets `dcpgw up` pick or start a broker.",
    )
    security_protocol: SecurityProtocol = "PLAINTEXT"
    sasl_mechanism: SaslMechanism | None = None
    sasl_username: str | None = None
    sasl_password: SecretStr | None = None
    ssl_ca_location: Path | None = None
    ssl_certificate_location: Path | None = None
    ssl_key_location: Path | None = None
    ssl_key_password: SecretStr | None = None
    ssl_endpoint_identification_algorithm: Literal["https", "none"] | None = None
    client_id: str = Field(default="dcp-gateway", min_length=1)
    #: any other librdkafka property, passed through verbatim (checked by librdkafka itself)
    extra: dict[str, LibrdkafkaValue] = Field(default_factory=dict)

    def __init__(self, *args: Any, **values: Any) -> None:
        try:
            super().__init__(*args, **values)
        except ValidationError as exc:
            origins = _Origins(type(self).model_config.get("env_prefix", ""), values, None, {}, ())
            raise ConfigError(_problems_from(exc, type(self), origins)) from None
        except SettingsError as exc:
            raise ConfigError(_settings_error_text(exc)) from None

    # Nested (GatewaySettings.kafka) and model_validate() validation must not run __init__, which reads the
    # environment: the parent has merged every source already. pydantic skips a __init__ marked like its own.
    __init__.__pydantic_base_init__ = True  # type: ignore[attr-defined]

    # -------------------------------------------------------------------------------- validation
    @field_validator("bootstrap_servers", mode="before")
    @classmethod
    def _clean_servers(cls, v: Any) -> Any:
        if isinstance(v, str):
            servers = [s.strip() for s in v.split(",")]
            if not any(servers):
                return None  # an empty KAFKA_BOOTSTRAP_SERVERS means "not set", as in gateway.broker
            if not all(servers) or any(ch.isspace() for s in servers for ch in s):
                raise ValueError("must be a comma-separated host:port list without empty entries or spaces")
            return ",".join(servers)
        return v

    @field_validator("security_protocol", "sasl_mechanism", mode="before")
    @classmethod
    def _upper(cls, v: Any) -> Any:
        return v.strip().upper() if isinstance(v, str) else v  # librdkafka accepts sasl_ssl as well

    @field_validator("ssl_endpoint_identification_algorithm", mode="before")
    @classmethod
    def _lower(cls, v: Any) -> Any:
        return v.strip().lower() if isinstance(v, str) else v

    @field_validator("extra", mode="after")
    @classmethod
    def _check_extra(cls, extra: dict[str, str | int | float | bool]) -> dict[str, str | int | float | bool]:
        problems: list[Problem] = []
        for key in extra:
            if key in _PROPERTY_TO_FIELD:
                field = _PROPERTY_TO_FIELD[key]
                problems.append(((key,), f"duplicates the typed setting {field!r} "
                                 f"(env {ENV_PREFIX}KAFKA__{field.upper()}); set that instead"))
        # the rest as librdkafka itself takes them (no copied table of its properties: gateway.kafka.properties)
        rest = {k: v for k, v in extra.items() if k not in _PROPERTY_TO_FIELD}
        for key, message in check_properties(rest, secret=is_secret_property):
            problems.append(((key,) if key else (), message))
        if problems:
            raise _problems_error("librdkafka_property", problems)
        return extra

    @model_validator(mode="after")
    def _sasl_rule(self) -> KafkaConnection:
        if not self.security_protocol.startswith("SASL_"):
            return self
        problems: list[Problem] = []
        if self.sasl_mechanism is None:
            problems.append((("sasl_mechanism",), (
                f"required when security_protocol is {self.security_protocol} "
                "(PLAIN, SCRAM-SHA-256, SCRAM-SHA-512, OAUTHBEARER or GSSAPI)")))
        elif self.sasl_mechanism in ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"):
            if not self.sasl_username:
                problems.append((("sasl_username",), f"required by sasl_mechanism {self.sasl_mechanism}"))
            if self.sasl_password is None or not self.sasl_password.get_secret_value():
                problems.append((("sasl_password",), f"required by sasl_mechanism {self.sasl_mechanism}"))
        if problems:
            raise _problems_error("sasl_config", problems)
        return self

    # -------------------------------------------------------------------------------- secrets
    @field_serializer("sasl_password", "ssl_key_password")
    def _dump_secret(self, v: SecretStr | None) -> str | None:
        return None if v is None else MASK

    @field_serializer("extra")
    def _dump_extra(self, v: dict[str, str | int | float | bool]) -> dict[str, Any]:
        return mask_librdkafka(v)

    def __repr_args__(self) -> Iterator[tuple[str | None, Any]]:
        for name, value in super().__repr_args__():
            yield name, (mask_librdkafka(value) if name == "extra" else value)

    # -------------------------------------------------------------------------------- librdkafka
    def to_librdkafka(self) -> LibrdkafkaConfig:
        """The librdkafka configuration (dotted names): typed fields that are set, then ``extra``.

        The only method that reveals the secrets; log :meth:`masked_dict` instead.
        """
        out: LibrdkafkaConfig = {}
        for name, prop in _FIELD_TO_PROPERTY.items():
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, SecretStr):
                value = value.get_secret_value()
            elif isinstance(value, Path):
                value = str(value)
            out[prop] = value
        out.update(self.extra)
        return out

    def masked_dict(self) -> LibrdkafkaConfig:
        """:meth:`to_librdkafka` with every secret replaced by ``'**********'``, for logs."""
        return mask_librdkafka(self.to_librdkafka())

    @classmethod
    def from_librdkafka(cls, config: Mapping[str, Any]) -> KafkaConnection:
        """The inverse of :meth:`to_librdkafka`: typed properties (and their librdkafka aliases
        ``metadata.broker.list`` / ``sasl.mechanisms``) fill the fields, everything else goes to ``extra``.
        Reads no environment variables. Raises :class:`ConfigError`."""
        fields: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        problems: list[tuple[str, str]] = []
        for key, value in config.items():
            field = _PROPERTY_TO_FIELD.get(key)
            if field is None:
                extra[key] = value
            elif field in fields and fields[field] != value:
                prop = _FIELD_TO_PROPERTY[field]
                problems.append((f'["{key}"]', f"conflicts with another alias of {prop!r}"))
            else:
                fields[field] = value
        if problems:
            raise ConfigError(problems)
        try:
            return cls.model_validate({**fields, "extra": extra})
        except ValidationError as exc:
            raise ConfigError(_problems_from(exc, cls, _Origins("", {}, None, {}, ()))) from None

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, env_settings, _UnknownEnvSource(settings_cls)


def _default_kafka() -> KafkaConnection:
    return KafkaConnection.model_validate({})  # validate, not __init__: the parent reads the environment


# ============================================================================================================
# Gateway settings

_TOPIC_CHARS = re.compile(r"[A-Za-z0-9._-]+")
_MAX_TOPIC_NAME: Final = 249
_CHECKPOINT_TOPIC_PREFIX: Final = "_dcpgw-checkpoints."  # gateway.resume.checkpoint_topic_name
#: an interval in seconds: finite and > 0
PositiveSeconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]


class GatewaySettings(BaseSettings):
    """Every setting of one ``dcpgw up`` process. Construct with :func:`load_settings`.

    Direct construction works the same way (keyword arguments are the highest-precedence overrides;
    ``DCPGW_CONFIG_FILE`` names a file) and also raises :class:`ConfigError`.
    """

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="__",
        extra="forbid",
        frozen=True,
    )

    # engine
    bucket: str = Field(default="default", description="Bucket name (engine BucketConfig.name rules).")
    data_dir: Path = Field(default=Path("./data"), description="Engine data directory.")  # issue 3's default
    num_vbuckets: int = Field(default=1024, ge=1, le=65536)
    expiry_pager_interval_s: PositiveSeconds = 60.0
    compaction_interval_s: PositiveSeconds = 600.0
    flush_interval_s: PositiveSeconds = 0.05
    #: > 1: an in-process cluster of engine nodes behind the gateway (docs/gateway-cluster.md)
    cluster_nodes: int = Field(default=1, ge=1, le=64)
    cluster_replicas: int = Field(default=1, ge=0, le=3)
    #: the bucket's XDCR conflict-resolution mode, fixed when the bucket is created (docs/xdcr.md "Target side")
    conflict_resolution: Literal["seqno", "lww"] = "seqno"
    # streams
    topic_prefix: str = Field(default="dcp", min_length=1)
    value_format: ValueFormat = "avro"
    stream_from: StreamFrom = "saved-offset-or-beginning"
    key_filter_prefix: str | None = None
    key_filter_regex: str | None = None
    flow_control_buffer_bytes: int = Field(default=16 * MIB, ge=64 * KIB)
    checkpoint_interval_s: PositiveSeconds = 1.0
    #: scale-out (docs/scale-out.md): partitions of the coordination topic ``<topic>.members`` when a gateway
    #: member creates it, and how long a silent member stays in the group
    group_partitions: int = Field(default=64, ge=1, le=65536)
    group_session_timeout_ms: int = Field(default=10_000, ge=1000, le=300_000)
    #: ``dcpgw up --gateways K``: K gateway processes in one group publish the engine (single node only)
    gateways: int = Field(default=1, ge=1, le=64)
    #: write backpressure: above this many bytes of accepted, not yet Kafka-acknowledged writes, PUT / DELETE /
    #: _bulk answer 503 with Retry-After (docs/reliability.md "Stalled broker and health")
    max_unacked_bytes: int = Field(default=64 * MIB, ge=64 * KIB)
    #: /health/ready: not ready once the oldest unacknowledged record is this old (delivery stalled)
    health_delivery_stall_s: PositiveSeconds = 5.0
    #: /health/ready: not ready once a vbucket with records pending has made no progress for this long
    health_vbucket_stall_s: PositiveSeconds = 30.0
    #: SIGTERM / SIGINT: how long ``dcpgw up`` waits for Kafka's delivery reports and checkpoints before it
    #: drops what is still queued and exits (docs/reliability.md "Fault campaign", bounded stop)
    shutdown_timeout_s: float = Field(default=10.0, gt=0, le=300)
    #: publish only persisted items (flush the engine before every DCP step): a crash of the process then
    #: never needs a rollback record (docs/gateway.md)
    rollback_mitigation: bool = True
    #: cluster mode: a delta recovery writes a recovering node's unreplicated document versions back to the
    #: actives before its copies roll back (docs/cluster.md "Rollback repair")
    rollback_repair: bool = True
    # topics
    create_topic_partitions: int | None = Field(default=None, ge=1)
    topic_replication_factor: int = Field(default=1, ge=1, le=32767)
    # producer
    producer_linger_ms: int = Field(default=20, ge=0, le=900_000)
    producer_batch_size: int = Field(default=1_048_576, ge=1, le=2_147_483_647)
    producer_compression: Compression = "lz4"
    #: a record Kafka refuses as too large: ``skip`` publishes an oversize control record in its place,
    #: ``fail`` stops that vbucket's stream (docs/reliability.md "Large documents")
    oversize_policy: OversizePolicy = "skip"
    # HTTP API
    http_host: str = Field(default="127.0.0.1", min_length=1)
    http_port: int = Field(default=8091, ge=0, le=65535)  # issue 3's default (Couchbase's REST port)
    # security (docs/security.md)
    #: first start only: the password of the user ``Administrator`` (generated, printed once and stored 0600 in
    #: ``<data_dir>/admin-password`` when unset); ignored once the user store has a user
    admin_password: SecretStr | None = None
    #: lifetime of a bearer token issued by ``POST /auth/token``
    token_ttl_s: float = Field(default=3600.0, gt=0, le=30 * 86400, allow_inf_nan=False)
    #: PEM certificate chain and key: the HTTP API (and the KV port) serve TLS
    tls_cert: Path | None = None
    tls_key: Path | None = None
    #: PEM CA: clients must present a certificate it signed (mutual TLS)
    tls_client_ca: Path | None = None
    # Kafka
    kafka: KafkaConnection = Field(default_factory=_default_kafka)
    #: `dcpgw up` fails (one line naming the address) when Kafka answers no metadata request within this
    kafka_connect_timeout_s: PositiveSeconds = 10.0
    #: the KV port (memcached binary protocol for the Couchbase SDKs, docs/kv-protocol.md); 0 picks a free one
    kv_port: int = Field(default=11210, ge=0, le=65535)

    def __init__(self, *args: Any, **values: Any) -> None:
        path = _config_file_path()
        data = _read_config_file(path) if path is not None else {}
        source = f"config file {path}" if path is not None else None
        token = _FILE_VALUES.set(data)
        try:
            super().__init__(*args, **values)
        except ValidationError as exc:
            origins = _Origins(ENV_PREFIX, values, path, data, ("kafka",))
            raise ConfigError(_problems_from(exc, type(self), origins), source=source) from None
        except SettingsError as exc:
            raise ConfigError(_settings_error_text(exc), source=source) from None
        finally:
            _FILE_VALUES.reset(token)

    __init__.__pydantic_base_init__ = True  # type: ignore[attr-defined]  # model_validate() stays pure

    # -------------------------------------------------------------------------------- validation
    @field_validator("bucket", mode="after")
    @classmethod
    def _bucket_name(cls, v: str) -> str:
        try:  # the engine's own rules, so the two cannot drift apart
            BucketConfig.model_validate({"name": v, "data_dir": "."})
        except ValidationError as exc:
            raise ValueError("; ".join(e["msg"] for e in exc.errors() if e["loc"] == ("name",))) from None
        if "%" in v:  # legal for the engine, not in the Kafka topic name {topic_prefix}.{bucket}
            raise ValueError("may not contain '%': the bucket name is part of the Kafka topic name")
        return v

    @field_validator("data_dir", mode="after")
    @classmethod
    def _data_dir(cls, v: Path) -> Path:
        if v.exists() and not v.is_dir():
            raise ValueError("exists and is not a directory")
        return v

    @field_validator("topic_prefix", mode="after")
    @classmethod
    def _topic_prefix(cls, v: str) -> str:
        if not _TOPIC_CHARS.fullmatch(v):
            raise ValueError("may contain only ASCII letters, digits, '.', '_' and '-', as Kafka topic names")
        return v

    @field_validator("key_filter_prefix", "key_filter_regex", mode="after")
    @classmethod
    def _empty_is_none(cls, v: str | None) -> str | None:
        return v or None

    @field_validator("key_filter_regex", mode="after")
    @classmethod
    def _regex(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                re.compile(v)
                re.compile(v.encode())  # keys are matched as bytes (gateway.publisher.KeyFilter)
            except re.error as exc:
                raise ValueError(f"not a valid regular expression: {exc}") from None
        return v

    @field_validator("kafka", mode="after")
    @classmethod
    def _gateway_owned_properties(cls, v: KafkaConnection) -> KafkaConnection:
        problems: list[Problem] = []
        for key in v.extra:
            if key in _PRODUCER_FIELD_PROPERTIES:
                field = _PRODUCER_FIELD_PROPERTIES[key]
                problems.append((("extra", key), f"set by the gateway setting {field!r} "
                                 f"(env {ENV_PREFIX}{field.upper()}); set that instead"))
            elif key in _PINNED_PROPERTIES:
                problems.append((("extra", key), f"cannot be overridden: {_PINNED_PROPERTIES[key]}"))
        if problems:
            raise _problems_error("gateway_property", problems)
        return v

    @model_validator(mode="after")
    def _cluster_shape(self) -> GatewaySettings:
        # ns_server: a vbucket's replicas live on other nodes than its active
        if self.cluster_nodes > 1 and self.cluster_replicas >= self.cluster_nodes:
            raise _problems_error("cluster_shape", [(("cluster_replicas",), (
                f"{self.cluster_replicas} replicas need at least {self.cluster_replicas + 1} nodes "
                f"(cluster_nodes is {self.cluster_nodes})"))])
        return self

    @field_validator("admin_password", mode="after")
    @classmethod
    def _admin_password(cls, v: SecretStr | None) -> SecretStr | None:
        if v is not None and not v.get_secret_value():
            return None  # DCPGW_ADMIN_PASSWORD= (empty): generate one
        return v

    @model_validator(mode="after")
    def _tls_pair(self) -> GatewaySettings:
        if (self.tls_cert is None) != (self.tls_key is None):
            missing = "tls_key" if self.tls_key is None else "tls_cert"
            raise _problems_error("tls", [((missing,), "tls_cert and tls_key go together (HTTPS needs both)")])
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise _problems_error("tls", [(("tls_client_ca",), "needs tls_cert and tls_key (client certificates "
                                                               "are checked over TLS only)")])
        return self

    @model_validator(mode="after")
    def _topic_name_length(self) -> GatewaySettings:
        # data topic {prefix}.{bucket}, checkpoint topic _dcpgw-checkpoints.{prefix}.{bucket} (gateway.resume)
        longest = f"{_CHECKPOINT_TOPIC_PREFIX}{self.topic_prefix}.{self.bucket}"
        if len(longest) > _MAX_TOPIC_NAME:
            excess = len(longest) - _MAX_TOPIC_NAME
            raise _problems_error("topic_name", [(("topic_prefix",), (
                f"{excess} characters too long: the checkpoint topic "
                f"{_CHECKPOINT_TOPIC_PREFIX}<topic_prefix>.<bucket> would exceed Kafka's limit of "
                f"{_MAX_TOPIC_NAME} characters"))])
        return self

    # -------------------------------------------------------------------------------- derived configs
    def engine_config(self) -> BucketConfig:
        """The embedded engine's bucket configuration (name, data directory, vbucket count)."""
        try:
            return BucketConfig.model_validate(
                {"name": self.bucket, "data_dir": self.data_dir, "num_vbuckets": self.num_vbuckets,
                 "conflict_resolution": self.conflict_resolution}
            )
        except ValidationError as exc:
            names = {"name": "bucket"}
            raise ConfigError([
                (names.get(str(e["loc"][0]), str(e["loc"][0])) if e["loc"] else "", e["msg"])
                for e in exc.errors(include_url=False)
            ]) from None

    def max_record_bytes(self) -> int:
        """The largest record the gateway produces: the engine's largest value plus key, headers and framing."""
        return int(BucketConfig.model_fields["max_value_size"].default) + RECORD_OVERHEAD_BYTES

    def producer_config(self) -> LibrdkafkaConfig:
        """librdkafka settings of the gateway's producers: the connection (consumer-only properties left out),
        a bounded local queue, records up to :meth:`max_record_bytes` (``kafka.extra`` may lower it), and the
        delivery guarantees the gateway relies on (idempotence, acks=all)."""
        conf: LibrdkafkaConfig = {"queue.buffering.max.kbytes": PRODUCER_QUEUE_MAX_KBYTES,
                                  "message.max.bytes": self.max_record_bytes()}
        conf.update(_without(self.kafka.to_librdkafka(), consumer_only(self.kafka.extra)))
        conf.update({
            "enable.idempotence": True,
            "acks": "all",
            "max.in.flight.requests.per.connection": 5,
            "linger.ms": self.producer_linger_ms,
            "batch.size": self.producer_batch_size,
            "compression.type": self.producer_compression,
            # never let a produce recreate a topic the broker lost: the gateway creates its topics itself
            # (partition count, limits) and republishes when the topic lost its log (docs/reliability.md
            # "Fault campaign"); a vanished topic fails deliveries after this instead of the default 30 s
            "allow.auto.create.topics": False,
            "topic.metadata.propagation.max.ms": 10_000,
        })
        return conf

    def consumer_config(self, group_id: str | None = None) -> LibrdkafkaConfig:
        """librdkafka settings of a consumer: the connection (producer-only properties left out), reading
        from the earliest offset, never committing. ``group_id`` None = a fresh, unique group id."""
        conf: LibrdkafkaConfig = {"auto.offset.reset": "earliest"}
        conf.update(_without(self.kafka.to_librdkafka(), producer_only(self.kafka.extra)))
        conf.update({
            "group.id": group_id or f"dcpgw-{self.bucket}-{uuid.uuid4().hex[:12]}",
            "enable.auto.commit": False,
        })
        return conf

    def admin_config(self) -> LibrdkafkaConfig:
        """librdkafka settings of an AdminClient: the connection minus producer-/consumer-only properties."""
        extra = self.kafka.extra
        return _without(self.kafka.to_librdkafka(), producer_only(extra) | consumer_only(extra))

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # highest precedence first; pydantic-settings deep-merges the nested `kafka` tables
        return (
            init_settings,
            env_settings,
            _UnknownEnvSource(settings_cls),
            _BootstrapEnvSource(settings_cls),
            _FileSource(settings_cls),
        )


def _without(config: LibrdkafkaConfig, drop: frozenset[str]) -> LibrdkafkaConfig:
    return {k: v for k, v in config.items() if k not in drop}


# ============================================================================================================
# Loading

#: the file load_settings() was given (None: $DCPGW_CONFIG_FILE, if set)
_EXPLICIT_FILE: contextvars.ContextVar[Path | None] = contextvars.ContextVar("dcpgw_config", default=None)
#: the loaded file's values while GatewaySettings.__init__ runs (read by _FileSource)
_FILE_VALUES: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "dcpgw_file_values", default=None
)


def load_settings(config_file: Path | str | None = None, **overrides: Any) -> GatewaySettings:
    """Build the settings. Precedence: ``overrides`` > ``DCPGW_*`` environment variables (then
    ``KAFKA_BOOTSTRAP_SERVERS`` for ``kafka.bootstrap_servers``) > the config file > defaults.

    ``config_file`` (else ``$DCPGW_CONFIG_FILE``) is TOML, or JSON when its name ends in ``.json``.
    ``overrides`` are setting names (``http_port=0``); ``kafka`` takes a partial mapping. Any problem -- a
    missing or malformed file, an unknown setting, an invalid value -- raises one :class:`ConfigError`
    naming every bad field.
    """
    token = _EXPLICIT_FILE.set(Path(config_file) if config_file is not None else None)
    try:
        return GatewaySettings(**overrides)
    finally:
        _EXPLICIT_FILE.reset(token)


def _config_file_path() -> Path | None:
    explicit = _EXPLICIT_FILE.get()
    if explicit is not None:
        return explicit
    from_env = os.environ.get(CONFIG_FILE_ENV, "").strip()
    return Path(from_env) if from_env else None


def _read_config_file(path: Path) -> dict[str, Any]:
    """The settings table of a TOML (or ``.json``) file; ConfigError for anything unreadable or malformed."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a directory") from None
    except OSError as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {exc.start})") from None
    data: Any
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"config file {path} is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})"
            ) from None
    else:
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a table of settings, not {type(data).__name__}")
    return data


class _MappingSource(PydanticBaseSettingsSource):
    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # unused: __call__ returns the whole mapping

    def __call__(self) -> dict[str, Any]:
        raise NotImplementedError


class _FileSource(_MappingSource):
    """The config file's values (read by GatewaySettings.__init__)."""

    def __call__(self) -> dict[str, Any]:
        return _FILE_VALUES.get() or {}


class _BootstrapEnvSource(_MappingSource):
    """``KAFKA_BOOTSTRAP_SERVERS`` -> ``kafka.bootstrap_servers`` (below the DCPGW_* variables)."""

    def __call__(self) -> dict[str, Any]:
        value = os.environ.get(BOOTSTRAP_ENV, "").strip()
        return {"kafka": {"bootstrap_servers": value}} if value else {}


class _UnknownEnvSource(_MappingSource):
    """Turns unknown ``<prefix>NAME`` variables into unknown keys, so validation reports them (typos)."""

    def __call__(self) -> dict[str, Any]:
        prefix = str(self.settings_cls.model_config.get("env_prefix", "")).upper()
        fields = self.settings_cls.model_fields
        unknown: dict[str, Any] = {}
        for name, value in os.environ.items():
            upper = name.upper()
            if not upper.startswith(prefix) or upper in RESERVED_ENV_VARS:
                continue
            rest = upper[len(prefix):].lower()
            if rest and rest.split("__", 1)[0] not in fields:
                unknown[rest] = value
        return unknown


# ============================================================================================================
# ValidationError -> ConfigError


class _Origins:
    """Finds where a value came from: overrides, environment, config file (for error messages)."""

    def __init__(self, env_prefix: str, overrides: Mapping[str, Any], file: Path | None,
                 file_data: Mapping[str, Any], kafka_loc: tuple[str, ...]) -> None:
        self.env_prefix = env_prefix
        self.overrides = overrides
        self.file = file
        self.file_data = file_data
        self.kafka_loc = kafka_loc
        self.env = {k.upper(): k for k in os.environ}

    def find(self, loc: tuple[str | int, ...]) -> str | None:
        if loc and _dig(self.overrides, loc):
            return "from an override argument"
        for i in range(len(loc), 0, -1):
            name = self.env_prefix + "__".join(str(p) for p in loc[:i]).upper()
            if name in self.env:
                return f"from environment variable {self.env[name]}"
        if loc == (*self.kafka_loc, "bootstrap_servers") and BOOTSTRAP_ENV in os.environ:
            return f"from environment variable {BOOTSTRAP_ENV}"
        if loc and self.file is not None and _dig(self.file_data, loc):
            return f"in {self.file}"
        return None


def _dig(data: Any, loc: tuple[str | int, ...]) -> bool:
    """Whether ``data`` holds a value at ``loc`` (or at a prefix of it, for a value given as a whole)."""
    for depth, part in enumerate(loc):
        if isinstance(data, BaseModel) and depth:
            return True
        if not isinstance(data, Mapping):
            return depth > 0
        if part not in data:
            return False
        data = data[part]
    return True


def _fmt_loc(loc: Sequence[str | int]) -> str:
    out = ""
    for i, part in enumerate(loc):
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.isidentifier() and (i == 0 or loc[i - 1] != "extra"):
            out += f".{part}" if out else part
        else:
            out += f'["{part}"]'
    return out


def _did_you_mean(name: str, candidates: Sequence[str] | frozenset[str]) -> str:
    close = difflib.get_close_matches(name, sorted(candidates), n=3, cutoff=0.6)
    return f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""


def _model_at(cls: type[BaseModel], loc: Sequence[str | int]) -> type[BaseModel] | None:
    for part in loc:
        field = cls.model_fields.get(str(part))
        sub = field.annotation if field is not None else None
        if not (isinstance(sub, type) and issubclass(sub, BaseModel)):
            return None
        cls = sub
    return cls


def _show(value: Any) -> str | None:
    if isinstance(value, Mapping | BaseModel | list | tuple | set):
        return None  # a whole table: may hold secrets, and is not what the message is about
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _problems_from(exc: ValidationError, cls: type[BaseModel], origins: _Origins) -> list[tuple[str, str]]:
    problems: list[tuple[str, str]] = []
    for err in exc.errors(include_url=False):
        loc: tuple[str | int, ...] = tuple(err["loc"])
        ctx = err.get("ctx") or {}
        if "problems" in ctx:
            for sub, message in ctx["problems"]:
                full = (*loc, *sub)
                problems.append((_fmt_loc(full), _annotate(message, None, origins.find(full))))
            continue
        if err["type"] == "extra_forbidden":
            parent = _model_at(cls, loc[:-1])
            names = list(parent.model_fields) if parent is not None else []
            hint = _did_you_mean(str(loc[-1]), names)
            kafka_cls = _model_at(cls, origins.kafka_loc) if origins.kafka_loc else None
            if not hint and parent is cls and kafka_cls is not None and loc[-1] in kafka_cls.model_fields:
                hint = f" (did you mean {_fmt_loc((*origins.kafka_loc, loc[-1]))!r}?)"
            problems.append((_fmt_loc(loc), _annotate("unknown setting" + hint, None, origins.find(loc))))
            continue
        message = err["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ")
        secret = any(isinstance(p, str) and is_secret_property(p) for p in loc)
        got = MASK if secret else _show(err["input"])
        problems.append((_fmt_loc(loc), _annotate(message, got, origins.find(loc))))
    return problems


def _annotate(message: str, got: str | None, origin: str | None) -> str:
    notes = [n for n in (f"got {got}" if got is not None else None, origin) if n]
    return f"{message} ({', '.join(notes)})" if notes else message


def _settings_error_text(exc: SettingsError) -> str:
    # pydantic-settings could not parse a complex value (JSON) from a source; its message names the field.
    match = re.search(r'field "([^"]+)" from source "([^"]+)"', str(exc))
    if match:
        field, source = match.groups()
        where = "an environment variable" if "Env" in source else source
        return f"{field}: not valid JSON (from {where}; tables given in environment variables must be JSON)"
    return str(exc).split("\n", 1)[0]

