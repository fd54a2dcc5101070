"""Engine benchmarks: ``python -m bench.engine [--docs N]``.

Figures (each a ratio against a baseline measured in the same run, on the same machine):

* ``engine.ingest``           sets/s through Bucket.set vs a plain dict + seqno loop (target >= 0.15x)
* ``engine.flush``            flusher rows/s vs raw sqlite3 executemany of the same rows (target >= 0.7x)
* ``engine.backfill``         disk backfill items/s through a DCP stream vs a raw sqlite3 scan (target >= 0.5x)
* ``engine.stream_memory``    in-memory DCP stream items/s vs ingest items/s (target >= 2x)
* ``engine.peak_rss``         peak RSS in MiB vs the raw bytes ingested (informational)
* ``engine.checkpoint_quota`` peak checkpoint memory while one consumer is stalled vs the quota (<= 1.0)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sqlite3
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

from bench.report import figure
from engine import Bucket, BucketConfig, Item

VALUE_SIZE = 256


def keys_values(n: int) -> tuple[list[bytes], bytes]:
    keys = [f"user::{i:010d}".encode() for i in range(n)]
    body = b'{"name": "' + b"x" * (VALUE_SIZE - 12) + b'"}'
    assert len(body) == VALUE_SIZE
    return keys, body


def bench_baseline_ingest(keys: list[bytes], value: bytes, nvb: int) -> float:
    """A plain dict + seqno loop doing the minimum a KV store must: map key -> vbucket, bump seqno, store."""
    tables: list[dict[bytes, tuple[bytes, int]]] = [{} for _ in range(nvb)]
    seqnos = [0] * nvb
    crc = zlib.crc32
    t = time.perf_counter()
    for k in keys:
        vb = ((crc(k) >> 16) & 0x7FFF) % nvb
        s = seqnos[vb] + 1
        seqnos[vb] = s
        tables[vb][k] = (value, s)
    return len(keys) / (time.perf_counter() - t)


def bench_raw_sqlite(rows: list[tuple], tmp: Path) -> tuple[float, float]:
    """Raw executemany of the same rows into the same table layout, then a raw scan of them."""
    db = sqlite3.connect(str(tmp / "raw.sqlite3"), isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    db.execute(
        "CREATE TABLE items (vb INTEGER NOT NULL, seqno INTEGER NOT NULL, key BLOB NOT NULL, value BLOB, "
        "flags INTEGER NOT NULL, expiry INTEGER NOT NULL, cas INTEGER NOT NULL, rev INTEGER NOT NULL, "
        "datatype INTEGER NOT NULL, op INTEGER NOT NULL, superseded INTEGER, PRIMARY KEY (vb, seqno)) WITHOUT ROWID"
    )
    t = time.perf_counter()
    batch = 250_000
    for i in range(0, len(rows), batch):
        db.execute("BEGIN")
        db.executemany(
            "INSERT INTO items (vb, seqno, key, value, flags, expiry, cas, rev, datatype, op) "
            "VALUES (?,?,?,?,?,?,?,?,?,?)",
            rows[i : i + batch],
        )
        db.execute("COMMIT")
    write_rate = len(rows) / (time.perf_counter() - t)
    t = time.perf_counter()
    n = 0
    for vb in range(1024):
        for _row in db.execute("SELECT * FROM items WHERE vb=? ORDER BY seqno", (vb,)):
            n += 1
    scan_rate = n / (time.perf_counter() - t)
    db.close()
    return write_rate, scan_rate


def drain_count(producer: Any) -> int:
    n = 0
    step = producer.step
    while True:
        msgs = step(8192)
        if not msgs:
            return n
        for m in msgs:
            if type(m) is Item:
                n += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=1_000_000, help="documents to ingest (default 1M)")
    args = ap.parse_args()
    n = args.docs
    if n < 1000:
        ap.error("--docs must be at least 1000")
    keys, value = keys_values(n)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    with tempfile.TemporaryDirectory(prefix="bench-engine-") as td:
        tmp = Path(td)
        base_ingest = bench_baseline_ingest(keys, value, 1024)

        cfg = BucketConfig(
            data_dir=tmp / "data",
            num_vbuckets=1024,
            checkpoint_quota_bytes=4 * 1024**3,
            flush_batch_items=250_000,
        )
        b = Bucket(cfg)
        # A DCP connection streaming every vbucket from memory, registered before the load.
        prod = b.dcp_producer("bench-memory")
        for vb in range(1024):
            prod.stream_request(vb, 0)
        bset = b.set
        t = time.perf_counter()
        for k in keys:
            bset(k, value)
        ingest = n / (time.perf_counter() - t)
        figure("engine.ingest", ingest, "items/s", base_ingest, 0.15, "higher")

        t = time.perf_counter()
        streamed = drain_count(prod)
        stream_rate = streamed / (time.perf_counter() - t)
        assert streamed == n, (streamed, n)
        figure("engine.stream_memory", stream_rate, "items/s", ingest, 2.0, "higher")

        t = time.perf_counter()
        flushed = b.flush_all()
        flush_rate = flushed / (time.perf_counter() - t)
        assert flushed == n

        rows = []
        for vbk in b.vbuckets():
            for it in vbk.ht.values():
                rows.append(
                    (
                        vbk.id,
                        it.seqno,
                        it.key,
                        it.value,
                        it.flags,
                        it.expiry,
                        it.cas,
                        it.rev_seqno,
                        it.datatype,
                        0,
                    )
                )
        raw_write, raw_scan = bench_raw_sqlite(rows, tmp)
        del rows
        figure("engine.flush", flush_rate, "rows/s", raw_write, 0.7, "higher")

        # Disk backfill: free memory checkpoints so new streams must read from disk.
        prod.close()
        for vbk in b.vbuckets():
            vbk.ckpt.create_checkpoint()
            vbk.ckpt.remove_unreferenced()
        p2 = b.dcp_producer("bench-backfill")
        for vb in range(1024):
            p2.stream_request(vb, 0)
        t = time.perf_counter()
        got = drain_count(p2)
        backfill_rate = got / (time.perf_counter() - t)
        assert got == n, (got, n)
        figure("engine.backfill", backfill_rate, "items/s", raw_scan, 0.5, "higher")
        p2.close()

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        raw_mib = n * (VALUE_SIZE + len(keys[0])) / 1024**2
        figure("engine.peak_rss", peak - rss_before, "MiB", raw_mib, None, "lower")
        b.close()

        # Checkpoint memory under quota while one consumer is stalled (never acknowledges, never steps).
        quota = 32 * 1024 * 1024
        b = Bucket(
            BucketConfig(
                data_dir=tmp / "quota",
                num_vbuckets=1024,
                checkpoint_quota_bytes=quota,
                checkpoint_max_items=500,
            )
        )
        stalled = b.dcp_producer("stalled", buffer_size=1024 * 1024)
        live = b.dcp_producer("live")
        for vb in range(1024):
            stalled.stream_request(vb, 0)
            live.stream_request(vb, 0)
        stalled.step()  # reads one buffer's worth, then never acknowledges
        peak_mem = 0
        m = min(n, 300_000)
        for i, k in enumerate(keys[:m]):
            b.set(k, value)
            if i % 5000 == 4999:
                b.flush()
                drain_count(live)
                b.recover_memory()
            used = b.counter.used
            if used > peak_mem:
                peak_mem = used
        b.flush_all()
        drain_count(live)
        figure("engine.checkpoint_quota", peak_mem, "bytes", quota, 1.0, "lower")
        print(
            json.dumps({"info": "checkpoint_quota", "cursors_dropped": b.cursors_dropped, "docs": m}),
            flush=True,
        )
        b.close()
    os.sync()


if __name__ == "__main__":
    main()
