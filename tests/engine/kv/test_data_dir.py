"""The data directory (engine/kv/data_dir.py, engine/kv/durable_file.py): one process per directory (a flock held by a
real other process, released by kill -9), single-bucket vs cluster layout, and state files that a crash at any
instant leaves old or new -- never empty (issue 16 items 4 and 8; docs/reliability.md "Data directory")."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from engine import Bucket, BucketConfig
from engine.cluster.local import Cluster
from engine.kv.data_dir import (
    LOCK_FILE,
    DataDirLock,
    DataDirLocked,
    DataDirMismatch,
    Layout,
    check_layout,
    layout,
)
from engine.kv.durable_file import write_atomically

ROOT = Path(__file__).resolve().parents[3]


def _child(code: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _hold_lock(d: Path) -> subprocess.Popen[bytes]:
    p = _child(f"""
        import sys, time
        from engine.kv.data_dir import DataDirLock
        lock = DataDirLock.acquire({str(d)!r})
        print("locked", flush=True)
        time.sleep(600)
    """)
    assert p.stdout is not None
    assert p.stdout.readline().strip() == b"locked", p.stderr.read() if p.stderr else b""
    return p


def test_lock_held_by_another_process_names_its_pid_and_kill9_releases_it(tmp_path: Path) -> None:
    d = tmp_path / "data"
    holder = _hold_lock(d)
    try:
        t0 = time.monotonic()
        with pytest.raises(DataDirLocked) as ei:
            DataDirLock.acquire(d)
        assert time.monotonic() - t0 < 10  # refused, not waited for
        assert ei.value.pid == holder.pid
        assert f"process {holder.pid}" in str(ei.value)
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
        with DataDirLock(d) as lock:  # the kernel released it with the process
            assert lock.held
            assert (d / LOCK_FILE).read_text().strip() == str(os.getpid())
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


def test_lock_in_one_process_excludes_a_second_holder_and_is_reusable(tmp_path: Path) -> None:
    d = tmp_path / "data"
    first = DataDirLock.acquire(d)
    with pytest.raises(DataDirLocked):
        DataDirLock.acquire(d)  # flock is per open file: a second open in the same process is refused too
    first.release()
    assert (d / LOCK_FILE).read_text() == ""  # the pid is cleared on release
    DataDirLock.acquire(d).release()


def test_lock_on_an_unwritable_place_is_an_oserror(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(OSError):
        DataDirLock.acquire(f)


def test_layout_single_bucket_vs_cluster(tmp_path: Path) -> None:
    single = tmp_path / "single"
    assert layout(single) is Layout.EMPTY
    Bucket(BucketConfig(data_dir=single, num_vbuckets=4, tune_gc=False)).close()
    assert layout(single) is Layout.BUCKET
    assert check_layout(single, cluster=False) is Layout.BUCKET
    with pytest.raises(DataDirMismatch, match="single-bucket data"):
        check_layout(single, cluster=True)

    clustered = tmp_path / "cluster"
    Cluster.create(clustered, nodes=2, replicas=1, num_vbuckets=4).close()
    assert layout(clustered) is Layout.CLUSTER
    with pytest.raises(DataDirMismatch, match="holds a cluster"):
        check_layout(clustered, cluster=False)
    (clustered / "vbucket_map.json").unlink()  # node directories alone still say "cluster"
    assert layout(clustered) is Layout.CLUSTER
    with pytest.raises(DataDirMismatch):
        check_layout(clustered, cluster=False)


def test_write_atomically_replaces_and_leaves_no_temp(tmp_path: Path) -> None:
    p = tmp_path / "state.json"
    write_atomically(p, b"one")
    write_atomically(p, b"two")
    assert p.read_bytes() == b"two"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["state.json"]


def test_write_atomically_killed_mid_write_leaves_the_old_content(tmp_path: Path) -> None:
    """A process killed -9 while writing a state file (large, so the kill lands inside the write): the file
    holds the complete old content or a complete new one, never a prefix or nothing. (``Path.write_text`` --
    how the vbucket map was saved -- leaves a truncated file here.)"""
    p = tmp_path / "vbucket_map.json"
    old = b"{" + b"o" * 1000 + b"}"
    p.write_bytes(old)
    new_size = 64 * 1024 * 1024
    for _attempt in range(3):
        child = _child(f"""
            from engine.kv.durable_file import write_atomically
            data = b"{{" + b"n" * ({new_size} - 2) + b"}}"
            print("go", flush=True)
            while True:
                write_atomically({str(p)!r}, data)
        """)
        assert child.stdout is not None
        assert child.stdout.readline().strip() == b"go"
        deadline = time.monotonic() + 10
        tmp = None
        while time.monotonic() < deadline:
            tmps = list(tmp_path.glob(".vbucket_map.json.*.tmp"))
            if tmps and tmps[0].exists() and 0 < tmps[0].stat().st_size < new_size:
                tmp = tmps[0]
                break
            time.sleep(0.001)
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        got = p.read_bytes()
        assert got == old or (len(got) == new_size and got.endswith(b"}")), len(got)
        if tmp is not None and got == old:
            return  # the kill landed inside the write: the old content survived
    pytest.fail("the kill never landed inside a write")


def test_write_atomically_failing_write_keeps_the_old_content(tmp_path: Path) -> None:
    """A write that fails (the file size limit, as a full disk) raises, removes its temp file and leaves the
    old content."""
    p = tmp_path / "state.json"
    p.write_bytes(b"old")
    child = _child(f"""
        import resource, signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
        from engine.kv.durable_file import write_atomically
        try:
            write_atomically({str(p)!r}, b"x" * 100_000)
        except OSError as e:
            print("failed", e.errno, flush=True)
    """)
    out, err = child.communicate(timeout=30)
    assert out.startswith(b"failed"), err
    assert p.read_bytes() == b"old"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["state.json"]
