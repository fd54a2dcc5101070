"""A noida-db server with only its Elasticsearch service (PyPI ``noida-db``, pinned in the dev extra): the test
server of the search indexer's Elasticsearch backend (docs/search.md "Elasticsearch backend"). It answers the
``_bulk``, ``_search``, ``_mget``, scroll, ``_refresh`` and index APIs and reports version 8.15.3."""

from __future__ import annotations

import importlib.util
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest


def noida_binary() -> Path:
    if importlib.util.find_spec("noida_db") is None:
        pytest.skip("noida-db is not installed (pip install -e '.[dev]')")
    from importlib.resources import files

    binary = Path(str(files("noida_db").joinpath("noida-db")))
    if not binary.is_file():
        pytest.skip(f"noida-db has no binary for this platform ({binary})")
    binary.chmod(0o755)
    return binary


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class NoidaElasticsearch:
    """``start()`` / ``stop()`` a noida-db Elasticsearch service on ``port`` (its data in a temporary dir)."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.data = Path(tempfile.mkdtemp(prefix="dcpgw-noida-es-"))
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30) -> NoidaElasticsearch:
        binary = noida_binary()
        with open(self.data / "noida.log", "ab") as log:
            self.proc = subprocess.Popen(
                [str(binary), "start", "--only", "elasticsearch", "--elasticsearch-port", str(self.port),
                 "--data-dir", str(self.data / "d")], stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                pytest.skip(f"noida-db did not start (exit {self.proc.returncode}): "
                            f"{(self.data / 'noida.log').read_text()[-500:]}")
            try:
                with urllib.request.urlopen(self.url, timeout=1):
                    return self
            except OSError:
                if time.monotonic() > deadline:
                    pytest.skip("noida-db's Elasticsearch service did not answer within 30 s")
                time.sleep(0.1)

    def stop(self) -> None:
        p = self.proc
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGINT)
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.proc = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.data, ignore_errors=True)
