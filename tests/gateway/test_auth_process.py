"""Default-secure ``dcpgw up`` as a real process (docs/security.md): the first start generates the password of
``Administrator``, prints it once and stores it 0600; the CLI finds it (README quick start unchanged) and talks
HTTPS to a gateway started with ``--tls-cert/--tls-key``, trusting that certificate; wrong credentials, a role
too small and an untrusted certificate are one error line each. Mutual TLS in process with trustme certificates.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import ssl
import stat
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import trustme

from gateway.broker import Broker
from gateway.config import load_settings
from gateway.service import GatewayService
from tests.credentials import ADMIN_PASSWORD, ADMIN_PASSWORD_ENV, auth_headers
from tests.gateway import processes
from tests.gateway.processes import CLEAN_ENV

#: no admin password from the test session: the first start generates one
NO_PASSWORD_ENV = {k: v for k, v in CLEAN_ENV.items() if k != ADMIN_PASSWORD_ENV}


@pytest.fixture()
def pki(tmp_path: Path) -> dict[str, Any]:
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("client@example.com")
    out: dict[str, Any] = {"ca_obj": ca}
    for name, blob in [("ca", ca.cert_pem), ("cert", server.cert_chain_pems[0]), ("key", server.private_key_pem),
                       ("client_cert", client.cert_chain_pems[0]), ("client_key", client.private_key_pem)]:
        out[name] = tmp_path / f"{name}.pem"
        blob.write_to_path(str(out[name]))
    other = trustme.CA()
    out["other_ca"] = tmp_path / "other-ca.pem"
    other.cert_pem.write_to_path(str(out["other_ca"]))
    return out


def cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return processes.dcpgw(*args, env={**NO_PASSWORD_ENV, **env}, timeout=120)


def one_error_line(res: subprocess.CompletedProcess[str]) -> str:
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode != 0 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr[-3000:]
    return lines[0]


def start_up(broker: Broker, data: Path, log: Path, *extra: str) -> tuple[subprocess.Popen[bytes], str]:
    env = {**NO_PASSWORD_ENV, "KAFKA_BOOTSTRAP_SERVERS": broker.bootstrap_servers, "DCPGW_DATA_DIR": str(data),
           "DCPGW_BUCKET": f"sec{uuid.uuid4().hex[:8]}", "DCPGW_NUM_VBUCKETS": "4", "DCPGW_HTTP_PORT": "0"}
    state = data / "dcpgw-state.json"
    state.unlink(missing_ok=True)
    with open(log, "ab") as f:
        proc = subprocess.Popen([*processes.CLI, "up", "--no-progress", *extra], env=env, cwd=processes.ROOT,
                                stdout=subprocess.DEVNULL, stderr=f)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        if state.exists():
            try:
                return proc, str(json.loads(state.read_text())["http_url"])
            except (ValueError, KeyError):
                pass
        time.sleep(0.1)
    proc.kill()
    raise AssertionError("dcpgw up did not come up: " + log.read_text()[-3000:])


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def get(url: str, ctx: ssl.SSLContext, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=20, context=ctx) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_first_start_generated_password_https_and_the_cli(kafka_broker: Broker, tmp_path: Path,
                                                           pki: dict[str, Any]) -> None:
    data = tmp_path / "data"
    log = tmp_path / "gw.log"
    proc, url = start_up(kafka_broker, data, log, "--tls-cert", str(pki["cert"]), "--tls-key", str(pki["key"]))
    try:
        assert url.startswith("https://127.0.0.1:")
        ctx = ssl.create_default_context(cafile=str(pki["ca"]))
        assert get(url + "/health/live", ctx)[0] == 200  # the one public route
        status, body = get(url + "/stats", ctx)
        assert status == 401 and json.loads(body)["error"] == "unauthorized"
        pw_file = data / "admin-password"
        password = pw_file.read_text().strip()
        assert stat.S_IMODE(pw_file.stat().st_mode) == 0o600
        assert stat.S_IMODE((data / "users.json").stat().st_mode) == 0o600
        text = log.read_text()
        assert text.count(password) == 1 and "created user Administrator" in text  # printed once
        admin = {"Authorization": "Basic " + __import__("base64").b64encode(
            f"Administrator:{password}".encode()).decode()}
        assert get(url + "/stats", ctx, admin)[0] == 200
        # plain HTTP on the HTTPS port gets nothing
        with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
            urllib.request.urlopen(url.replace("https", "http") + "/health/live", timeout=10).read()

        # the README's quick start: no credentials given, the CLI finds the generated password and trusts the
        # certificate the gateway serves (from its state file)
        res = cli("load", "--docs", "20", "--batch", "10", "--data-dir", str(data))
        assert res.returncode == 0 and "wrote 20 documents" in res.stdout, res.stderr
        res = cli("status", "--data-dir", str(data), "--json")
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["stats"]["items"] == 20

        # a user of the store made by `dcpgw user add` while the gateway runs; credentials from the environment
        res = cli("user", "add", "watcher", "--password", "watch-pw", "--role", "dcp_reader", "--data-dir", str(data))
        assert res.returncode == 0, res.stderr
        res = cli("status", "--data-dir", str(data), "--json", DCPGW_USER="watcher", DCPGW_PASSWORD="watch-pw")
        assert res.returncode == 0, res.stderr
        line = one_error_line(cli("load", "--docs", "5", "--data-dir", str(data), "--user", "watcher",
                                  "--password", "watch-pw"))
        assert "403" in line and "data_writer" in line and "watch-pw" not in line
        assert "the refused batch was not written" in line, line  # a 4xx wrote nothing: no hedge
        # wrong credentials: one line naming the user, never the password
        line = one_error_line(cli("status", "--data-dir", str(data), "--user", "Administrator",
                                  "--password", "Wr0ng-guess"))
        assert "authentication failed for user 'Administrator'" in line and "Wr0ng-guess" not in line
        line = one_error_line(cli("status", "--data-dir", str(data), "--user", "watcher"))
        assert "--password" in line
        # no credentials anywhere (a data directory without admin-password): said so, not "authentication failed"
        line = one_error_line(cli("status", "--url", url, "--data-dir", str(tmp_path / "empty"),
                                  "--cacert", str(pki["ca"])))
        assert "no credentials found" in line, line
        # a CA that did not sign the gateway's certificate
        line = one_error_line(cli("status", "--data-dir", str(data), "--cacert", str(pki["other_ca"])))
        assert "CERTIFICATE_VERIFY_FAILED" in line or "certificate verify failed" in line, line
        res = cli("status", "--data-dir", str(data), "--json", DCPGW_CACERT=str(pki["ca"]))
        assert res.returncode == 0, res.stderr
    finally:
        stop(proc)
    # second start: nothing generated, nothing printed; the password still works
    before = log.read_text()
    proc, url = start_up(kafka_broker, data, log, "--tls-cert", str(pki["cert"]), "--tls-key", str(pki["key"]))
    try:
        ctx = ssl.create_default_context(cafile=str(pki["ca"]))
        assert get(url + "/stats", ctx, admin)[0] == 200
        assert "created user" not in log.read_text()[len(before):]
    finally:
        stop(proc)
    assert log.read_text().count(password) == 1


def test_bad_tls_files_fail_the_start_in_one_line(tmp_path: Path, pki: dict[str, Any]) -> None:
    data = tmp_path / "d"
    line = one_error_line(cli("up", "--no-progress", "--data-dir", str(data), "--http-port", "0",
                              "--tls-cert", str(tmp_path / "missing.pem"), "--tls-key", str(pki["key"]),
                              KAFKA_BOOTSTRAP_SERVERS="127.0.0.1:1"))
    assert "missing.pem does not exist" in line
    line = one_error_line(cli("up", "--no-progress", "--data-dir", str(data), "--http-port", "0",
                              "--tls-cert", str(pki["cert"]), KAFKA_BOOTSTRAP_SERVERS="127.0.0.1:1"))
    assert "tls_key" in line
    line = one_error_line(cli("up", "--no-progress", "--data-dir", str(data), "--http-port", "0",
                              "--tls-cert", str(pki["cert"]), "--tls-key", str(pki["client_key"]),
                              KAFKA_BOOTSTRAP_SERVERS="127.0.0.1:1"))
    assert "cannot be loaded" in line and "PRIVATE KEY" not in line
    # on the embedded broker too: the files are checked before the broker starts (no broker log line first)
    line = one_error_line(cli("up", "--no-progress", "--data-dir", str(data), "--http-port", "0",
                              "--tls-cert", str(tmp_path / "missing.pem"), "--tls-key", str(pki["key"])))
    assert "missing.pem does not exist" in line
    assert not (data / "admin-password").exists()  # nothing was created either


def test_a_first_start_that_fails_still_prints_the_generated_password(tmp_path: Path) -> None:
    """The user store is created before Kafka is reached: when the start fails after it, the generated password
    is printed all the same (no later start prints it again)."""
    data = tmp_path / "d"
    res = cli("up", "--no-progress", "--data-dir", str(data), "--http-port", "0",
              KAFKA_BOOTSTRAP_SERVERS="127.0.0.1:1", DCPGW_KAFKA_CONNECT_TIMEOUT_S="1")
    assert res.returncode != 0
    password = (data / "admin-password").read_text().strip()
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 2 and lines[-1].startswith("error: ") and "127.0.0.1:1" in lines[-1], res.stderr[-3000:]
    assert "generated password" in lines[0] and password in lines[0], lines[0]


def test_mutual_tls_in_process(kafka_broker: Broker, tmp_path: Path, pki: dict[str, Any]) -> None:
    async def main() -> None:
        settings = load_settings(None, data_dir=tmp_path / "data", bucket=f"mtls{uuid.uuid4().hex[:8]}",
                                 num_vbuckets=4, http_port=0, tls_cert=pki["cert"], tls_key=pki["key"],
                                 tls_client_ca=pki["ca"])
        svc = GatewayService(settings, kafka_broker.bootstrap_servers)
        await svc.start()
        try:
            url = f"https://127.0.0.1:{svc.http_port}"
            assert svc.http_scheme == "https"
            with_cert = ssl.create_default_context(cafile=str(pki["ca"]))
            with_cert.load_cert_chain(str(pki["client_cert"]), str(pki["client_key"]))
            async with aiohttp.ClientSession(headers=auth_headers()) as http:
                r = await http.get(f"{url}/stats", ssl=with_cert)
                assert r.status == 200
                no_cert = ssl.create_default_context(cafile=str(pki["ca"]))
                with pytest.raises((aiohttp.ClientError, ssl.SSLError, OSError)):
                    r = await http.get(f"{url}/stats", ssl=no_cert)
                    await r.read()
            # the CLI sends no client certificate: its one line says that may be why
            res = await asyncio.to_thread(cli, "status", "--url", url, "--cacert", str(pki["ca"]),
                                          "--data-dir", str(tmp_path / "data"), **{ADMIN_PASSWORD_ENV: ADMIN_PASSWORD})
            line = one_error_line(res)
            assert "cannot reach the gateway" in line and "client certificate" in line, line
        finally:
            await svc.stop()

    assert os.environ[ADMIN_PASSWORD_ENV] == ADMIN_PASSWORD
    asyncio.run(main())
