"""One timed scale-out run for ``python -m bench.gateway --gateways K`` (docs/scale-out.md): K ``dcpgw gateway``
processes, one Kafka group, sharing the vbuckets of one engine node process (``python -m engine.network.server``).

The run: start the node with its persistence stopped, write N documents into it (not timed), start the K members
and wait until the group's assignment covers every vbucket (rollback mitigation on, the default: they stream but
publish nothing while nothing is persisted), then start persistence and time until the checkpoint topic says
every vbucket is acknowledged up to the node's high seqno. CPU seconds and peak RSS per process come from /proc.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from bench.processes import cpu_seconds, peak_rss_mib, tree_cpu_seconds
from engine.network.process_cluster import ProcessCluster
from gateway.resume import CheckpointFollower

NVB = 1024
VALUE = b'{"name": "' + b"x" * 244 + b'"}'
_ASSIGNED = re.compile(r"group \S+: assigned \d+ coordination partitions, (\d+) vbuckets")
_RECOVERED = re.compile(r"vbuckets resume from their partitions' tails in this process")
def _exited(members: list[tuple[subprocess.Popen[bytes], Path]], when: str) -> None:
    """Raise (one line naming the member, its status and its last error line) when a member has exited: the
    run cannot complete without it (its vbuckets wait a session timeout, or forever once none is left)."""
    for j, (p, log) in enumerate(members):
        if p.poll() is not None:
            lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
            last = next((ln for ln in reversed(lines) if "error" in ln.lower()), lines[-1] if lines else "")
            raise MemberExited(f"gateway member {j} (pid {p.pid}) exited with status {p.returncode} {when}: "
                               f"{last.strip()[:500]} (log {log})")


class MemberExited(RuntimeError):
    """A gateway member of a scale-out run exited before the run completed."""


def _last_line(log: Path) -> str:
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()] if log.exists() else []
    return lines[-1].strip()[:300] if lines else ""


def _recoveries(log: Path) -> int:
    """In-process delivery recoveries a member logged (docs/scale-out.md "Delivery within the lease")."""
    return len(_RECOVERED.findall(log.read_text(errors="replace"))) if log.exists() else 0


def _last_assignment(log: Path) -> int | None:
    found = _ASSIGNED.findall(log.read_text()) if log.exists() else []
    return int(found[-1]) if found else None


def scaleout_run(conf: dict[str, Any], client: dict[str, Any], n: int, tmp: Path, k: int,
                 timeout: float = 900.0) -> dict[str, Any]:
    base = tmp / f"so-{uuid.uuid4().hex[:6]}"
    cluster = ProcessCluster.start(base / "engine", nodes=1, replicas=0, num_vbuckets=NVB,
                                   checkpoint_quota_bytes=2 << 30)
    members: list[tuple[subprocess.Popen[bytes], Path]] = []
    follower: CheckpointFollower | None = None
    try:
        node = cluster.node("n0")
        cluster.stop_persistence("n0")
        for i in range(n):
            cluster.write(f"user::{i:010d}", VALUE)
        prefix = f"bso{uuid.uuid4().hex[:8]}"
        topic = f"{prefix}.default"
        env = {k_: v for k_, v in os.environ.items() if not k_.startswith("DCPGW_")}
        env.update({"KAFKA_BOOTSTRAP_SERVERS": conf["bootstrap.servers"], "DCPGW_TOPIC_PREFIX": prefix,
                    "DCPGW_BUCKET": "default", "DCPGW_CHECKPOINT_INTERVAL_S": "0.1",
                    "DCPGW_GROUP_SESSION_TIMEOUT_MS": "10000"})
        for j in range(k):
            log = base / f"member{j}.log"
            f = log.open("wb")
            members.append((subprocess.Popen([sys.executable, "-m", "gateway.cli", "gateway", "--source",
                                              f"{node.host}:{node.port}", "--group", f"{prefix}-g"], env=env,
                                             stdout=f, stderr=subprocess.STDOUT), log))
        deadline = time.monotonic() + timeout
        stable_since = None
        while True:  # the group settled: the last assignments cover every vbucket, unchanged for 2 s
            if time.monotonic() > deadline:
                raise TimeoutError("the gateway group never settled")
            last = [_last_assignment(log) for _p, log in members]
            if all(x is not None for x in last) and sum(x or 0 for x in last) == NVB:
                stable_since = stable_since or time.monotonic()
                if time.monotonic() - stable_since > 2.0:
                    break
            else:
                stable_since = None
            _exited(members, "while the group settled")
            time.sleep(0.1)
        highs = {vb: cluster.client("n0").vbucket_info(vb).high_seqno for vb in range(NVB)}
        # the members' progress: one consumer reading the checkpoint topic on, in a thread that waits in
        # librdkafka (reading the whole topic again every 50 ms took ~0.7 CPU s of a 3 s run on 2 cores)
        follower = CheckpointFollower(client, topic, poll_s=0.05, from_beginning=True)
        follower.start()
        cpu0 = {p.pid: cpu_seconds(p.pid) for p, _l in members}
        node_cpu0 = tree_cpu_seconds(node.pid or 0)
        t = time.perf_counter()
        cluster.start_persistence("n0")
        while True:
            cps = follower.positions
            if all(cps.get(vb) is not None and cps[vb].seqno >= h for vb, h in highs.items() if h):
                break
            if time.monotonic() > deadline:
                behind = [vb for vb, h in highs.items() if h and (cps.get(vb) is None or cps[vb].seqno < h)]
                raise TimeoutError(
                    f"the gateway group never caught up: {len(behind)} vbuckets' checkpoints behind the node's high "
                    f"seqnos (e.g. {behind[:5]}); delivery recoveries "
                    f"{[_recoveries(log) for _p, log in members]}; last member log lines: "
                    + " | ".join(_last_line(log) for _p, log in members))
            _exited(members, "during the timed part")
            time.sleep(0.05)
        el = time.perf_counter() - t
        rss = {f"gateway{j}": peak_rss_mib(p.pid) for j, (p, _l) in enumerate(members)}
        rss["engine"] = peak_rss_mib(node.pid or 0)
        cpu = sum(cpu_seconds(p.pid) - cpu0[p.pid] for p, _l in members)
        return {"rate": n / el, "wall_s": el, "cpu_s": cpu, "engine_cpu_s": tree_cpu_seconds(node.pid or 0) - node_cpu0,
                "rss_mib": max(v for name, v in rss.items() if name != "engine"), "rss_mib_per_process": rss,
                "gateways": k, "delivery_recoveries": sum(_recoveries(log) for _p, log in members)}
    finally:
        if follower is not None:
            follower.close()
        for p, _l in members:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p, _l in members:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        cluster.close(clean=False)
