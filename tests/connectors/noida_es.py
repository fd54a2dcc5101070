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


def _flavor_param(flavor: str) -> object:
    module = {"elasticsearch": "elasticsearch", "opensearch": "opensearchpy"}[flavor]
    missing = importlib.util.find_spec(module) is None
    return pytest.param(flavor, id=flavor, marks=pytest.mark.skipif(
        missing, reason=f"{module} is not installed (pip install -e '.[dev]')"))


#: ``@pytest.fixture(params=FLAVOR_PARAMS)``: a test once per client library of the cluster backend
#: (connectors/search/cluster_api.py), both against noida-db
FLAVOR_PARAMS = [_flavor_param("elasticsearch"), _flavor_param("opensearch")]


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


class FaultyProxy:
    """An HTTP proxy in front of a server that answers some requests itself, in the order of ``faults``: an
    entry ``"429"`` / ``"503"`` refuses the next bulk request with that status, ``"items-503"`` answers it 200
    with every item failed with 503, ``"STATUS@PART"`` refuses the next request (any API) whose path contains
    ``PART`` (``"502@_refresh"``); nothing of a refused request reaches the server. Everything else is
    forwarded. The search cluster's overload answers, on a real server behind it.

    ``max_body_bytes``: a request with a larger body is answered 413 with an empty body and not forwarded --
    what Elasticsearch does above ``http.max_content_length`` (Netty's aggregator; 100 MB by default) and what a
    reverse proxy's body limit does (nginx's ``client_max_body_size``); noida-db itself has no such limit.
    ``too_large`` counts those answers, ``bodies`` the sizes of the bulk bodies forwarded."""

    def __init__(self, target: str, faults: list[str] | None = None, max_body_bytes: int | None = None) -> None:
        import json
        import urllib.error
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.faults = list(faults or [])
        self.refused: list[str] = []
        self.max_body_bytes = max_body_bytes
        self.too_large = 0
        self.bodies: list[int] = []
        proxy = self

        def take_fault(path: str) -> str | None:
            for i, f in enumerate(proxy.faults):
                status, _, part = f.partition("@")
                if (part and part in path) or (not part and "_bulk" in path):
                    proxy.refused.append(proxy.faults.pop(i))
                    return status
            return None

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a: object) -> None:
                pass

            def _forward(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else None
                if proxy.max_body_bytes is not None and n > proxy.max_body_bytes:
                    proxy.too_large += 1
                    self._answer(413, b"")
                    return
                fault = take_fault(self.path)
                if fault is not None:
                    if fault == "items-503":
                        lines = [json.loads(x) for x in (body or b"").splitlines() if x.strip()]
                        items = [{next(iter(m)): {"status": 503, "error": {"type": "unavailable_shards_exception",
                                                                             "reason": "test"}}}
                                 for m in lines if next(iter(m)) in ("index", "delete")]
                        self._answer(200, json.dumps({"errors": True, "took": 0, "items": items}).encode())
                    else:
                        self._answer(int(fault), json.dumps({"error": {"type": "es_rejected_execution_exception",
                                                                       "reason": "test"},
                                                             "status": int(fault)}).encode())
                    return
                if "_bulk" in self.path:
                    proxy.bodies.append(n)
                req = urllib.request.Request(target + self.path, data=body, method=self.command,
                                             headers={k: v for k, v in self.headers.items()
                                                      if k.lower() not in ("host", "content-length")})
                try:
                    with urllib.request.urlopen(req, timeout=30) as r:
                        self._answer(r.status, r.read(), dict(r.headers))
                except urllib.error.HTTPError as e:
                    self._answer(e.code, e.read(), dict(e.headers))

            def _answer(self, status: int, data: bytes, headers: dict[str, str] | None = None) -> None:
                self.send_response(status)
                hs = headers or {}
                self.send_header("Content-Type", hs.get("Content-Type", "application/json"))
                self.send_header("X-Elastic-Product", "Elasticsearch")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = _forward

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        import threading

        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
