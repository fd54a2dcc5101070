"""Stalled broker benchmark: ``python -m bench.stall [--pause S] [--docs N]``.

A ``dcpgw up`` process (1024 vbuckets, default settings) on a private embedded Tansu broker; a writer keeps
posting ``_bulk`` batches of 200 documents (honouring 503 + Retry-After) while a prober sends ``GET /health``
and ``GET /docs/{key}`` one after the other. The broker is then frozen with SIGSTOP for ``--pause`` seconds
(30 by default) and thawed.

Figures (docs/reliability.md "Stalled broker and health"):
* ``stall.api_p99``   p99 latency (ms) of the probes while the broker is paused; baseline: the same probes,
                      same writer, broker running (the seconds before the pause). Target 100 ms.
* ``stall.api_max``   the slowest probe while paused (informational, `"target": null`; under 2000 ms reads as "did not hang").
Info lines: writes accepted / refused with 503 during the pause, the peak ``unacked_write_bytes``, and the
seconds to catch up after the resume.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from bench.report import figure
from gateway.broker import EmbeddedTansuBroker

#: the gateway creates the user Administrator with this password; every request sends it (docs/security.md)
ADMIN_PASSWORD = secrets.token_urlsafe(18)
AUTH = {"Authorization": "Basic " + base64.b64encode(f"Administrator:{ADMIN_PASSWORD}".encode()).decode()}


def _get(url: str, timeout: float = 30.0) -> tuple[int, bytes, dict[str, str]]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=AUTH), timeout=timeout) as r:
            return r.status, r.read(), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read(), dict(e.headers)


def _post(url: str, body: bytes, timeout: float = 30.0) -> tuple[int, dict[str, str]]:
    req = urllib.request.Request(url, data=body, method="POST", headers=AUTH)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            r.read()
            return r.status, dict(r.headers)
    except urllib.error.HTTPError as e:
        e.read()
        return e.code, dict(e.headers)


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


class Load:
    """Writer and prober threads; ``phase`` labels every sample."""

    def __init__(self, url: str, docs: int) -> None:
        self.url = url
        self.docs = docs
        self.phase = "before"
        self.stop = threading.Event()
        self.lat: dict[str, list[float]] = {}
        self.writes: dict[str, list[int]] = {}
        self.peak_unacked = 0

    def writer(self) -> None:
        i = 0
        while not self.stop.is_set():
            batch = [{"key": f"doc{(i + j) % self.docs}", "value": {"n": i + j, "pad": "x" * 200}}
                     for j in range(200)]
            status, headers = _post(self.url + "/docs/_bulk", json.dumps(batch).encode())
            self.writes.setdefault(self.phase, []).append(status)
            if status == 503:
                self.stop.wait(float(headers.get("Retry-After", "1")))
            else:
                i += 200
                self.stop.wait(0.01)

    def prober(self) -> None:
        k = 0
        while not self.stop.is_set():
            for path in ("/health", f"/docs/doc{k % self.docs}"):
                t = time.perf_counter()
                _get(self.url + path)
                self.lat.setdefault(self.phase, []).append((time.perf_counter() - t) * 1000)
            k += 7
            if k % 70 == 0:
                st = json.loads(_get(self.url + "/stats")[1])
                self.peak_unacked = max(self.peak_unacked, int(st.get("unacked_write_bytes", 0)))
            time.sleep(0.005)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pause", type=float, default=30.0)
    ap.add_argument("--docs", type=int, default=20_000)
    args = ap.parse_args()
    broker = EmbeddedTansuBroker().start()
    tmp = Path(tempfile.mkdtemp(prefix="bench-stall-"))
    data = tmp / "data"
    env = {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": broker.bootstrap_servers, "DCPGW_DATA_DIR": str(data),
           "DCPGW_BUCKET": "stall", "DCPGW_HTTP_PORT": "0", "DCPGW_KV_PORT": "0",
           "DCPGW_ADMIN_PASSWORD": ADMIN_PASSWORD}
    with open(tmp / "gw.log", "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "up", "--no-progress"], env=env,
                                stdout=subprocess.DEVNULL, stderr=log)
    try:
        state = data / "dcpgw-state.json"
        deadline = time.monotonic() + 120
        url = ""
        while time.monotonic() < deadline and not url:
            if proc.poll() is not None:
                raise SystemExit(f"dcpgw up exited: {(tmp / 'gw.log').read_text()[-2000:]}")
            if state.exists():
                with contextlib.suppress(ValueError, KeyError):
                    url = json.loads(state.read_text())["http_url"]
            time.sleep(0.1)
        while _get(url + "/health")[0] != 200:
            time.sleep(0.1)
        load = Load(url, args.docs)
        threads = [threading.Thread(target=load.writer, daemon=True),
                   threading.Thread(target=load.prober, daemon=True)]
        for t in threads:
            t.start()
        time.sleep(10)
        load.phase = "paused"
        broker.pause()
        time.sleep(args.pause)
        broker.resume()
        load.phase = "after"
        t0 = time.monotonic()
        load.stop.set()
        for t in threads:
            t.join(60)
        while json.loads(_get(url + "/stats")[1])["lag"] != 0:
            time.sleep(0.1)
        catch_up = time.monotonic() - t0
        base = percentile(load.lat.get("before", []), 0.99)
        paused = load.lat.get("paused", [])
        figure("stall.api_p99", percentile(paused, 0.99), "ms", base, 100, "lower")
        figure("stall.api_max", max(paused, default=0.0), "ms", max(load.lat.get("before", [0.0])), None, "lower")
        w = load.writes.get("paused", [])
        info: dict[str, Any] = {"info": "stall.writes", "pause_s": args.pause, "probes_paused": len(paused),
                                "batches_accepted": w.count(200), "batches_refused_503": w.count(503),
                                "peak_unacked_write_bytes": load.peak_unacked,
                                "catch_up_s": round(catch_up, 1)}
        print(json.dumps(info), flush=True)
    finally:
        if broker.paused:
            broker.resume()
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        broker.stop()


if __name__ == "__main__":
    main()
