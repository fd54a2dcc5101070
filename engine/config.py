"""Bucket configuration (validated; unknown keys are rejected)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MIB = 1024 * 1024


class BucketConfig(BaseModel):
    """Everything that shapes one bucket of the embedded engine."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field("default", min_length=1, max_length=100, pattern=r"^[A-Za-z0-9_.%-]+$")
    data_dir: Path
    num_vbuckets: int = Field(1024, ge=1, le=65536)
    max_value_size: int = Field(20 * MIB, ge=1)
    #: kv_engine chk_max_items / checkpoint_max_size
    checkpoint_max_items: int = Field(10_000, ge=1)
    checkpoint_max_bytes: int = Field(10 * MIB, ge=1024)
    #: bucket-wide checkpoint memory quota; above 90 % of it memory is recovered down to 60 %
    checkpoint_quota_bytes: int = Field(512 * MIB, ge=64 * 1024)
    #: prior versions superseded within this many seqnos of the high seqno are kept (rollback history)
    history_seqnos: int = Field(100_000, ge=0)
    #: tombstones older than this are purged by compaction (kv_engine metadata purge interval, 3 days)
    tombstone_purge_age_s: float = Field(3 * 24 * 3600, ge=0)
    failover_log_max_entries: int = Field(25, ge=1, le=1000)
    flush_batch_items: int = Field(250_000, ge=1)
    backfill_chunk_items: int = Field(2048, ge=1)
    sqlite_synchronous: Literal["OFF", "NORMAL", "FULL", "EXTRA"] = "NORMAL"
    #: tune CPython's cyclic GC for millions of resident items (process-wide; see engine.bucket.tune_gc)
    tune_gc: bool = True
    #: synchronous replication (docs/durability.md "Levels and timeouts"): the timeout of a sync write that asks for the bucket default
    #: (timeout 0; kv_engine ``durability_timeout``), and the floor below which a requested timeout is raised
    #: (the RFC's ``persistence_timeout_floor``, 1500 ms)
    durability_timeout_ms: int = Field(10_000, ge=1, le=0xFFFE)
    durability_timeout_floor_ms: int = Field(1500, ge=0, le=0xFFFE)
    #: XDCR target conflict resolution (docs/xdcr.md "Target side"), fixed when the bucket is created and
    #: recorded in its data directory: ``seqno`` (revision seqno first) or ``lww`` (HLC CAS first)
    conflict_resolution: Literal["seqno", "lww"] = "seqno"
    #: seed for vbuuid generation (tests); None = system randomness
    seed: int | None = None

    @field_validator("data_dir")
    @classmethod
    def _dir_not_file(cls, v: Path) -> Path:
        if v.exists() and not v.is_dir():
            raise ValueError(f"data_dir {v} exists and is not a directory")
        return v
