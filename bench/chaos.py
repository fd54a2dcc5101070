"""Fault campaign: ``python -m bench.chaos --histories N --seed S`` (docs/reliability.md "Fault campaign").

Drives real processes -- ``dcpgw up`` (one bucket, or ``--nodes 3 --replicas 1``), ``dcpgw replicate`` and a
Tansu broker the campaign starts itself -- with random writes through the HTTP API (plain and durable, small
and large values, deletes, expiries, ``_bulk``) and random faults:

* ``kill``: SIGKILL of ``dcpgw up`` (its engine nodes are in-process, so this is also the node crash), then a
  restart on the same data directory;
* ``broker_pause``: SIGSTOP / SIGCONT of the broker (a few are longer than ``--ready-threshold-s``, to check
  that readiness turns red);
* ``broker_restart``: the broker stopped and started again on its port -- Tansu keeps nothing across a
  restart, so the topic is gone; the gateway is then restarted (it recreates the topic and republishes the
  engine's state) and the Replicator starts over on a new database;
* ``disk_full``: RLIMIT_FSIZE of the running ``dcpgw up`` lowered (prlimit) to the size of the largest file of
  its data directory, so no file there can grow, then lifted;
* ``slow_consumer``: SIGSTOP / SIGCONT of ``dcpgw replicate``; ``consumer_kill``: SIGKILL + restart of it.

A *session* starts the processes once and runs ``--per-session`` histories on them; a history is 1-2 s of
writes with 1-3 faults, then a check: every acknowledged write still there except those the documented
window allows to be lost (bench/chaos_model.py), the engine (read back through GET), an independent replay of
the topic and the Replicator's database equal, the record-format invariants and no duplicate
(vbuuid, seqno) in any partition, readiness truthful. The seed fixes every choice (``random.Random``); timing
is real, so a rerun with the same seed makes the same choices, not the same interleavings.

Progress on stderr; the last stdout line is one JSON object (keys documented in docs/reliability.md).
Exit status 1 when an acknowledged durable write was lost, a document diverged, a (vbuuid, seqno) was
duplicated, an invariant broke, a plain write was lost outside the window or a restart failed.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import http.client
import json
import os
import random
import resource
import secrets
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.chaos_model import (
    ACKED,
    AMBIGUOUS,
    MAJORITY,
    PERSIST,
    PLAIN,
    REFUSED,
    KeyHistory,
    TopicReplay,
    Write,
)
from bench.processes import process_tree
from gateway.broker import EmbeddedTansuBroker
from schemas.records import RecordType

FAULT_KINDS = ("kill", "broker_pause", "broker_restart", "disk_full", "slow_consumer", "consumer_kill",
               "failover", "rebalance")
_WEIGHTS = {"kill": 1.5, "broker_pause": 3.0, "broker_restart": 0.12, "disk_full": 2.0, "slow_consumer": 2.0,
            "consumer_kill": 0.75, "failover": 2.0, "rebalance": 1.5}
#: fault kinds only a cluster session (dcpgw up --nodes 3) has
CLUSTER_FAULTS = frozenset({"failover", "rebalance"})
#: the largest value the HTTP API accepts (Couchbase's 20 MiB), less room for the JSON around it
HUGE_BYTES = 20 * 1024 * 1024 - 64
#: the keys of the JSON line, in this order (the contract of issue 16), then the extra ones
KEYS = ("histories", "faults", "acked", "acked_durable", "lost_durable", "divergent", "duplicates", "max_api_ms")
HTTP_TIMEOUT = 10.0
#: the status :meth:`Http.call` answers when the connection was refused (the request was not sent)
REFUSED_CONNECTION = -1


def cap_file_size(pid: int, limit: int | None) -> None:
    """A full disk for ``pid`` and every process it started (a real full disk stops them all: the engine's
    storage writer process writes the data files): RLIMIT_FSIZE lowered to ``limit`` bytes, or back to the hard
    limit with None. A process started later inherits its parent's limit."""
    for p in process_tree(pid):
        with contextlib.suppress(OSError, ProcessLookupError):
            hard = resource.prlimit(p, resource.RLIMIT_FSIZE)[1]
            resource.prlimit(p, resource.RLIMIT_FSIZE, (hard if limit is None else limit, hard))


def log(msg: str) -> None:
    print(f"chaos: {msg}", file=sys.stderr, flush=True)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def supports_setting(name: str) -> bool:
    """Whether this checkout's gateway has the setting ``name`` (features merged later are used when there)."""
    from gateway.config import GatewaySettings

    return name in GatewaySettings.model_fields


# ---------------------------------------------------------------------- HTTP
#: the gateways of this campaign create the user Administrator with this password (DCPGW_ADMIN_PASSWORD) and
#: every request sends it (docs/security.md)
ADMIN_PASSWORD = secrets.token_urlsafe(18)
AUTHORIZATION = "Basic " + base64.b64encode(f"Administrator:{ADMIN_PASSWORD}".encode()).decode()


class Http:
    """A keep-alive HTTP/1.1 client to the gateway; a broken connection is reopened on the next call."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.conn: http.client.HTTPConnection | None = None

    def call(self, method: str, path: str, body: bytes | None = None,
             timeout: float = HTTP_TIMEOUT) -> tuple[int | None, bytes, float, dict[str, str]]:
        """(status or None when there was no answer, body, milliseconds, headers)."""
        t0 = time.monotonic()
        try:
            if self.conn is None:
                self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
            self.conn.timeout = timeout
            if self.conn.sock is not None:
                self.conn.sock.settimeout(timeout)
            headers = {"Authorization": AUTHORIZATION}
            if body is not None:
                headers["Content-Type"] = "application/json"
            self.conn.request(method, path, body=body, headers=headers)
            r = self.conn.getresponse()
            data = r.read()
            return r.status, data, (time.monotonic() - t0) * 1000, {k.lower(): v for k, v in r.getheaders()}
        except ConnectionRefusedError:
            self.close()  # nothing was sent: the gateway is down (being restarted)
            return REFUSED_CONNECTION, b"", (time.monotonic() - t0) * 1000, {}
        except (OSError, http.client.HTTPException):
            self.close()
            return None, b"", (time.monotonic() - t0) * 1000, {}

    def close(self) -> None:
        if self.conn is not None:
            with contextlib.suppress(Exception):
                self.conn.close()
        self.conn = None


# ---------------------------------------------------------------------- processes
class Proc:
    """A child process whose stderr is kept (last lines) for reports."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], cwd: str) -> None:
        self.name, self.args, self.env, self.cwd = name, args, env, cwd
        self.p: subprocess.Popen[bytes] | None = None
        self.tail: deque[str] = deque(maxlen=60)

    def start(self) -> None:
        # stderr through a pipe, not a file: RLIMIT_FSIZE (disk_full) must only hit the data directory
        self.p = subprocess.Popen(self.args, env=self.env, cwd=self.cwd, stdin=subprocess.DEVNULL,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        threading.Thread(target=self._drain, args=(self.p,), daemon=True).start()

    def _drain(self, p: subprocess.Popen[bytes]) -> None:
        assert p.stderr is not None
        for line in p.stderr:
            self.tail.append(line.decode("utf-8", "replace").rstrip())

    @property
    def pid(self) -> int:
        assert self.p is not None
        return self.p.pid

    def alive(self) -> bool:
        return self.p is not None and self.p.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        if self.p is not None:
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGKILL)
            self.p.wait()

    def stop(self, timeout: float = 15.0) -> bool:
        """SIGTERM, then SIGKILL after ``timeout``; True when it stopped on SIGTERM."""
        if not self.alive():
            return True
        assert self.p is not None
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        try:
            self.p.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            self.kill()
            return False


# ---------------------------------------------------------------------- stats
@dataclass
class Totals:
    histories: int = 0
    faults: Counter[str] = field(default_factory=Counter)
    acked: int = 0
    acked_durable: int = 0
    lost_durable: int = 0
    divergent: int = 0
    duplicates: int = 0
    max_api_ms: float = 0.0
    # extras
    ambiguous: int = 0
    lost_plain_in_window: int = 0
    lost_plain_outside_window: int = 0
    lost_published: int = 0
    invariant_violations: int = 0
    health_untruthful: int = 0
    not_ready_after_recovery: int = 0
    restart_failures: int = 0
    stop_hangs: int = 0
    broker_loss_unrecovered: int = 0
    max_durable_ms: float = 0.0
    large_acked: int = 0
    large_in_topic: int = 0
    topic_truncations: int = 0
    admin_refused: int = 0
    bulk_entries_refused: int = 0  # entries of a 200 _bulk answer that failed alone (not written)
    rollback_records: int = 0
    oversize_records: int = 0
    sessions: int = 0
    seconds: float = 0.0
    defects: list[str] = field(default_factory=list)

    def failed(self, ready_real: bool) -> bool:
        return bool(self.lost_durable or self.divergent or self.duplicates or self.invariant_violations
                    or self.lost_plain_outside_window or self.lost_published or self.restart_failures
                    or self.stop_hangs or self.broker_loss_unrecovered
                    or (ready_real and (self.health_untruthful or self.not_ready_after_recovery)))

    def to_json(self, **extra: Any) -> dict[str, Any]:
        out: dict[str, Any] = {
            "histories": self.histories, "faults": {k: self.faults.get(k, 0) for k in FAULT_KINDS},
            "acked": self.acked, "acked_durable": self.acked_durable, "lost_durable": self.lost_durable,
            "divergent": self.divergent, "duplicates": self.duplicates, "max_api_ms": round(self.max_api_ms, 1)}
        for k in ("ambiguous", "lost_plain_in_window", "lost_plain_outside_window", "lost_published",
                  "invariant_violations", "health_untruthful", "not_ready_after_recovery", "restart_failures",
                  "stop_hangs", "broker_loss_unrecovered", "rollback_records", "oversize_records", "large_acked",
                  "large_in_topic", "topic_truncations", "admin_refused", "bulk_entries_refused", "sessions"):
            out[k] = getattr(self, k)
        out["max_durable_ms"] = round(self.max_durable_ms, 1)
        out["seconds"] = round(self.seconds, 1)
        out.update(extra)
        out["defects"] = self.defects[:50]
        return out


# ---------------------------------------------------------------------- a session
class Session:
    """One set of processes (broker shared by the campaign) running several histories."""

    def __init__(self, camp: Campaign, index: int, cluster: bool) -> None:
        self.camp = camp
        self.index = index
        self.cluster = cluster
        self.dir = Path(tempfile.mkdtemp(prefix=f"s{index}-", dir=camp.work))
        self.data = self.dir / "data"
        self.port = _free_port()
        self.prefix = f"chaos{camp.seed}x{index}"
        self.topic = f"{self.prefix}.default"
        env = {k: v for k, v in os.environ.items() if not k.startswith("DCPGW_") and k != "KAFKA_BOOTSTRAP_SERVERS"}
        env.update({
            "PYTHONPATH": camp.root + os.pathsep + env.get("PYTHONPATH", ""),
            "KAFKA_BOOTSTRAP_SERVERS": camp.bootstrap,
            "DCPGW_DATA_DIR": str(self.data),
            "DCPGW_HTTP_PORT": str(self.port),
            "DCPGW_NUM_VBUCKETS": str(camp.args.vbuckets),
            "DCPGW_TOPIC_PREFIX": self.prefix,
            "DCPGW_EXPIRY_PAGER_INTERVAL_S": "1",
            "DCPGW_CHECKPOINT_INTERVAL_S": "0.5",
            # readiness: delivery_stalled after this (docs/reliability.md "Fault campaign", readiness)
            "DCPGW_HEALTH_DELIVERY_STALL_S": str(camp.args.ready_threshold_s),
            "DCPGW_ADMIN_PASSWORD": ADMIN_PASSWORD,
            "DCPGW_KV_PORT": "0",  # free KV ports (one per node with --nodes): nothing else on the machine collides
        })
        self.env = env
        args = [sys.executable, "-m", "gateway.cli", "up", "--no-progress"]
        if cluster:
            args += ["--nodes", "3", "--replicas", "1"]
        self.gw = Proc("dcpgw up", args, env, camp.root)
        self.rep: Proc | None = None
        self.rep_n = 0
        self.keys: dict[str, KeyHistory] = {}
        self.key_names = [f"k{index}-{i}" for i in range(camp.args.keys)]
        self.replay = TopicReplay()
        self.rollbacks_seen = 0
        self.records: dict[int, list[Any]] = {}
        self.consumer: Any = None
        self.kills: list[float] = []  # monotonic times of SIGKILLs of the gateway
        self.failovers: list[float] = []  # monotonic times of hard failovers (a node's memory is lost)
        self.out_nodes: list[str] = []
        self.truncations_seen = 0  # nodes a failover / rebalance took out of the map, to add back
        self.next_wid = 0
        self.ready_path = "/health"
        self.broken = False

    # -- processes
    def start_gateway(self) -> bool:
        self.gw.start()
        deadline = time.monotonic() + 60
        h = Http(self.port)
        try:
            while time.monotonic() < deadline:
                if not self.gw.alive():
                    break
                st, _b, _ms, _h = h.call("GET", "/health/live", timeout=2)
                if st is not None and st > 0 and st != 404:
                    return True
                if st == 404:
                    st, _b, _ms, _h = h.call("GET", "/health", timeout=2)
                    if st is not None and st > 0:
                        return True
                time.sleep(0.05)
        finally:
            h.close()
        self.camp.defect(f"session {self.index}: dcpgw up did not come up (exit {self.gw.p and self.gw.p.poll()}): "
                         + " | ".join(list(self.gw.tail)[-4:]))
        self.camp.totals.restart_failures += 1
        self.gw.kill()
        self.broken = True
        return False

    def start_replicator(self) -> None:
        self.rep_n += 1
        db = self.dir / f"replica{self.rep_n}.sqlite"
        self.rep_db = db
        args = [sys.executable, "-m", "gateway.cli", "replicate", "--topic", self.topic, "--bootstrap",
                self.camp.bootstrap, "--db", str(db), "--data-dir", str(self.data)]
        self.rep = Proc("dcpgw replicate", args, self.env, self.camp.root)
        self.rep.start()

    def open(self) -> bool:
        if not self.start_gateway():
            return False
        h = Http(self.port)
        st, _b, _ms, _h = h.call("GET", "/health/ready")
        h.close()
        self.ready_path = "/health" if st == 404 else "/health/ready"
        self.camp.ready_real = self.ready_path == "/health/ready"
        self.start_replicator()
        self.open_consumer()
        return True

    def open_consumer(self) -> None:
        from confluent_kafka import Consumer, TopicPartition

        if self.consumer is not None:
            self.consumer.close()
        self.consumer = Consumer({"bootstrap.servers": self.camp.bootstrap, "group.id": f"chaos-{os.getpid()}",
                                  "enable.auto.commit": False, "enable.partition.eof": False,
                                  "auto.offset.reset": "earliest", "topic.metadata.refresh.interval.ms": 1000,
                                  "log_level": 0})
        # the partitions the topic has now (a broker that lost its log may have recreated it with fewer)
        from confluent_kafka.admin import AdminClient

        parts: list[int] = []
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                md = AdminClient({"bootstrap.servers": self.camp.bootstrap, "allow.auto.create.topics": False}
                                 ).list_topics(self.topic, timeout=2)
                t = md.topics.get(self.topic)
                if t is not None and t.error is None and t.partitions:
                    parts = sorted(t.partitions)
                    break
            time.sleep(0.2)
        self.consumer.assign([TopicPartition(self.topic, p, 0) for p in parts or range(self.camp.args.vbuckets)])
        self.replay = TopicReplay()
        self.rollbacks_seen = 0
        self.records = {}

    def consume(self, budget_s: float = 0.05) -> int:
        """Apply what the topic has to the replay (and keep the records, values dropped, for the checks)."""
        from dataclasses import replace

        from gateway.exceptions import RecordFormatError
        from schemas.codec import decode

        n = 0
        end = time.monotonic() + budget_s
        while True:
            msgs = self.consumer.consume(1000, 0.02 if budget_s else 0)
            for m in msgs:
                if m.error() is not None:
                    continue
                hdrs = dict(m.headers() or [])
                if len(m.value() or b"") > 1_000_000:
                    self.camp.totals.large_in_topic += 1
                if hdrs.get("dcp.type") == b"oversize":
                    self.camp.totals.oversize_records += 1
                    continue
                try:
                    r = decode(m.key(), m.value(), m.headers())
                except RecordFormatError as e:
                    self.camp.defect(f"session {self.index}: undecodable record at {m.partition()}/{m.offset()}: {e}")
                    self.camp.totals.invariant_violations += 1
                    continue
                self.replay.apply(r)
                self.records.setdefault(m.partition(), []).append((m.offset(), replace(r, value=None)))
                n += 1
            if not msgs or time.monotonic() > end:
                return n

    def close(self) -> None:
        if self.rep is not None:
            self.rep.kill()
        if not self.gw.stop():
            self.camp.totals.stop_hangs += 1
            self.camp.defect(f"session {self.index}: dcpgw up did not stop within 15 s of SIGTERM")
        if self.consumer is not None:
            self.consumer.close()
        with contextlib.suppress(Exception):
            from confluent_kafka.admin import AdminClient

            AdminClient({"bootstrap.servers": self.camp.bootstrap}).delete_topics(
                [self.topic, f"_dcpgw-checkpoints.{self.topic}", f"{self.topic}.dlq"], operation_timeout=5)
        if not self.camp.args.keep:
            shutil.rmtree(self.dir, ignore_errors=True)


# ---------------------------------------------------------------------- one history
class History:
    def __init__(self, s: Session, number: int, rng: random.Random) -> None:
        self.s = s
        self.n = number
        self.rng = rng
        self.camp = s.camp
        self.t = s.camp.totals
        self.duration = rng.uniform(*s.camp.args.write_seconds)
        self.faults: list[tuple[float, str, float]] = []  # (start offset, kind, duration)
        self.active: dict[str, float] = {}  # kind -> start time (monotonic), while a fault is on
        self.windows: list[tuple[float, float, str]] = []  # (start, end, kind) of faults
        self.probes: list[tuple[float, int | None, float]] = []
        self.stop_probe = threading.Event()
        self.broker_lost = False
        self.max_api = 0.0
        self.lock = threading.Lock()
        self.statuses: Counter[int | None] = Counter()
        self.restarter: threading.Thread | None = None
        self.t0 = 0.0  # monotonic start of the writes
        self.events: list[tuple[float, str]] = []  # (monotonic, what): admin calls of the faults, for --trace-lost
        self.plan()

    # -- plan
    def plan(self) -> None:
        rng, a = self.rng, self.camp.args
        cluster = getattr(self.s, "cluster", False)
        kinds = [k for k in FAULT_KINDS if k in a.faults and (cluster or k not in CLUSTER_FAULTS)]
        weights = [_WEIGHTS[k] for k in kinds]
        n = rng.randint(1, 3) if kinds else 0
        used: set[str] = set()
        for _ in range(n):
            k = rng.choices(kinds, weights)[0]
            if k in used or (k == "kill" and "disk_full" in used) or (k == "disk_full" and "kill" in used) \
                    or (k in CLUSTER_FAULTS and used & CLUSTER_FAULTS):
                continue
            used.add(k)
            start = rng.uniform(0.1, 0.7) * self.duration
            dur = rng.uniform(0.2, 1.2)
            if k == "broker_pause" and rng.random() < a.long_pause_prob:
                dur = a.ready_threshold_s + 3.0
            self.faults.append((start, k, dur))
        self.faults.sort()

    # -- faults (run on their own thread)
    def _fault_thread(self, t0: float) -> None:
        s = self.s
        ends: list[tuple[float, str]] = []
        for start, kind, dur in self.faults:
            while True:
                now = time.monotonic()
                due = [e for e in ends if e[0] <= now - t0]
                for e in due:
                    self.end_fault(e[1])
                    ends.remove(e)
                if now - t0 >= start:
                    break
                time.sleep(0.005)
            if s.broken:
                return
            self.t.faults[kind] += 1
            self.begin_fault(kind)
            if kind in ("broker_pause", "disk_full", "slow_consumer"):
                ends.append((time.monotonic() - t0 + dur, kind))
        for at, kind in sorted(ends):
            delay = t0 + at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            self.end_fault(kind)

    def begin_fault(self, kind: str) -> None:
        s, camp = self.s, self.camp
        now = time.monotonic()
        with self.lock:
            self.active[kind] = now
        if kind == "kill":
            s.gw.kill()
            s.kills.append(time.monotonic())
            with self.lock:
                del self.active[kind]
                self.windows.append((now, time.monotonic(), kind))
            # restarted on its own thread: the other faults' schedule (a broker pause ending) goes on meanwhile
            self.restarter = threading.Thread(target=s.start_gateway, daemon=True)
            self.restarter.start()
        elif kind == "broker_pause":
            camp.broker.pause()
        elif kind == "broker_restart":
            camp.restart_broker()
            self.broker_lost = True
            with self.lock:
                del self.active[kind]
                self.windows.append((now, time.monotonic() + 1.0, kind))
        elif kind == "disk_full":
            limit = max([f.stat().st_size for f in s.data.rglob("*") if f.is_file()] or [0])
            cap_file_size(s.gw.pid, limit)
        elif kind == "slow_consumer":
            if s.rep is not None:
                s.rep.signal(signal.SIGSTOP)
        elif kind == "consumer_kill":
            if s.rep is not None:
                s.rep.kill()
                s.rep.start()
            with self.lock:
                del self.active[kind]
        elif kind in ("failover", "rebalance"):
            # docs/reliability.md "Fault campaign": the cluster's nodes are in-process; a hard failover (the
            # node's memory is lost to the cluster) or a rebalance out, and the node rebalanced back in after
            node = self.pick_node()
            if node is None:
                self.t.admin_refused += 1
                with self.lock:
                    del self.active[kind]
                return
            if kind == "failover":
                st, _body = self.admin("POST", "/cluster/failover", {"node": node, "graceful": False})
                if st == 200:
                    s.failovers.append(time.monotonic())
            else:
                st, _body = self.admin("POST", "/cluster/rebalance", {"remove": [node]})
            if st not in (200, 202):
                self.t.admin_refused += 1
                with self.lock:
                    del self.active[kind]
                return
            s.out_nodes.append(node)

    def end_fault(self, kind: str) -> None:
        s, camp = self.s, self.camp
        with self.lock:
            start = self.active.pop(kind, None)
        if start is None:
            return
        if kind == "broker_pause":
            camp.broker.resume()
        elif kind == "disk_full":
            cap_file_size(s.gw.pid, None)
        elif kind == "slow_consumer" and s.rep is not None:
            s.rep.signal(signal.SIGCONT)
        elif kind in ("failover", "rebalance"):
            self.heal(5.0)
        with self.lock:
            self.windows.append((start, time.monotonic(), kind))

    def admin(self, method: str, path: str, body: Any = None) -> tuple[int | None, Any]:
        h = Http(self.s.port)
        try:
            st, raw, _ms, _h = h.call(method, path, json.dumps(body).encode() if body is not None else None)
        finally:
            h.close()
        if method == "POST":
            with self.lock:
                self.events.append((time.monotonic(), f"{path} {json.dumps(body)} -> {st}"))
        try:
            return st, json.loads(raw) if raw else None
        except ValueError:
            return st, None

    def pick_node(self) -> str | None:
        """A node of the vbucket map when all three are in it and no rebalance runs (else None)."""
        st, m = self.admin("GET", "/cluster/map")
        if st != 200 or not isinstance(m, dict) or len(m.get("nodes", [])) < 3:
            return None
        st, r = self.admin("GET", "/cluster/rebalance")
        if st == 200 and isinstance(r, dict) and r.get("state") in ("running", "preparing"):
            return None
        return str(self.rng.choice(sorted(m["nodes"])))

    def heal(self, budget_s: float) -> None:
        """Rebalance the nodes the faults took out back in (retried while a rebalance runs)."""
        s = self.s
        deadline = time.monotonic() + budget_s
        while s.out_nodes and time.monotonic() < deadline and not s.broken:
            st, _body = self.admin("POST", "/cluster/rebalance", {"add": list(s.out_nodes)})
            if st in (200, 202):
                s.out_nodes.clear()
                return
            time.sleep(0.2)

    def in_fault(self, t: float) -> bool:
        with self.lock:
            if self.active:
                return True
            return any(a <= t <= b + 0.5 for a, b, _k in self.windows)

    # -- probe thread: readiness + a read, every 50 ms
    def _probe_thread(self) -> None:
        h = Http(self.s.port)
        while not self.stop_probe.is_set():
            t = time.monotonic()
            st, _b, ms, _h = h.call("GET", self.s.ready_path, timeout=HTTP_TIMEOUT)
            self.probes.append((t, st, ms))
            if st is not None and st > 0 and self.in_fault(t):
                self.max_api = max(self.max_api, ms)
            st2, _b, ms2, _h = h.call("GET", f"/docs/{self.s.key_names[0]}", timeout=HTTP_TIMEOUT)
            if st2 is not None and st2 > 0 and self.in_fault(t):
                self.max_api = max(self.max_api, ms2)
            self.stop_probe.wait(0.05)
        h.close()

    # -- writes
    def _new(self, kind: str, deleted: bool, size: int, expiry: int, now: float) -> Write:
        self.s.next_wid += 1
        return Write(self.s.next_wid, kind, deleted, size, expiry, now)

    def _record(self, key: str, w: Write) -> None:
        self.s.keys.setdefault(key, KeyHistory(key)).writes.append(w)

    def _settle(self, w: Write, st: int | None, body: bytes, ms: float, t: float) -> None:
        durable = w.kind != PLAIN
        self.statuses[st] += 1
        if st is not None and 200 <= st < 300:
            w.outcome = ACKED
            w.acked_at = time.monotonic()
            self.t.acked += 1
            if durable:
                self.t.acked_durable += 1
            with contextlib.suppress(ValueError, KeyError, TypeError):
                j = json.loads(body)
                w.vbucket, w.vbuuid, w.seqno = int(j["vbucket"]), int(j["vbuuid"]), int(j["seqno"])
        elif st == REFUSED_CONNECTION:
            w.outcome = REFUSED
            time.sleep(0.01)
            return
        elif st is None or st == 504:
            w.outcome = AMBIGUOUS
            self.t.ambiguous += 1
        else:
            w.outcome = REFUSED
        if st is not None:
            if durable:
                self.t.max_durable_ms = max(self.t.max_durable_ms, ms)
            elif self.in_fault(t):
                self.max_api = max(self.max_api, ms)

    def write_one(self, h: Http) -> None:
        rng, s, a = self.rng, self.s, self.camp.args
        r = rng.random()
        now = time.monotonic()
        if r < 0.07:  # _bulk of small plain upserts
            batch = []
            ws = []
            for key in rng.sample(s.key_names, rng.randint(2, 6)):
                exp = rng.choice((2, 3)) if rng.random() < 0.1 else 0
                w = self._new(PLAIN, False, rng.randint(20, 200), exp, now)
                entry: dict[str, Any] = {"key": key, "value": json.loads(w.value() or b"null")}
                if exp:
                    entry["expiry"] = exp
                batch.append(entry)
                ws.append((key, w))
            for key, w in ws:
                self._record(key, w)
            st, body, ms, _h = h.call("POST", "/docs/_bulk", json.dumps(batch, separators=(",", ":")).encode())
            for (_key, w), (ist, ibody) in zip(ws, _bulk_entries(st, body, len(ws)), strict=True):
                if st == 200 and ist is not None and not 200 <= ist < 300:
                    self.t.bulk_entries_refused += 1
                self._settle(w, ist, ibody, ms, now)
            return
        key = rng.choice(s.key_names)
        kind = PLAIN
        if rng.random() < a.durable_prob:
            kind = MAJORITY if rng.random() < 0.6 else PERSIST
        q = f"?durability={kind}&timeout_ms=1500" if kind != PLAIN else ""
        if r < 0.22:
            w = self._new(kind, True, 0, 0, now)
            self._record(key, w)
            st, body, ms, _h = h.call("DELETE", f"/docs/{key}{q}")
            if st == 404:  # nothing to delete: no write happened
                w.outcome = REFUSED
                self.statuses[st] += 1
                return
            self._settle(w, st, body, ms, now)
            return
        size = rng.randint(20, 400)
        large = rng.random() < a.large_prob
        if large:
            size = HUGE_BYTES if rng.random() < a.huge_prob else rng.randint(*self.camp.large_range)
        exp = rng.choice((2, 3)) if rng.random() < 0.08 else 0
        if exp:
            q += ("&" if q else "?") + f"expiry={exp}"
        w = self._new(kind, False, size, exp, now)
        self._record(key, w)
        st, body, ms, _h = h.call("PUT", f"/docs/{key}{q}", w.value(), timeout=60 if large else HTTP_TIMEOUT)
        self._settle(w, st, body, ms, now)
        if large and w.outcome == ACKED:
            self.t.large_acked += 1

    # -- run
    def run(self) -> dict[str, Any]:
        s = self.s
        if s.out_nodes:
            self.heal(3.0)  # a node a fault took out (its rebalance back in was refused then)
        t0 = self.t0 = time.monotonic()
        ft = threading.Thread(target=self._fault_thread, args=(t0,), daemon=True)
        pt = threading.Thread(target=self._probe_thread, daemon=True)
        ft.start()
        pt.start()
        h = Http(s.port)
        last_consume = t0
        while time.monotonic() - t0 < self.duration and not s.broken:
            if not s.gw.alive():
                time.sleep(0.02)
                continue
            self.write_one(h)
            if time.monotonic() - last_consume > 0.1:
                s.consume(0)
                last_consume = time.monotonic()
        h.close()
        ft.join()
        if self.restarter is not None:
            self.restarter.join()
        for kind in list(self.active):
            self.end_fault(kind)
        if self.broker_lost and not s.broken:
            # The broker lost every topic. The running gateway must find out by itself and republish every
            # vbucket from seqno 0 behind a rollback record to 0 (docs/reliability.md "Fault campaign", topic
            # truncated). The campaign's own replay reads the new topic from its start. The Replicator is
            # started over on a new database: the client library does not notice that the topic's offsets
            # started again (docs/reliability.md "Fault campaign", found and not fixed).
            if s.rep is not None:
                s.rep.kill()
            s.start_replicator()
            s.open_consumer()
        self.stop_probe.set()
        pt.join()
        result = self.check() if not s.broken else {"broken": True}
        self.t.max_api_ms = max(self.t.max_api_ms, self.max_api)
        return result

    # -- checks
    def engine_state(self, h: Http) -> dict[str, bytes | None] | None:
        out: dict[str, bytes | None] = {}
        for key in self.s.key_names:
            st, body, _ms, _h = h.call("GET", f"/docs/{key}")
            if st == 200:
                out[key] = body
            elif st == 404:
                out[key] = None
            else:
                return None
        return out

    def replicate_state(self) -> dict[str, bytes] | None:
        try:
            c = sqlite3.connect(f"file:{self.s.rep_db}?mode=ro", uri=True, timeout=0.5)
            try:
                return {k: bytes(v) for k, v in c.execute("SELECT key, value FROM docs")}
            finally:
                c.close()
        except sqlite3.Error:
            return None

    def check(self) -> dict[str, Any]:
        s, a = self.s, self.camp.args
        h = Http(s.port)
        res: dict[str, Any] = {}
        # readiness after recovery
        deadline = time.monotonic() + a.recovery_s
        ready = False
        while time.monotonic() < deadline:
            st, _b, _ms, _h = h.call("GET", s.ready_path, timeout=2)
            if st == 200:
                ready = True
                break
            s.consume(0.05)
        if not ready:
            self.t.not_ready_after_recovery += 1
            self.camp.defect(f"history {self.n}: {s.ready_path} not 200 {a.recovery_s:.0f}s after the faults ended")
        # readiness during long broker pauses (docs/reliability.md "Fault campaign"): once records wait longer
        # than health_delivery_stall_s (+ slack), not one 200
        slack = a.ready_slack_s
        acks = sorted(w.acked_at for kh in s.keys.values() for w in kh.writes if w.outcome == ACKED)
        for start, end, kind in self.windows:
            lo, hi = start + a.ready_threshold_s + slack, end - 0.2
            if kind != "broker_pause" or hi <= lo:
                continue
            if not any(start - 1.0 <= t <= hi - a.ready_threshold_s - slack for t in acks):
                continue  # nothing was pending long enough to be stalled
            ok = [t for t, st, _ms in self.probes if lo <= t <= hi and st == 200]
            if ok:
                self.t.health_untruthful += 1
                self.camp.defect(f"history {self.n}: {s.ready_path} answered 200 {ok[0] - start:.1f}s into a "
                                 f"{end - start:.1f}s broker pause (health_delivery_stall_s {a.ready_threshold_s:g})")
        # the engine, the replay, the Replicator: equal (eventually)
        engine: dict[str, bytes | None] | None = None
        diff: set[str] = set()
        deadline = time.monotonic() + a.converge_s
        while True:
            engine = self.engine_state(h)
            s.consume(0.1)
            rep = self.replicate_state()
            if engine is not None and rep is not None:
                topic = s.replay.state()
                diff = set()
                for key in s.key_names:
                    e = engine[key]
                    if topic.get(key.encode()) != e or rep.get(key) != e:
                        diff.add(key)
                if not diff:
                    break
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
        now = time.monotonic()
        if engine is None:
            self.t.divergent += len(s.key_names)
            self.camp.defect(f"history {self.n}: the engine could not be read back: "
                             + " | ".join(list(s.gw.tail)[-3:]))
            return {"unreadable": True}
        if diff and self.broker_lost:
            self.t.broker_loss_unrecovered += 1
            self.camp.defect(f"history {self.n}: after the broker lost its log, {len(diff)} documents never reached "
                             f"the rebuilt topic / Replicator; dcpgw up stderr: " + " | ".join(list(s.gw.tail)[-3:])
                             + "; dcpgw replicate stderr: " + " | ".join(list(s.rep.tail)[-6:] if s.rep else []))
        if diff:
            self.t.divergent += len(diff)
            k = sorted(diff)[0]
            e = engine[k]
            rep = self.replicate_state() or {}
            tv = s.replay.state().get(k.encode())
            self.camp.defect(
                f"history {self.n}: {len(diff)} documents differ after {a.converge_s:.0f}s, e.g. {k}: engine "
                f"{_short(e)}, topic {_short(tv)}, replicate {_short(rep.get(k))}; /stats "
                f"{h.call('GET', '/stats', timeout=2)[1][:400]!r}; dcpgw up stderr: "
                + " | ".join(list(s.gw.tail)[-6:]))
        res["divergent"] = len(diff)
        # acknowledged writes vs what the engine holds
        published = {(r.vbucket, r.vbuuid, r.seqno) for recs in s.records.values() for _o, r in recs if r.is_data}
        for key, kh in s.keys.items():
            ex = kh.explain(engine.get(key), now)
            if ex.unknown:
                self.t.divergent += 1
                self.camp.defect(f"history {self.n}: {key} holds {_short(engine.get(key))}, which no write sent")
                continue
            for w in ex.lost:
                self.judge_lost(key, w, published)
            # what was lost is gone for good: later histories explain from the survivor
            if ex.lost:
                kh.writes = [x for x in kh.writes if x not in ex.lost]
        # invariants and duplicates, per partition
        from gateway.exceptions import InvariantViolation
        from gateway.invariants import check_partition, data_positions

        for part, recs in s.records.items():
            recs = _since_rollback_to_zero(recs)
            try:
                check_partition(recs)
            except InvariantViolation as e:
                self.t.invariant_violations += 1
                self.camp.defect(f"history {self.n}: partition {part}: {e}")
            dup = sum(c - 1 for c in data_positions(recs).values() if c > 1)
            if dup:
                self.t.duplicates += dup
                self.camp.defect(f"history {self.n}: partition {part}: {dup} duplicate (vbuuid, seqno) records")
        st, raw, _ms, _h = h.call("GET", "/metrics", timeout=5)
        if st == 200:
            for line in raw.decode("utf-8", "replace").splitlines():
                if line.startswith("dcpgw_topic_truncations_total "):
                    v = int(float(line.split()[1]))
                    self.t.topic_truncations += v - s.truncations_seen if v >= s.truncations_seen else v
                    s.truncations_seen = v
        self.t.rollback_records += s.replay.rollbacks - s.rollbacks_seen
        s.rollbacks_seen = s.replay.rollbacks
        h.close()
        return res

    def judge_lost(self, key: str, w: Write, published: set[tuple[int, int, int]]) -> None:
        a = self.camp.args
        window = a.plain_window_ms / 1000
        in_window = any(w.acked_at <= k <= w.acked_at + window for k in self.s.kills)
        # a hard failover loses what the failed node had not replicated yet: plain writes (docs/durability.md)
        failed_over = any(w.acked_at <= k <= w.acked_at + window for k in self.s.failovers)
        what = f"{key} write {w.wid} ({w.kind}{', delete' if w.deleted else ''}, acked {w.acked_at:.3f})"
        if w.vbucket is not None and (w.vbucket, w.vbuuid, w.seqno) in published:
            self.t.lost_published += 1
            self.camp.defect(f"history {self.n}: {what} was published to Kafka and then lost by the engine")
        if w.kind == PERSIST or (w.kind == MAJORITY and not in_window):
            self.t.lost_durable += 1
            self.camp.defect(f"history {self.n}: acknowledged durable {what} lost"
                             + ("" if self.s.kills else " without any kill"))
        elif w.kind == MAJORITY or in_window or failed_over:
            self.t.lost_plain_in_window += 1
        else:
            self.t.lost_plain_outside_window += 1
            self.camp.defect(f"history {self.n}: acknowledged plain {what} lost outside the {a.plain_window_ms} ms "
                             f"window (kills at {[round(k, 3) for k in self.s.kills]}, failovers at "
                             f"{[round(k, 3) for k in self.s.failovers]})" + self.trace(w))


    def trace(self, w: Write) -> str:
        """What --trace-lost adds to a lost write's defect: its position, the history's timeline, the map."""
        if not self.camp.args.trace_lost:
            return ""
        ev = "; ".join(f"{t - self.t0:+.3f} {e}" for t, e in self.events)
        win = "; ".join(f"{k} {a - self.t0:+.3f}..{b - self.t0:+.3f}" for a, b, k in self.windows)
        st, m = self.admin("GET", "/cluster")
        return (f"; trace: vb/vbuuid/seqno {w.vbucket}/{w.vbuuid}/{w.seqno}, sent {w.sent - self.t0:+.3f} acked "
                f"{w.acked_at - self.t0:+.3f} (history start {self.t0:.3f}); admin: {ev}; windows: {win}; "
                f"GET /cluster {st}: {json.dumps(m)}")


def _bulk_entries(st: int | None, body: bytes, n: int) -> list[tuple[int | None, bytes]]:
    """The outcome of each of the ``n`` entries of a ``POST /docs/_bulk`` answered ``st`` / ``body``: (status,
    the entry's JSON). A 200 answers every entry with its own status (docs/gateway.md "POST /docs/_bulk"): an
    entry the engine refused (``sync_write_in_progress``, ``not_my_vbucket``, ``temporary_failure`` ...) was
    not written although the batch got a 200. A 200 whose entries cannot be read: each entry ambiguous (None).
    Any other status applies to the whole batch."""
    if st is None or not 200 <= st < 300:
        return [(st, b"")] * n
    try:
        items = json.loads(body)["items"]
        out: list[tuple[int | None, bytes]] = [(int(it["status"]), json.dumps(it).encode()) for it in items]
    except (ValueError, KeyError, TypeError):
        return [(None, b"")] * n
    return out if len(out) == n else [(None, b"")] * n


def _since_rollback_to_zero(recs: list[Any]) -> list[Any]:
    """A partition's (offset, record) pairs without, per vbucket, what came before its last rollback record to
    0: such a record tells consumers to drop everything of the vbucket (the gateway republishes from seqno 0
    after the topic lost its log, and what the broker kept of the lost log's tail precedes it)."""
    cut: dict[int, int] = {}
    for i, (_o, r) in enumerate(recs):
        if r.type is RecordType.ROLLBACK and r.snap_end == 0:
            cut[r.vbucket] = i
    if not cut:
        return recs
    return [x for i, x in enumerate(recs) if i >= cut.get(x[1].vbucket, -1)]


def _short(v: bytes | None) -> str:
    if v is None:
        return "absent"
    return f"{v[:24]!r}... ({len(v)} bytes)" if len(v) > 24 else repr(v)


# ---------------------------------------------------------------------- campaign
class Campaign:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.seed = args.seed
        self.root = str(Path(__file__).resolve().parent.parent)
        self.work = Path(args.work_dir or tempfile.mkdtemp(prefix="dcpgw-chaos-"))
        self.work.mkdir(parents=True, exist_ok=True)
        self.totals = Totals()
        self.ready_real = False
        self.broker = EmbeddedTansuBroker(log_dir=self.work / "broker")
        self.broker_thread = ThreadPoolExecutor(1, thread_name_prefix="chaos-broker")
        self.bootstrap = ""
        # values above 1 MB once oversize records are handled (issue 16 item 1); below it until then
        oversize = supports_setting("oversize_policy")
        lo, hi = args.large_bytes or ((1_100_000, 1_600_000) if oversize else (900_000, 990_000))
        self.large_range = (int(lo), int(hi))

    def defect(self, msg: str) -> None:
        log(f"DEFECT (seed {self.seed}) {msg}")
        self.totals.defects.append(msg)

    def restart_broker(self) -> None:
        # on the broker's own long-lived thread: the embedded broker dies with the thread that started it
        self.broker_thread.submit(self._restart_broker).result()

    def _restart_broker(self) -> None:
        port = self.broker.port
        self.broker.stop()
        self.broker = EmbeddedTansuBroker(port=port, log_dir=self.work / f"broker{time.monotonic_ns()}")
        for _ in range(50):
            try:
                self.broker.start()
                return
            except Exception:
                time.sleep(0.1)
        self.broker.start()

    def run(self) -> int:
        a = self.args
        t_start = time.monotonic()
        self.broker_thread.submit(self.broker.start).result()
        self.bootstrap = self.broker.bootstrap_servers
        log(f"broker {self.bootstrap}; work dir {self.work}; large values {self.large_range}")
        h = 0
        session_no = 0
        try:
            while h < a.histories:
                srng = random.Random(f"{self.seed}/session/{session_no}")
                cluster = {"single": False, "cluster": True}.get(a.mode, srng.random() < 0.5)
                s = Session(self, session_no, cluster)
                session_no += 1
                self.totals.sessions += 1
                if not s.open():
                    s.close()
                    h += 1
                    self.totals.histories += 1
                    continue
                if h == 0:
                    log(f"readiness from {s.ready_path}")
                try:
                    for _ in range(a.per_session):
                        if h >= a.histories or s.broken:
                            break
                        t0 = time.monotonic()
                        hist = History(s, h, random.Random(f"{self.seed}/{h}"))
                        before = (self.totals.lost_durable, self.totals.divergent, self.totals.duplicates)
                        hist.run()
                        # a fresh session after the broker lost its log: the histories after it in the same
                        # session took ~20 s each to converge (cost, not correctness)
                        retire = hist.broker_lost
                        h += 1
                        self.totals.histories += 1
                        after = (self.totals.lost_durable, self.totals.divergent, self.totals.duplicates)
                        log(f"history {hist.n} [{'cluster' if cluster else 'single'} s{s.index}] "
                            f"faults={','.join(k for _t, k, _d in hist.faults) or '-'} acked={self.totals.acked} "
                            f"lost_durable/divergent/duplicates +{after[0] - before[0]}/+{after[1] - before[1]}/"
                            f"+{after[2] - before[2]} {time.monotonic() - t0:.1f}s statuses {dict(hist.statuses)}")
                        if retire:
                            break
                finally:
                    s.close()
        finally:
            with contextlib.suppress(Exception):
                self.broker_thread.submit(self.broker.stop).result()
            self.broker_thread.shutdown()
            if not a.keep and a.work_dir is None:
                shutil.rmtree(self.work, ignore_errors=True)
        self.totals.seconds = time.monotonic() - t_start
        print(json.dumps(self.totals.to_json(seed=self.seed, ready_endpoint="/health/ready" if self.ready_real
                                             else "/health", large_bytes=list(self.large_range))), flush=True)
        return 1 if self.totals.failed(self.ready_real) else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.split("\n\n")[0])
    p.add_argument("--histories", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--per-session", type=int, default=25, help="histories per set of processes")
    p.add_argument("--mode", choices=("mixed", "single", "cluster"), default="mixed")
    p.add_argument("--faults", default=",".join(FAULT_KINDS), help="fault kinds to draw from (comma-separated)")
    p.add_argument("--vbuckets", type=int, default=8)
    p.add_argument("--keys", type=int, default=48, help="keys per session")
    p.add_argument("--write-seconds", type=float, nargs=2, default=(0.5, 1.2))
    p.add_argument("--durable-prob", type=float, default=0.2)
    p.add_argument("--large-prob", type=float, default=0.01)
    p.add_argument("--large-bytes", type=int, nargs=2, default=None, help="size range of large values")
    p.add_argument("--huge-prob", type=float, default=0.05,
                   help="of the large values, the share that are 20 MiB (the API's limit)")
    p.add_argument("--plain-window-ms", type=float, default=1000.0,
                   help="an acknowledged plain write may be lost only when a kill -9 follows within this")
    p.add_argument("--ready-threshold-s", type=float, default=2.0,
                   help="the gateways' health_delivery_stall_s (readiness turns 503 after it during a pause)")
    p.add_argument("--ready-slack-s", type=float, default=1.5)
    p.add_argument("--long-pause-prob", type=float, default=0.03)
    p.add_argument("--recovery-s", type=float, default=30.0)
    p.add_argument("--converge-s", type=float, default=20.0)
    p.add_argument("--work-dir", default=None)
    p.add_argument("--keep", action="store_true", help="keep the data directories")
    p.add_argument("--trace-lost", action="store_true",
                   help="a lost plain write's defect tells its position, the history's admin calls and the map")
    ns = p.parse_args(argv)
    ns.faults = {f.strip() for f in ns.faults.split(",") if f.strip()}
    bad = ns.faults - set(FAULT_KINDS)
    if bad:
        p.error(f"unknown fault kinds {sorted(bad)} (known: {', '.join(FAULT_KINDS)})")
    return ns


def main(argv: list[str] | None = None) -> int:
    return Campaign(parse_args(argv)).run()


if __name__ == "__main__":
    sys.exit(main())
