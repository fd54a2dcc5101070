"""Real ``dcpgw`` processes for the end-to-end tests: the one runner of the command line, the one ``dcpgw up``
process (GatewayProc), the one HTTP helper, a private embedded broker, and the end-state check of a gateway's
topic against its engine."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient

from engine import Bucket, BucketConfig
from gateway.broker import Broker, EmbeddedTansuBroker, ExternalBroker
from gateway.invariants import check_partition, data_positions
from tests.connectors.noida_es import free_port, noida_binary
from tests.credentials import ADMIN_PASSWORD, ADMIN_PASSWORD_ENV, auth_headers
from tests.gateway.kafka_util import TopicReplica, read_topic

#: vbuckets of a GatewayProc unless it is given others
NVB = 16

#: environment without any broker / gateway setting of the caller -- but with the test admin password
#: (tests/credentials.py): `dcpgw up` creates Administrator with it, the CLI falls back to it
CLEAN_ENV = {**{k: v for k, v in os.environ.items()
                if not k.startswith("DCPGW_") and k not in ("KAFKA_BOOTSTRAP_SERVERS", "CALF_TANSU_BIN")},
             ADMIN_PASSWORD_ENV: ADMIN_PASSWORD, "DCPGW_KV_PORT": "0"}

CLI = [sys.executable, "-m", "gateway.cli"]
#: the checkout: the working directory of the processes, so that they import this copy of the packages
ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------------ the command line
def dcpgw(*args: str, env: Mapping[str, str] | None = None,
          timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run ``dcpgw ARGS`` to its end (environment: ``env``, else the caller's); output captured as text."""
    return subprocess.run([*CLI, *args], env=dict(os.environ if env is None else env), cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def replicate_process(broker: Broker, topic: str, db: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """``dcpgw replicate`` of ``topic`` into the SQLite file ``db``, run to its end."""
    return dcpgw("replicate", "--topic", topic, "--db", str(db), "--bootstrap", broker.bootstrap_servers, *extra,
                 timeout=180)


def dcpgw_background(*args: str, env: Mapping[str, str] | None = None) -> subprocess.Popen[str]:
    """Start ``dcpgw ARGS`` (environment: ``env``, else CLEAN_ENV) with its stdout and stderr piped as text."""
    return subprocess.Popen([*CLI, *args], env=dict(CLEAN_ENV if env is None else env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


# ------------------------------------------------------------------------------------------ HTTP
def request(url: str, method: str = "GET", body: bytes | None = None, timeout: float = 10) -> bytes:
    """The body of the answer; an HTTP error status raises urllib.error.HTTPError. As the admin user."""
    req = urllib.request.Request(url, data=body, method=method, headers=auth_headers())
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return bytes(r.read())


def call(url: str, method: str = "GET", body: bytes | None = None, timeout: float = 10) -> Any:
    """The JSON body of the answer; an HTTP error status raises urllib.error.HTTPError."""
    return json.loads(request(url, method, body, timeout))


def answer(url: str, method: str = "GET", body: bytes | None = None,
           bound_s: float = 3.0) -> tuple[int, dict[str, str], bytes, float]:
    """(status, headers, body, seconds) of any answer, error statuses included; fails the test unless the
    request is answered within ``bound_s`` (a "did not hang" bound, never a timing target). As the admin user."""
    req = urllib.request.Request(url, data=body, method=method, headers=auth_headers())
    t = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=bound_s + 5) as r:
            status, headers, raw = r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        status, headers, raw = e.code, dict(e.headers), e.read()
    except (TimeoutError, urllib.error.URLError) as e:  # pragma: no cover - the failure the callers are about
        raise AssertionError(f"{method} {url} not answered within {bound_s + 5} s: {e}") from e
    took = time.monotonic() - t
    assert took < bound_s, f"{method} {url} took {took:.2f} s"
    return status, headers, raw, took


# ------------------------------------------------------------------------------------------ dcpgw up
class GatewayProc:
    """A ``dcpgw up`` process on ``broker`` with its data in ``data_dir`` and its stderr appended to
    ``data_dir.parent / "gw.log"``; ``env`` adds to or overrides its settings (on ``base_env``, default the
    caller's environment). ``checkpoint_interval_s=None`` leaves the product's default checkpoint interval."""

    def __init__(self, broker: Broker, data_dir: Path, bucket: str, nvb: int = NVB,
                 base_env: Mapping[str, str] | None = None, checkpoint_interval_s: str | None = "0.2",
                 **env: str) -> None:
        self.broker = broker
        self.data_dir = data_dir
        self.bucket = bucket
        self.env = {
            **(os.environ if base_env is None else base_env),
            "KAFKA_BOOTSTRAP_SERVERS": broker.bootstrap_servers,
            "DCPGW_DATA_DIR": str(data_dir),
            "DCPGW_BUCKET": bucket,
            "DCPGW_NUM_VBUCKETS": str(nvb),
            "DCPGW_HTTP_PORT": "0",
            **({} if checkpoint_interval_s is None else {"DCPGW_CHECKPOINT_INTERVAL_S": checkpoint_interval_s}),
            **env,
        }
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""

    @property
    def log(self) -> Path:
        return self.data_dir.parent / "gw.log"

    def start(self) -> None:
        """Start it and wait until its state file names its URL and ``/health`` says ok."""
        state = self.data_dir / "dcpgw-state.json"
        state.unlink(missing_ok=True)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([*CLI, "up", "--no-progress"],
                                         env=self.env, stdout=subprocess.DEVNULL, stderr=log)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            if state.exists():
                try:
                    self.url = json.loads(state.read_text())["http_url"]
                    if self.get("/health")["status"] == "ok":
                        return
                except (ValueError, OSError, KeyError):
                    pass
            time.sleep(0.1)
        raise AssertionError("gateway did not come up")

    def get(self, path: str) -> Any:
        return call(self.url + path)

    def bulk(self, docs: list[dict[str, Any]]) -> None:
        assert call(self.url + "/docs/_bulk", "POST", json.dumps(docs).encode(), timeout=30)["written"] == len(docs)

    def wait_caught_up(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.get("/stats")["lag"] == 0:
                return
            time.sleep(0.1)
        raise AssertionError(f"never caught up: {self.get('/stats')}")

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(60) == 0

    def close(self) -> None:
        """kill -9 unless it has exited already (teardown of a test that may have failed midway)."""
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()


def docs(lo: int, hi: int) -> list[dict[str, Any]]:
    return [{"key": f"doc{i}", "value": {"n": i, "v": lo}} for i in range(lo, hi)]


def verify(broker: Broker, data_dir: Path, bucket: str, nvb: int = NVB, *, topic: str | None = None) -> None:
    """Every engine item is in the topic exactly once, each partition passes the invariants, and a replica
    built from the topic equals the engine."""
    topic = topic or f"dcp.{bucket}"
    recs = read_topic(broker.bootstrap_servers, topic)
    parts: dict[int, list] = {}
    for p, _o, r in recs:
        parts.setdefault(p, []).append(r)
    for rs in parts.values():
        check_partition(rs)
    c = Counter((r.vbucket, r.seqno) for _p, _o, r in recs if r.is_data)
    dups = [k for k, n in c.items() if n > 1]
    assert not dups, f"published twice: {dups[:10]}"
    b = Bucket(BucketConfig(data_dir=data_dir, name=bucket, num_vbuckets=nvb))
    try:
        for vb in b.vbuckets():
            for it in vb.ht.values():
                assert (vb.id, it.seqno) in c, f"engine item vb={vb.id} seqno={it.seqno} not in Kafka"
        replica = TopicReplica()
        replica.apply_all(recs)
        assert replica.rollbacks == 0
        assert replica.state() == b.state_snapshot()
    finally:
        b.close()


# ------------------------------------------------------------------------------------------ dcpgw gateway
ASSIGNED = re.compile(r"group \S+: assigned \d+ coordination partitions, (\d+) vbuckets")


class Member:
    """One ``dcpgw gateway`` process, its log in a file."""

    def __init__(self, env: dict[str, str], source: str, group: str, log: Path) -> None:
        self.log = log
        self.f = log.open("w")
        self.proc = subprocess.Popen([*CLI, "gateway", "--source", source, "--group", group], env=env, cwd=ROOT,
                                     stdout=self.f, stderr=subprocess.STDOUT, text=True)

    def assignments(self) -> list[int]:
        """vbucket counts of every assignment this member logged, oldest first."""
        return [int(m.group(1)) for m in ASSIGNED.finditer(self.log.read_text())]

    def kill9(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
                return -9
        return self.proc.returncode



class Churn:
    """The scale-out tests' load: each call writes ``n`` documents over ``keys`` keys of ``cluster`` in turn,
    deleting every ``delete_every``-th key again after writing it; :attr:`written` counts the writes."""

    def __init__(self, cluster: Any, keys: int = 120, delete_every: int = 6) -> None:
        self.cluster = cluster
        self.keys = keys
        self.delete_every = delete_every
        self.written = 0

    def __call__(self, n: int = 3) -> None:
        for _ in range(n):
            i = self.written
            key = f"k{i % self.keys}"
            self.cluster.write(key, f'{{"n": {i}}}'.encode())
            if i % self.delete_every == 0:
                self.cluster.delete(key)
            self.written += 1

    def for_seconds(self, seconds: float, what: str = "load") -> None:
        """Keep writing for ``seconds``."""
        t_end = time.monotonic() + seconds
        wait_for(lambda: time.monotonic() > t_end, what, seconds + 10, self)


def member_env(broker: Broker, prefix: str) -> dict[str, str]:
    return {**CLEAN_ENV, "KAFKA_BOOTSTRAP_SERVERS": broker.bootstrap_servers, "DCPGW_TOPIC_PREFIX": prefix,
            "DCPGW_BUCKET": "default", "DCPGW_GROUP_SESSION_TIMEOUT_MS": "6000", "DCPGW_GROUP_PARTITIONS": "4",
            "DCPGW_CREATE_TOPIC_PARTITIONS": "8", "DCPGW_CHECKPOINT_INTERVAL_S": "0.2"}


def wait_for(cond: Callable[[], bool], what: str, timeout: float, tick: Callable[[], None] | None = None,
             members: list[Member] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            logs = "\n".join(m.log.read_text()[-3000:] for m in members or [])
            raise AssertionError(f"timed out: {what}\n{logs}")
        if tick is not None:
            tick()
        time.sleep(0.05)


def check_member_topic(broker: Broker, topic: str, want: Any, members: list[Member], partitions: int = 8) -> None:
    """The end state of a group's topic: its replay equals ``want`` (the engine's actives, waited for), every
    partition passes the invariants checker and no document change is published twice."""

    def caught_up() -> bool:
        replica = TopicReplica()
        replica.apply_all(read_topic(broker.bootstrap_servers, topic))
        return bool(replica.state() == want)

    wait_for(caught_up, "the topic's replay equals the engine", 90, None, members)
    recs = read_topic(broker.bootstrap_servers, topic)
    for part in range(partitions):
        mine = [(o, r) for p, o, r in recs if p == part]
        check_partition(mine)
        dup = [k for k, n in data_positions(mine).items() if n > 1]
        assert not dup, dup[:5]


# ------------------------------------------------------------------------------------------ brokers
@contextmanager
def private_broker() -> Iterator[EmbeddedTansuBroker]:
    """An embedded Tansu broker of one test (or module) alone, so pausing or killing it stalls nothing else;
    resumed and stopped on exit."""
    broker = EmbeddedTansuBroker().start()
    try:
        yield broker
    finally:
        if broker.paused:
            broker.resume()
        broker.stop()


@contextmanager
def noida_broker() -> Iterator[Broker]:
    """A noida-db server (docs/kafka-compat.md "noida-db") with only its Kafka service, on a free loopback port,
    its data in a temporary dir; skips the test, with the reason, where noida-db is not installed or cannot
    run here."""
    binary = noida_binary()
    data = Path(tempfile.mkdtemp(prefix="dcpgw-noida-"))
    port = free_port()
    with open(data / "noida.log", "wb") as log:
        proc = subprocess.Popen([str(binary), "start", "--only", "kafka", "--kafka-port", str(port),
                                 "--data-dir", str(data / "d")], stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        bootstrap = f"127.0.0.1:{port}"
        admin = AdminClient({"bootstrap.servers": bootstrap})
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                pytest.skip(f"noida-db did not start (exit {proc.returncode}): "
                            f"{(data / 'noida.log').read_text()[-500:]}")
            try:
                admin.list_topics(timeout=1)
                break
            except KafkaException:
                if time.monotonic() > deadline:
                    pytest.skip("noida-db's Kafka service did not answer within 30 s")
                time.sleep(0.1)
        yield ExternalBroker(bootstrap)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(data, ignore_errors=True)
