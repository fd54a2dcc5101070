"""The fault campaign (bench/chaos.py) in CI: a short run over both modes and every fault kind; nothing
acknowledged-durable lost, no divergent document, no duplicate (vbuuid, seqno) -- docs/reliability.md
"Fault campaign"."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.chaos import KEYS, parse_args

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def test_short_campaign_loses_nothing_durable_and_converges(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.chaos", "--histories", "4", "--seed", "5", "--per-session", "2",
         "--work-dir", str(tmp_path), "--large-prob", "0.03",
         "--faults", "kill,broker_pause,disk_full,slow_consumer,consumer_kill,failover,rebalance"],
        cwd=ROOT, capture_output=True, text=True, timeout=240)
    lines = proc.stdout.strip().splitlines()
    assert lines, proc.stderr[-3000:]
    out = json.loads(lines[-1])
    assert list(out)[:len(KEYS)] == list(KEYS)
    assert out["histories"] == 4
    assert sum(out["faults"].values()) >= 4
    assert out["acked"] > 0 and out["acked_durable"] > 0
    assert (out["lost_durable"], out["divergent"], out["duplicates"]) == (0, 0, 0), proc.stderr[-3000:]
    assert out["invariant_violations"] == 0 and out["lost_plain_outside_window"] == 0, out["defects"]
    assert out["health_untruthful"] == 0 and out["not_ready_after_recovery"] == 0, out["defects"]
    assert out["stop_hangs"] == 0 and out["ready_endpoint"] == "/health/ready"
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_the_seed_fixes_the_plan() -> None:
    """Same seed, same fault plan and writes (timing aside): histories are reproducible by seed."""
    import random

    from bench.chaos import History

    class _S:  # the plan needs only the campaign's arguments
        camp = type("C", (), {"args": parse_args([]), "totals": None})()

    plans = [History.__new__(History) for _ in range(2)]
    for h in plans:
        h.s, h.camp, h.rng = _S(), _S.camp, random.Random("5/3")  # type: ignore[assignment]
        h.duration = h.rng.uniform(*h.camp.args.write_seconds)
        h.faults = []
        h.plan()
    assert plans[0].faults == plans[1].faults and plans[0].duration == plans[1].duration
