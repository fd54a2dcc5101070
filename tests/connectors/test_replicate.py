"""``dcpgw replicate`` (connectors/replicate.py) as a subprocess against a topic of the in-process gateway."""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.broker import Broker
from tests.gateway.processes import dcpgw
from tests.harness import Harness, write


@pytest.fixture
def harness(kafka_broker: Broker, tmp_path: Path) -> Iterator[Any]:
    h = Harness(kafka_broker, tmp_path / "h", rollback_mitigation=False)
    yield h
    h.close()


def run_cli(*args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    proc = dcpgw("replicate", *args, env={**os.environ, **(env or {})}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def table(db: Path) -> dict[bytes, tuple[bytes, int]]:
    with sqlite3.connect(db) as conn:
        return {k.encode(): (bytes(v), vb) for k, v, vb in conn.execute("SELECT key, value, vbucket FROM docs")}


@pytest.mark.slow
def test_cli_replicate_until_caught_up_equals_engine_across_a_crash(harness: Harness, tmp_path: Path) -> None:
    h = harness
    write(h.bucket, 200)
    h.bucket.flush_all()
    h.settle()
    db = tmp_path / "replica.sqlite"
    out = run_cli("--topic", h.topic, "--db", str(db), "--until-caught-up",
                  "--bootstrap", h.broker.bootstrap_servers)
    assert out["docs"] == len(h.bucket.state_snapshot()) and out["rollbacks"] == 0
    assert table(db) == h.bucket.state_snapshot()
    write(h.bucket, 50, start=200)  # published unpersisted, applied by the replica, then lost
    h.publish_unpersisted()
    run_cli("--topic", h.topic, "--db", str(db), "--until-caught-up",
            env={"KAFKA_BOOTSTRAP_SERVERS": h.broker.bootstrap_servers})
    h.crash_engine()
    write(h.bucket, 20, start=5000)
    h.bucket.flush_all()
    h.settle()
    out = run_cli("--topic", h.topic, "--db", str(db), "--until-caught-up",
                  "--bootstrap", h.broker.bootstrap_servers)
    assert out["rollbacks"] > 0
    assert table(db) == h.bucket.state_snapshot()


def test_cli_replicate_without_a_broker_fails_cleanly(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "KAFKA_BOOTSTRAP_SERVERS"}
    proc = dcpgw("replicate", "--db", str(tmp_path / "r.sqlite"), "--data-dir", str(tmp_path), env=env)
    assert proc.returncode == 2 and "no running gateway" in proc.stderr
