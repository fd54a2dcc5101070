"""Search indexing benchmark: ``python -m bench.search [--docs N] [--rounds R]``.

Publishes N JSON documents (~250 bytes, 1024 vbuckets) with the in-process gateway publisher to a topic on the
broker the product would use (gateway.broker.select_broker), then measures, in the same run:

* ``search.index_throughput``  documents/s from the topic to a committed tantivy index through the search
  indexer (connectors/search/indexer.py: rollback-aware client, the document store -- its changelog -- in
  SQLite, the tantivy backend with the default dynamic mapping, commits batched by the indexer's defaults), timed from the
  indexer's construction until it is caught up and committed -- vs tantivy indexing the same documents
  directly (the same backend, ``TantivyBackend.apply`` of all of them and one commit, from memory; building the
  documents is not timed) (target >= 0.7x).
* ``search.index_1001006_docs_wall``  (only when N = 1,001,006) the indexer's wall time for those documents,
  beside go-dcp-elasticsearch's published 50 s for 1,001,006 documents (its README's benchmark: Couchbase to
  Elasticsearch, other hardware, other pipeline): information only, target null.

Each side runs in a process of its own (as ``bench.client`` does: the in-process engine tunes the cyclic GC for
its millions of items, which an indexer process does not have). ``--rounds`` paired rounds, alternating which
side goes first: each round runs both sides back to back and gives one ratio (direct seconds / indexer seconds,
both under the same load of the shared machine); the figure is the round with the median ratio (the lower middle
one for an even count), its rates as ``value`` and ``baseline``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

from bench.topic_fill import fill_topic

NVB = 1024
#: go-dcp-elasticsearch's published benchmark (its README): 1,001,006 documents in 50 s
GO_DCP_ES_DOCS = 1_001_006
GO_DCP_ES_SECONDS = 50.0

_WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo",
          "lima", "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango")
_CITIES = ("Lisbon", "Oslo", "Nairobi", "Lima", "Osaka", "Perth", "Quito", "Turin")


def document(i: int) -> tuple[str, bytes]:
    """The i-th benchmark document: a user profile of ~250 bytes (text, keyword, numbers, a date)."""
    w = _WORDS
    bio = " ".join(w[(i * 7 + j * 3) % len(w)] for j in range(12))
    body = {"name": f"user {i}", "email": f"user{i}@example.com", "age": 18 + i % 60,
            "city": _CITIES[i % len(_CITIES)], "joined": f"20{10 + i % 15:02d}-0{1 + i % 9}-1{i % 10}T10:00:00Z",
            "score": (i * 37 % 1000) / 10, "bio": bio}
    return f"user::{i:010d}", json.dumps(body, separators=(",", ":")).encode()


def publish(conf: dict[str, Any], client: dict[str, Any], n: int, tmp: Path) -> str:
    topic, _ = fill_topic(conf, client, tmp, "search", (document(i) for i in range(n)), pump_every=50_000)
    return topic


def run_indexer(client: dict[str, Any], topic: str, d: Path, n: int) -> dict[str, Any]:
    from connectors.search.indexer import SearchIndexer

    t = time.perf_counter()
    with SearchIndexer(client, topic, d) as ix:
        ix.catch_up()
        el = time.perf_counter() - t
        st = ix.stats
        assert st.indexed == n, (st.indexed, n)
        return {"seconds": el, "docs": st.indexed, "commits": st.commits}


def run_direct(d: Path, n: int) -> dict[str, Any]:
    from connectors.search.backend import Checkpoint, Upsert
    from connectors.search.mapping import DocumentMapping
    from connectors.search.tantivy_backend import TantivyBackend
    ops = []
    for i in range(n):
        k, v = document(i)
        ops.append(Upsert(k, ((zlib.crc32(k.encode()) >> 16) & 0x7FFF) % NVB, 1, v))  # the engine's vbucket
    mapping = DocumentMapping.dynamic_default()
    t = time.perf_counter()
    b = TantivyBackend(d, mapping)
    st = b.apply(ops)
    b.commit(Checkpoint(1, {}, mapping.id))
    el = time.perf_counter() - t
    b.close()
    assert st.indexed == n, (st.indexed, n)
    return {"seconds": el, "docs": st.indexed, "commits": 1}


def _cpu() -> float:
    """CPU seconds of this process and of its children that exited."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def in_own_process(role: str, client: dict[str, Any], topic: str, d: Path, n: int) -> dict[str, Any]:
    from bench.report import child_result

    return child_result("bench.search", ["--role", role, "--kafka", json.dumps(client), "--topic", topic,
                                         "--dir", str(d), "--docs", str(n)], f"the {role} run")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=3,
                    help="paired rounds of both sides (alternating which goes first); the median paired ratio")
    ap.add_argument("--role", choices=["indexer", "direct"], help=argparse.SUPPRESS)
    ap.add_argument("--kafka", help=argparse.SUPPRESS)
    ap.add_argument("--topic", help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.docs < 1 or args.rounds < 1:
        ap.error("--docs and --rounds must be at least 1")
    n = args.docs
    if args.role is not None:
        d = Path(args.dir)
        c0 = _cpu()
        r = (run_indexer(json.loads(args.kafka), args.topic, d, n) if args.role == "indexer" else run_direct(d, n))
        # CPU seconds of the whole process (librdkafka's and tantivy's threads included) and of its children (the
        # indexer's tantivy writer process): on a shared machine the wall time also counts waiting for a core
        r["cpu_seconds"] = _cpu() - c0
        print(json.dumps(r), flush=True)
        return

    from bench.report import figure
    from gateway.broker import select_broker
    from gateway.config import load_settings

    with select_broker() as broker, tempfile.TemporaryDirectory() as td:
        tmp = Path(td)
        settings = load_settings(None)
        conf = {**settings.producer_config(), "bootstrap.servers": broker.bootstrap_servers}
        client = {"bootstrap.servers": broker.bootstrap_servers}
        t = time.perf_counter()
        topic = publish(conf, client, n, tmp)
        print(json.dumps({"info": "search.publish", "docs": n, "seconds": round(time.perf_counter() - t, 1)}),
              flush=True)
        pairs = []
        for rnd in range(args.rounds):
            sides = ("indexer", "direct") if rnd % 2 == 0 else ("direct", "indexer")
            got = {side: in_own_process(side, client, topic, tmp / f"{side}{rnd}", n) for side in sides}
            ix, dr = got["indexer"], got["direct"]
            pairs.append((dr["seconds"] / ix["seconds"], ix, dr))
            print(json.dumps({"info": "search.round", "round": rnd, "first": sides[0],
                              "indexer_s": round(ix["seconds"], 2), "direct_s": round(dr["seconds"], 2),
                              "ratio": round(dr["seconds"] / ix["seconds"], 3),
                              "indexer_cpu_s": round(ix["cpu_seconds"], 2), "direct_cpu_s": round(dr["cpu_seconds"], 2),
                              "indexer_commits": ix["commits"], "load_avg": round(os.getloadavg()[0], 2)}),
                  flush=True)
            shutil.rmtree(tmp / f"indexer{rnd}", ignore_errors=True)
            shutil.rmtree(tmp / f"direct{rnd}", ignore_errors=True)
        pairs.sort(key=lambda r: r[0])
        _, ix, dr = pairs[(len(pairs) - 1) // 2]  # the median ratio (the lower middle one of an even count)
        median_ix = ix["seconds"]
        figure("search.index_throughput", n / median_ix, "docs/s", n / dr["seconds"], 0.7, "higher")
        print(json.dumps({"info": "search.index_wall", "docs": n, "indexer_s": round(median_ix, 2),
                          "direct_s": round(dr["seconds"], 2), "indexer_cpu_s": round(ix["cpu_seconds"], 2),
                          "direct_cpu_s": round(dr["cpu_seconds"], 2), "indexer_commits": ix["commits"],
                          "ratios": [round(r[0], 3) for r in pairs]}), flush=True)
        if n == GO_DCP_ES_DOCS:
            figure("search.index_1001006_docs_wall", median_ix, "s", GO_DCP_ES_SECONDS, None, "lower")


if __name__ == "__main__":
    main()
