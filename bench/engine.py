"""Engine benchmarks: ``python -m bench.engine [--docs N] [--rounds R]``.

Figures (each a ratio against a baseline measured in the same run, on the same machine):

* ``engine.ingest``           sets/s through Bucket.set vs a plain dict + seqno loop (target >= 0.15x), in
                              R paired rounds (the loop, then Bucket.set over the same documents; the first
                              round in this process, before the figures below, the others each in a fresh
                              process): the round with the median ratio (the lower median for an even R), with
                              its own baseline -- one ``{"info": "ingest_round"}`` line per round
* ``engine.flush``            flusher rows/s vs raw sqlite3 executemany of the same rows (target >= 0.7x)
* ``engine.backfill``         disk backfill items/s through a DCP stream vs a raw sqlite3 scan (target >= 0.5x)
* ``engine.stream_memory``    in-memory DCP stream items/s vs ingest items/s (target >= 2x)
* ``engine.resident_bytes``   the engine's resident bytes per item (RSS after the load, streamed and flushed,
                              minus RSS before the bucket was opened, over N) vs the raw key + value bytes per
                              item (target <= 2.0x, issue 17)
* ``engine.peak_rss``         peak RSS of the whole benchmark process in MiB (its own inputs and the raw SQLite
                              copy included) vs the raw bytes ingested (informational: target null)
* ``engine.checkpoint_quota`` peak checkpoint memory while one consumer is stalled vs the quota (<= 1.0)
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import os
import resource
import sqlite3
import tempfile
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.report import child_result, engine_build, figure, median_round
from engine import Bucket, BucketConfig, Item

VALUE_SIZE = 256


#: documents generated at a time: the benchmark's own inputs stay small next to what the engine holds
CHUNK = 20_000
_PAD = b"x" * (VALUE_SIZE - 22)  # 10 + 10 digits + pad + 2 = VALUE_SIZE


def key_of(i: int) -> bytes:
    """Document ``i``'s 16-byte key."""
    return b"user::%010d" % i


def value_of(i: int) -> bytes:
    """Document ``i``'s own 256-byte JSON value (a distinct object per document, as a value read off the
    network is, so the engine's resident bytes count every value)."""
    return b'{"name": "%010d' % i + _PAD + b'"}'


def chunks(n: int) -> Iterator[tuple[list[bytes], list[bytes]]]:
    """Documents 0..n-1, ``CHUNK`` at a time, generated lazily (the caller drops each chunk after use). Keys
    and values are built in two passes: no short-lived object is allocated between the ones the engine keeps,
    which would leave holes in the allocator's pools and count as the engine's memory."""
    for start in range(0, n, CHUNK):
        ids = range(start, min(n, start + CHUNK))
        yield [key_of(i) for i in ids], [value_of(i) for i in ids]


def rss_bytes() -> int:
    """The current resident set of this process (``/proc/self/statm``; not the peak)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def release_freed_memory() -> None:
    """Collect garbage and hand freed heap pages back to the OS (glibc ``malloc_trim``), so an RSS reading
    taken next counts live objects, not what an earlier phase freed."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def bench_baseline_ingest(n: int, nvb: int) -> float:
    """A plain dict + seqno loop doing the minimum a KV store must: map key -> vbucket, bump seqno, store.
    Timed per chunk, as the engine's ingest is, without generating the documents."""
    tables: list[dict[bytes, tuple[bytes, int]]] = [{} for _ in range(nvb)]
    seqnos = [0] * nvb
    crc = zlib.crc32
    took = 0.0
    for keys, values in chunks(n):
        t = time.perf_counter()
        for k, v in zip(keys, values, strict=True):
            vb = ((crc(k) >> 16) & 0x7FFF) % nvb
            s = seqnos[vb] + 1
            seqnos[vb] = s
            tables[vb][k] = (v, s)
        took += time.perf_counter() - t
    return n / took


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


def ingest_bucket(data_dir: Path) -> tuple[Bucket, Any]:
    """The bucket an ingest round loads, with a DCP connection streaming every vbucket from memory, registered
    before the load."""
    b = Bucket(BucketConfig(
        data_dir=data_dir,
        num_vbuckets=1024,
        checkpoint_quota_bytes=4 * 1024**3,
        flush_batch_items=250_000,
    ))
    prod = b.dcp_producer("bench-memory")
    for vb in range(1024):
        prod.stream_request(vb, 0)
    return b, prod


def timed_ingest(b: Bucket, n: int) -> tuple[float, int]:
    """(sets/s of ``Bucket.set`` over documents 0..n-1, timing only the store loop; raw key + value bytes)."""
    bset = b.set
    took = 0.0
    raw_bytes = 0
    for keys, values in chunks(n):
        t = time.perf_counter()
        for k, v in zip(keys, values, strict=True):
            bset(k, v)
        took += time.perf_counter() - t
        raw_bytes += sum(map(len, keys)) + sum(map(len, values))
    return n / took, raw_bytes


def ingest_round(n: int, tmp: Path) -> dict[str, float]:
    """One paired round of ``engine.ingest`` in a fresh process: the dict loop, then ``Bucket.set``, over the
    same documents -- what the first round in :func:`main` does before its other figures."""
    base = bench_baseline_ingest(n, 1024)
    release_freed_memory()
    b, prod = ingest_bucket(tmp / "data")
    rate, _raw = timed_ingest(b, n)
    prod.close()
    b.close(clean=False)
    return {"engine": rate, "baseline": base}


def ingest_in_own_process(n: int, tmp: Path) -> dict[str, float]:
    return child_result("bench.engine", ["--ingest-round", "--docs", str(n), "--work-dir", str(tmp)],
                        "an ingest round")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=1_000_000, help="documents to ingest (default 1M)")
    ap.add_argument("--rounds", type=int, default=3, help="paired rounds of engine.ingest (default 3)")
    ap.add_argument("--ingest-round", action="store_true", help=argparse.SUPPRESS)  # a child: one round
    ap.add_argument("--work-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    n = args.docs
    if n < 1000:
        ap.error("--docs must be at least 1000")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    if args.ingest_round:
        print(json.dumps(ingest_round(n, Path(args.work_dir))), flush=True)
        return
    engine_build()
    rss_start = rss_bytes()

    with tempfile.TemporaryDirectory(prefix="bench-engine-") as td:
        tmp = Path(td)
        base_ingest = bench_baseline_ingest(n, 1024)
        release_freed_memory()
        rss_before = rss_bytes()

        b, prod = ingest_bucket(tmp / "data")
        ingest, raw_bytes = timed_ingest(b, n)
        rounds = [{"engine": ingest, "baseline": base_ingest}]

        t = time.perf_counter()
        streamed = drain_count(prod)
        stream_rate = streamed / (time.perf_counter() - t)
        assert streamed == n, (streamed, n)
        # against this process's own ingest: the stream drains what that load queued
        figure("engine.stream_memory", stream_rate, "items/s", ingest, 2.0, "higher")

        t = time.perf_counter()
        flushed = b.flush_all()
        flush_rate = flushed / (time.perf_counter() - t)
        assert flushed == n

        # Every item is in the hash table, streamed and persisted: what the engine holds for N documents. SQLite's
        # page cache (a fixed amount per bucket, engine.kv.storage.PAGE_CACHE_KIB) is not per item: released first.
        b.storage.release_cache()
        release_freed_memory()
        resident = (rss_bytes() - rss_before) / n
        figure("engine.resident_bytes", resident, "bytes/item", raw_bytes / n, 2.0, "lower")

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

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        figure("engine.peak_rss", (peak - rss_start) / 1024**2, "MiB", raw_bytes / 1024**2, None, "lower")
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
        i = 0
        for keys, values in chunks(m):
            for k, v in zip(keys, values, strict=True):
                b.set(k, v)
                if i % 5000 == 4999:
                    b.flush()
                    drain_count(live)
                    b.recover_memory()
                used = b.counter.used
                if used > peak_mem:
                    peak_mem = used
                i += 1
        b.flush_all()
        drain_count(live)
        figure("engine.checkpoint_quota", peak_mem, "bytes", quota, 1.0, "lower")
        print(
            json.dumps({"info": "checkpoint_quota", "cursors_dropped": b.cursors_dropped, "docs": m}),
            flush=True,
        )
        b.close()
        for r in range(1, args.rounds):
            d = tmp / f"round{r}"
            d.mkdir()
            rounds.append(ingest_in_own_process(n, d))
        for r, rnd in enumerate(rounds):
            print(json.dumps({"info": "ingest_round", "round": r, **rnd,
                              "ratio": round(rnd["engine"] / rnd["baseline"], 3)}), flush=True)
        median = median_round(rounds, lambda rnd: rnd["engine"] / rnd["baseline"])
        figure("engine.ingest", median["engine"], "items/s", median["baseline"], 0.15, "higher")
    os.sync()


if __name__ == "__main__":
    main()
