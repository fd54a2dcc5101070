"""Child process for the SIGKILL crash tests: writes, flushes part, streams everything to stdout, waits.

Usage: python -m tests.engine.kv.crash_child DATA_DIR N_PERSISTED N_UNPERSISTED
Each DCP message is printed as one JSON line; then ``READY`` and the process sleeps until killed.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from engine import Bucket, BucketConfig, Item, SnapshotMarker


def main() -> None:
    data_dir, n_persisted, n_unpersisted = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    b = Bucket(BucketConfig(data_dir=data_dir, num_vbuckets=4, seed=None, checkpoint_max_items=50))
    p = b.dcp_producer("crash-client")
    for vb in range(4):
        p.stream_request(vb, 0)
    out = sys.stdout

    def pump() -> None:
        while True:
            msgs = p.step()
            if not msgs:
                return
            for m in msgs:
                if isinstance(m, SnapshotMarker):
                    out.write(json.dumps({"t": "marker", "vb": m.vbucket, "s": m.start, "e": m.end,
                                          "f": int(m.flags)}) + "\n")
                elif isinstance(m, Item):
                    out.write(json.dumps({"t": "item", "vb": m.vbucket, "seq": m.seqno, "k": m.key.hex(),
                                          "v": None if m.value is None else m.value.hex(), "op": int(m.op),
                                          "rev": m.rev_seqno, "cas": m.cas}) + "\n")

    for i in range(n_persisted):
        b.set(f"doc{i}", f"persisted-{i}")
        if i % 7 == 0:
            b.delete(f"doc{i}")
    pump()
    b.flush_all()
    for vb in range(4):
        out.write(json.dumps({"t": "failover", "vb": vb, "log": b.vbucket(vb).failover.to_pairs(),
                              "persisted": b.vbucket(vb).persisted_seqno}) + "\n")
    for i in range(n_unpersisted):
        b.set(f"doc{i}", f"unpersisted-{i}")
        b.set(f"new{i}", f"unpersisted-{i}")
    pump()
    out.write("READY\n")
    out.flush()
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main()
