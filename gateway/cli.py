"""The ``dcpgw`` command line.

* ``dcpgw up``      engine + gateway + HTTP API, on the embedded broker unless ``KAFKA_BOOTSTRAP_SERVERS`` is set;
  ``--nodes 3 --replicas 1`` runs an in-process cluster of engine nodes behind the one gateway
* ``dcpgw cluster status|map|failover NODE [--graceful]|rebalance [--add N] [--remove N]|recover NODE
  --delta|--full``  the running gateway's cluster (HTTP admin API)
* ``dcpgw load``    write generator (through the HTTP API), with a progress bar
* ``dcpgw status``  the running gateway's stats and the vbuckets that lag most
* ``dcpgw gateway --source HOST:PORT[,...] --group NAME``  one more gateway process of a group sharing the
  vbuckets of running engine node processes (docs/scale-out.md)
* ``dcpgw tail``    print the decoded records of one vbucket's partition
* ``dcpgw replicate`` keep a SQLite table equal to the bucket (rollback-aware client, connectors/)
* ``dcpgw xdcr`` replicate the topic into another cluster with meta (connectors/xdcr, docs/xdcr.md)
* ``dcpgw user add|list|delete|passwd``  the users of the data directory (docs/security.md)
* ``dcpgw index``   a search index of the topic with a consistent query API (connectors/search, docs/search.md)
* ``dcpgw broker``  run the embedded Tansu broker alone; ``dcpgw version``

Commands that call the HTTP API authenticate with ``--user/--password`` (or ``DCPGW_USER`` / ``DCPGW_PASSWORD``),
else as ``Administrator`` with ``DCPGW_ADMIN_PASSWORD`` or the password ``dcpgw up`` generated into
``<data dir>/admin-password``; an ``https://`` gateway is verified with ``--cacert`` (``DCPGW_CACERT``), else with
the certificate the running gateway serves (docs/security.md "CLI").
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import ssl
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, NoReturn

import typer

from gateway import __version__
from gateway.broker import EmbeddedTansuBroker
from gateway.exceptions import BrokerStartError

if TYPE_CHECKING:
    from engine.kv.data_dir import DataDirLock

app = typer.Typer(
    name="dcpgw",
    help="dcp-gateway: stream a Couchbase-style DCP change feed into Kafka.",
    no_args_is_help=True,
    add_completion=False,
)


@app.command()
def version() -> None:
    """Print the dcp-gateway version."""
    typer.echo(__version__)


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


@app.command()
def broker(
    port: int = typer.Option(0, help="Loopback port to listen on; 0 picks a free one."),
    start_timeout: float = typer.Option(30.0, help="Seconds to wait for the broker to get ready."),
) -> None:
    """Run the embedded Tansu Kafka-protocol broker (memory only) until Ctrl-C.

    Prints the bootstrap address for clients (KAFKA_BOOTSTRAP_SERVERS). Nothing is kept after it stops.
    """
    embedded = EmbeddedTansuBroker(port=port or None, start_timeout=start_timeout)
    try:
        embedded.start()
    except BrokerStartError as exc:
        where = f" (broker log: {exc.log_path})" if exc.log_path else ""
        typer.echo(f"error: {_one_line(exc)}{where}", err=True)
        raise typer.Exit(1) from exc
    # SIGTERM (docker stop, kill) stops the broker in order, like Ctrl-C.
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        typer.echo(f"embedded Tansu broker (pid {embedded.pid}) listening")
        typer.echo(f"KAFKA_BOOTSTRAP_SERVERS={embedded.bootstrap_servers}")
        typer.echo(f"log: {embedded.log_path}")
        typer.echo("Ctrl-C to stop.")
        while (status := embedded.poll()) is None:
            time.sleep(0.5)
        typer.echo(
            f"error: broker exited unexpectedly with status {status}; log: {embedded.log_path}", err=True
        )
        raise typer.Exit(1)
    except KeyboardInterrupt:
        typer.echo("stopping broker")
    finally:
        embedded.stop()
        signal.signal(signal.SIGTERM, previous)


# ---------------------------------------------------------------------- shared helpers
STATE_FILE = "dcpgw-state.json"
DEFAULT_DATA_DIR = Path("./data")  # issue 3's default (docs/configuration.md)


def _fail(message: str) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


def _state(data_dir: Path) -> dict[str, Any]:
    f = data_dir / STATE_FILE
    try:
        return dict(json.loads(f.read_text()))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        _fail(f"cannot read {f}: {e}")


def _url(url: str | None, data_dir: Path) -> str:
    if url:
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            _fail(f"--url {url!r}: not an http:// or https:// URL (e.g. http://127.0.0.1:8091)")
        return url.rstrip("/")
    st = _state(data_dir)
    return str(st.get("http_url") or "http://127.0.0.1:8091")


@dataclass
class _Connection:
    """How this process talks to the gateway: the ``Authorization`` header and the TLS context (never shown)."""

    user: str = ""
    authorization: str | None = None
    tls: ssl.SSLContext | None = None
    #: where the credentials came from, for the message of a 401
    source: str = "no credentials"

    def __repr__(self) -> str:
        return f"_Connection(user={self.user!r}, source={self.source!r})"


_CONNECTION = _Connection()

_USER = typer.Option(None, "--user", envvar="DCPGW_USER", show_envvar=True,
                     help="User for the HTTP API (default: Administrator).")
_PASSWORD = typer.Option(None, "--password", envvar="DCPGW_PASSWORD", show_envvar=True,
                         help="Its password (default: DCPGW_ADMIN_PASSWORD, else DATA_DIR/admin-password).")
_CACERT = typer.Option(None, "--cacert", envvar="DCPGW_CACERT", show_envvar=True,
                       help="CA certificate (PEM) to verify an https:// gateway (default: the certificate the "
                            "running gateway serves, from its state file).")


def _credentials(data_dir: Path, user: str | None, password: str | None) -> tuple[str, str | None, str]:
    """(user, password, where they came from) for the HTTP API (docs/security.md "CLI"): --user/--password (or
    DCPGW_USER / DCPGW_PASSWORD), else Administrator with DCPGW_ADMIN_PASSWORD, else DATA_DIR/admin-password."""
    from engine.security import ADMIN_USER, read_admin_password

    if password is None and user not in (None, ADMIN_USER):
        _fail(f"--user {user} needs --password (or DCPGW_PASSWORD)")
    if password is not None:
        return user or ADMIN_USER, password, "--user/--password (or DCPGW_USER/DCPGW_PASSWORD)"
    env = os.environ.get("DCPGW_ADMIN_PASSWORD") or None
    if env is not None:
        return ADMIN_USER, env, "DCPGW_ADMIN_PASSWORD"
    return ADMIN_USER, read_admin_password(data_dir), f"{data_dir / 'admin-password'}"


def _connect(url: str | None, data_dir: Path, user: str | None, password: str | None,
             cacert: Path | None) -> str:
    """The gateway's base URL; sets the credentials and TLS context of every request of this command
    (module doc, docs/security.md "CLI")."""
    import base64

    from engine.exceptions import TlsConfigError
    from engine.security import client_context

    base = _url(url, data_dir)
    user, password, source = _credentials(data_dir, user, password)
    conn = _Connection(user=user, source=source if password is not None else "no credentials")
    if password is not None:
        conn.authorization = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode("ascii")
    if base.startswith("https://"):
        cafile = cacert
        if cafile is None:
            configured = _state(data_dir).get("tls_cert")
            cafile = Path(configured) if configured else None
        try:
            conn.tls = client_context(cafile)
        except TlsConfigError as e:
            _fail(str(e))
        # the gateway's own (leaf) certificate may be trusted directly (local use, docs/security.md)
        conn.tls.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    global _CONNECTION
    _CONNECTION = conn
    return base


def _auth_problem(method: str, url: str, code: int, msg: str) -> str | None:
    """The one-line message of a 401 / 403 (no secret in it); None for other statuses."""
    c = _CONNECTION
    if code == 401:
        if c.source == "no credentials":  # nothing given, no DCPGW_ADMIN_PASSWORD, no DATA_DIR/admin-password
            return (f"{method} {url} -> HTTP 401: no credentials found (no --user/--password, DCPGW_PASSWORD, "
                    f"DCPGW_ADMIN_PASSWORD or admin-password file in the data directory); pass --user/--password "
                    f"or set DCPGW_USER/DCPGW_PASSWORD")
        return (f"{method} {url} -> HTTP 401: authentication failed for user {c.user!r} (credentials from "
                f"{c.source}); pass --user/--password or set DCPGW_USER/DCPGW_PASSWORD")
    if code == 403:
        return f"{method} {url} -> HTTP 403: {msg}"
    return None


class _RequestFailed(Exception):
    """An HTTP request to the gateway failed; the message is one line. ``status``: the gateway's HTTP status when
    it answered (a 4xx refused the request whole: nothing of it was written), None when it did not answer."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class _RetryLater(_RequestFailed):
    """The gateway answered 503 with ``Retry-After`` (write backpressure): nothing of the request was written;
    the same request may be sent again after :attr:`retry_after` seconds."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


def _retry_after(value: str | None) -> float | None:
    """``Retry-After`` in seconds (delta-seconds or an HTTP date); None when absent or unreadable."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    import email.utils

    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def _request(method: str, url: str, body: bytes | None = None, timeout: float = 30.0) -> Any:
    headers = {"Content-Type": "application/json"}
    if _CONNECTION.authorization is not None:
        headers["Authorization"] = _CONNECTION.authorization
    req = urllib.request.Request(url, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=_CONNECTION.tls) as resp:
            return json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as e:
        try:
            err = json.loads(e.read())
            msg = f"{err.get('error')}: {err.get('message')}"
        except ValueError:
            msg = str(e)
        auth = _auth_problem(method, url, e.code, msg)
        if auth is not None:
            raise _RequestFailed(auth, e.code) from e
        wait = _retry_after(e.headers.get("Retry-After")) if e.code == 503 and e.headers else None
        if wait is not None:
            raise _RetryLater(f"{method} {url} -> HTTP {e.code}: {msg}", wait) from e
        raise _RequestFailed(f"{method} {url} -> HTTP {e.code}: {msg}", e.code) from e
    except (urllib.error.URLError, OSError) as e:
        raise _RequestFailed(_unreachable(url, e)) from e


def _unreachable(url: str, e: BaseException) -> str:
    """The one line of a request the gateway did not answer. An https:// connection made and then closed or reset
    by the server (not refused) is what a gateway started with --tls-ca does to a client without a certificate."""
    import http.client

    hint = "is `dcpgw up` running?"
    cause = e.reason if isinstance(e, urllib.error.URLError) else e
    if url.startswith("https://") and isinstance(
            cause, http.client.RemoteDisconnected | ConnectionResetError | ssl.SSLError | BrokenPipeError):
        hint += (" a gateway started with --tls-ca requires a client certificate, which the CLI does not send "
                 "(docs/security.md)")
    return f"cannot reach the gateway at {url}: {e} ({hint})"


def _http(method: str, url: str, body: bytes | None = None, timeout: float = 30.0) -> Any:
    try:
        return _request(method, url, body, timeout)
    except _RequestFailed as e:
        _fail(str(e))


class _Terminated(Exception):
    """SIGTERM, raised in the main thread like KeyboardInterrupt for SIGINT."""


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise _Terminated


def _kafka_client(bootstrap: str) -> dict[str, Any]:
    """A Kafka client configuration for ``bootstrap`` whose librdkafka log lines are rate-limited; exits in
    one line when Kafka does not answer within ``DCPGW_KAFKA_CONNECT_TIMEOUT_S`` (10 s)."""
    from gateway.exceptions import BrokerError
    from gateway.kafka import default_client_log, with_client_log
    from gateway.resume import wait_for_kafka

    conf = {"bootstrap.servers": bootstrap}
    raw = os.environ.get("DCPGW_KAFKA_CONNECT_TIMEOUT_S", "10")
    try:
        timeout = float(raw)
    except ValueError:
        _fail(f"DCPGW_KAFKA_CONNECT_TIMEOUT_S={raw!r} is not a number of seconds")
    try:
        wait_for_kafka(conf, timeout, setting="DCPGW_KAFKA_CONNECT_TIMEOUT_S")
    except BrokerError as e:
        _fail(str(e))
    return with_client_log(conf, default_client_log())


def _readiness(base: str) -> dict[str, Any]:
    """``GET /health/ready``: its body whether the answer is 200 (ready) or 503 (not ready, with reasons)."""
    headers = {} if _CONNECTION.authorization is None else {"Authorization": _CONNECTION.authorization}
    req = urllib.request.Request(f"{base}/health/ready", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30.0, context=_CONNECTION.tls) as resp:
            return dict(json.loads(resp.read()))
    except urllib.error.HTTPError as e:
        auth = _auth_problem("GET", f"{base}/health/ready", e.code, e.reason)
        if auth is not None:
            with contextlib.suppress(ValueError, OSError):
                err = json.loads(e.read())
                auth = _auth_problem("GET", f"{base}/health/ready", e.code, str(err.get("message"))) or auth
            _fail(auth)
        if e.code != 503:
            _fail(f"GET {base}/health/ready -> HTTP {e.code}")
        try:
            return dict(json.loads(e.read()))
        except ValueError:
            return {"status": "failing", "reasons": [f"HTTP 503: {e.reason}"]}
    except (urllib.error.URLError, OSError) as e:
        _fail(_unreachable(base, e))


# ---------------------------------------------------------------------- up
@app.command()
def up(
    config: Path | None = typer.Option(None, "--config", "-c", help="TOML or JSON settings file."),
    data_dir: Path | None = typer.Option(None, help="Engine data directory (DCPGW_DATA_DIR, default ./data)."),
    http_port: int | None = typer.Option(None, "--http-port", "--port", help="HTTP API port (DCPGW_HTTP_PORT, "
                                         "default 8091); 0 picks a free one."),
    kv_port: int | None = typer.Option(None, help="KV port for the Couchbase SDKs (DCPGW_KV_PORT, default 11210); "
                                       "0 picks a free one."),
    bucket: str | None = typer.Option(None, help="Bucket name (DCPGW_BUCKET)."),
    num_vbuckets: int | None = typer.Option(None, "--num-vbuckets", "--vbuckets",
                                            help="vbucket count (DCPGW_NUM_VBUCKETS, default 1024)."),
    value_format: str | None = typer.Option(None, help="avro or raw (DCPGW_VALUE_FORMAT)."),
    stream_from: str | None = typer.Option(None, help="saved-offset-or-beginning | saved-offset-or-now | "
                                           "beginning | now."),
    progress: bool = typer.Option(True, help="Show a progress bar while streams catch up."),
    gateways: int | None = typer.Option(None, "--gateways", min=1, max=64,
                                        help="Gateway processes publishing the engine, in one Kafka group "
                                        "(DCPGW_GATEWAYS; docs/scale-out.md). Default: 1."),
    nodes: int | None = typer.Option(None, "--nodes", min=1, help="Engine nodes (DCPGW_CLUSTER_NODES); > 1 runs "
                                     "an in-process cluster behind the gateway. Default: one bucket."),
    replicas: int | None = typer.Option(None, "--replicas", min=0, max=3,
                                        help="Replicas per vbucket in cluster mode (DCPGW_CLUSTER_REPLICAS)."),
    conflict_resolution: str | None = typer.Option(
        None, "--conflict-resolution", help="seqno | lww: the bucket's XDCR conflict resolution, fixed at creation "
        "(DCPGW_CONFLICT_RESOLUTION, default seqno; docs/xdcr.md)."),
    tls_cert: Path | None = typer.Option(None, "--tls-cert", help="PEM certificate chain: serve HTTPS, and TLS "
                                         "on the KV port(s) (couchbases://) (DCPGW_TLS_CERT; with --tls-key)."),
    tls_key: Path | None = typer.Option(None, "--tls-key", help="PEM private key of --tls-cert (DCPGW_TLS_KEY)."),
    tls_ca: Path | None = typer.Option(None, "--tls-ca", help="PEM CA: require client certificates it signed "
                                       "(DCPGW_TLS_CLIENT_CA)."),
) -> None:
    """Run the engine (one bucket, or a local cluster with --nodes), the gateway and the HTTP API until
    Ctrl-C / SIGTERM."""
    from engine.exceptions import DcpGatewayError
    from gateway.broker import select_broker
    from gateway.config import load_settings
    from gateway.exceptions import BrokerError, ConfigError

    overrides = {k: v for k, v in {
        "data_dir": data_dir, "http_port": http_port, "bucket": bucket, "num_vbuckets": num_vbuckets,
        "value_format": value_format, "stream_from": stream_from, "cluster_nodes": nodes,
        "cluster_replicas": replicas, "conflict_resolution": conflict_resolution, "tls_cert": tls_cert,
        "tls_key": tls_key, "tls_client_ca": tls_ca}.items() if v is not None}
    if kv_port is not None:
        overrides["kv_port"] = kv_port
    try:
        settings = load_settings(config, **overrides, **({} if gateways is None else {"gateways": gateways}))
    except ConfigError as e:
        _fail(_one_line(e))
    if replicas is not None and settings.cluster_nodes == 1:
        _fail("--replicas needs --nodes N (N > 1): a single bucket has no replicas")
    if settings.gateways > 1 and settings.cluster_nodes > 1:
        _fail("--gateways > 1 runs with one engine node only (not with --nodes)")
    if settings.gateways > 1 and config is not None:
        os.environ["DCPGW_CONFIG_FILE"] = str(config.resolve())  # the other gateway processes read it too
    # Local problems first, in one line each, before a broker is started (docs/reliability.md).
    _check_data_dir(settings.data_dir)
    _check_port(settings.http_host, settings.http_port)
    # the first node's KV port (with --nodes the others take a free port when theirs is taken: docs/kv-protocol.md)
    _check_port(settings.http_host, settings.kv_port, "kv_port")
    _check_tls(settings)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from engine.exceptions import EngineError
    from engine.kv.data_dir import DataDirLock, check_layout

    # One process per data directory, taken before anything (the broker included) is started; held until exit
    # (docs/reliability.md "Data directory").
    lock = DataDirLock(settings.data_dir)
    try:
        lock.lock()
        check_layout(settings.data_dir, cluster=settings.cluster_nodes > 1)
    except (EngineError, OSError) as e:
        lock.release()
        _fail(str(e))
    brk = None
    try:
        brk = select_broker() if settings.kafka.bootstrap_servers is None else None
        if brk is not None:
            brk.start()
    except BrokerError as e:
        where = getattr(e, "log_path", None)
        _fail(_one_line(e) + (f" (broker log: {where})" if where else ""))
    bootstrap = settings.kafka.bootstrap_servers or (brk.bootstrap_servers if brk else "")
    try:
        asyncio.run(_serve(settings, bootstrap, progress, lock))
    except (DcpGatewayError, OSError) as e:
        _fail(_one_line(e))
    finally:
        if brk is not None:
            brk.stop()
        lock.release()


# ---------------------------------------------------------------------- gateway (a group member)
@app.command("gateway")
def gateway_member(
    source: str = typer.Option(..., "--source", help="HOST:PORT[,...] of running engine node processes "
                               "(python -m engine.network.server): the engine or cluster to stream."),
    group: str = typer.Option(..., "--group", help="Kafka group of the gateway processes sharing its vbuckets "
                              "(docs/scale-out.md)."),
    config: Path | None = typer.Option(None, "--config", "-c", help="TOML or JSON settings file."),
    parent_pid: int | None = typer.Option(None, "--parent-pid", hidden=True),  # dcpgw up --gateways: its children
) -> None:
    """Run one more gateway process of GROUP against a running engine or cluster: the group's assignment on
    the coordination topic decides which vbuckets it streams. Needs KAFKA_BOOTSTRAP_SERVERS (or the kafka
    settings); no HTTP API. Ctrl-C / SIGTERM leave the group (the others take the vbuckets over)."""
    import threading

    from engine.exceptions import DcpGatewayError
    from gateway.config import load_settings
    from gateway.exceptions import ConfigError
    from gateway.member import run_attached_member, watch_parent

    addresses = [a.strip() for a in source.split(",") if a.strip()]
    for a in addresses:
        host, sep, port = a.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            _fail(f"--source: {a!r} is not HOST:PORT")
    if not addresses:
        _fail("--source: no HOST:PORT given")
    if not group.strip():
        _fail("--group: the group name must not be empty")
    try:
        settings = load_settings(config)
    except ConfigError as e:
        _fail(_one_line(e))
    bootstrap = settings.kafka.bootstrap_servers
    if not bootstrap:
        _fail("dcpgw gateway needs a running Kafka: set KAFKA_BOOTSTRAP_SERVERS (or kafka.bootstrap_servers)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if parent_pid is not None:
        watch_parent(parent_pid, stop)
    try:
        run_attached_member(settings, bootstrap, addresses, group.strip(), stop,
                            on_ready=lambda m: typer.echo(f"gateway member of group {group.strip()} ready", err=True))
    except (DcpGatewayError, OSError) as e:
        _fail(_one_line(e))


def _one_line(e: BaseException) -> str:
    """An exception's message on one line (a multi-line message's lines joined with '; ')."""
    lines = [line.strip() for line in str(e).split("\n--- ", 1)[0].splitlines() if line.strip()]
    out = ""
    for line in lines:
        out += line if not out else (f" {line}" if out.endswith(":") else f"; {line}")
    return out or type(e).__name__


def _check_data_dir(path: Path) -> None:
    """The data directory exists (created if missing) and a file can be written in it; else a one-line exit."""
    probe = path / f".dcpgw-write-probe-{os.getpid()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        _fail(f"data directory {path} is not writable: {e.strerror or e}"
              + (f" ({e.filename})" if e.filename and str(e.filename) != str(path) else ""))


def _check_port(host: str, port: int, name: str = "http_port") -> None:
    """The HTTP port can be bound (as aiohttp binds it, SO_REUSEADDR); else a one-line exit. Port 0 always can."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as e:
        _fail(f"cannot listen on {host}:{port} (http_host): {e.strerror or e}")
    for family, kind, proto, _canon, addr in infos[:1]:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(addr)
            except OSError as e:
                why = os.strerror(e.errno) if e.errno else str(e)
                _fail(f"cannot listen on {host}:{port} ({name}): {why}")


def _check_tls(settings: Any) -> None:
    """The TLS certificate, key and client CA load (as the service will load them); else a one-line exit."""
    if settings.tls_cert is None or settings.tls_key is None:
        return
    from engine.exceptions import TlsConfigError
    from engine.security.tls import server_context

    try:
        server_context(settings.tls_cert, settings.tls_key, settings.tls_client_ca)
    except TlsConfigError as e:
        _fail(_one_line(e))


def _announce_admin_password(svc: Any, settings: Any) -> None:
    """First start: the generated password of ``Administrator``, printed once -- also when the start fails after
    the user store was created (it is kept, and no later start prints it)."""
    if svc.generated_admin_password is None:
        return
    from engine.security import ADMIN_PASSWORD_FILE, ADMIN_USER

    typer.echo(f"dcpgw: created user {ADMIN_USER} (role admin) with the generated password "
               f"{svc.generated_admin_password} -- also in {settings.data_dir / ADMIN_PASSWORD_FILE} "
               f"(mode 0600); change it with `dcpgw user passwd {ADMIN_USER}`", err=True)
    svc.generated_admin_password = None


async def _serve(settings: Any, bootstrap: str, progress: bool, lock: DataDirLock | None = None) -> None:
    from engine.kv.durable_file import write_atomically
    from gateway.service import GatewayService

    svc = GatewayService(settings, bootstrap, data_dir_lock=lock)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, svc.request_stop)
    try:
        await svc.start()
    except BaseException as e:
        _announce_admin_password(svc, settings)
        with contextlib.suppress(Exception):
            await svc.stop()  # close what start() opened (engine files, Kafka clients)
        from gateway.exceptions import StartupInterrupted

        if isinstance(e, StartupInterrupted):  # SIGTERM / SIGINT while waiting for Kafka: a normal stop
            typer.echo("dcpgw: stopped during start-up", err=True)
            return
        raise
    http_url = f"{svc.http_scheme}://{settings.http_host}:{svc.http_port}"
    state = {"bootstrap_servers": bootstrap, "http_url": http_url, "topic": svc.topic, "pid": os.getpid(),
             "num_vbuckets": settings.num_vbuckets}
    if settings.tls_cert is not None:  # the CLI trusts it for local use (docs/security.md "CLI")
        state["tls_cert"] = str(settings.tls_cert.resolve())
    _announce_admin_password(svc, settings)  # first start: printed once (also in <data_dir>/admin-password, 0600)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    write_atomically(settings.data_dir / STATE_FILE, json.dumps(state).encode())
    typer.echo(f"dcpgw up: topic {svc.topic} on {bootstrap}; HTTP API {http_url}", err=True)
    if svc.cluster is not None:
        vbmap = svc.cluster.vbucket_map()
        typer.echo(f"cluster: nodes {', '.join(vbmap.nodes)}, {vbmap.num_replicas} replica(s), "
                   f"map revision {vbmap.revision}", err=True)
    typer.echo(f"KAFKA_BOOTSTRAP_SERVERS={bootstrap}", err=True)
    if svc.kv is not None:
        typer.echo(f"KV port {svc.kv.port} (bucket {settings.bucket}): couchbase{'s' if svc.kv.tls else ''}://"
                   f"{settings.http_host}:{svc.kv.port}", err=True)
    if svc.kv_cluster is not None:
        ports = ", ".join(f"{n} {p}" for n, p in svc.kv_cluster.ports.items())
        typer.echo(f"KV ports {ports} (bucket {settings.bucket}): couchbase{'s' if svc.kv_cluster.tls else ''}://"
                   f"{settings.http_host}:{svc.kv_cluster.first}", err=True)
    try:
        if progress and sys.stderr.isatty():
            await _catch_up_progress(svc)
        await svc.run_until_stopped()
    finally:
        typer.echo("dcpgw: stopping (flushing deliveries, clean engine shutdown)", err=True)
        await svc.stop()
        # Only our own state file: never another process's (with the data-directory lock there is none, but
        # a file left by a process killed -9 and read by a newer one must not go either).
        with contextlib.suppress(OSError, ValueError, AttributeError):
            f = settings.data_dir / STATE_FILE
            if json.loads(f.read_text()).get("pid") == os.getpid():
                f.unlink()


async def _catch_up_progress(svc: Any) -> None:
    """A progress bar over the total lag until every stream caught up (backfill)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    pub = svc.publisher

    def lag() -> int:
        return int(pub.lag()[0])

    total = lag()
    if total == 0:
        return
    with Progress(TextColumn("backfill"), BarColumn(), TextColumn("{task.completed}/{task.total} items"),
                  TimeRemainingColumn(), transient=True) as bar:
        task = bar.add_task("backfill", total=total)
        while not svc._stopping.is_set():
            left = lag()
            bar.update(task, completed=max(0, total - left))
            if left == 0:
                return
            await asyncio.sleep(0.2)


# ---------------------------------------------------------------------- load
@app.command()
def load(
    docs: int = typer.Option(10_000, min=1, help="How many documents to write."),
    size: int = typer.Option(256, min=16, help="Approximate JSON document size in bytes."),
    batch: int = typer.Option(1000, min=1, max=100_000, help="Documents per bulk request."),
    prefix: str = typer.Option("doc-", help="Key prefix; keys are PREFIX + the number in 7 digits (doc-0000000, "
                               "doc-0000001, ...: issue 3's keys)."),
    start: int = typer.Option(0, min=0, help="First document number (re-running overwrites)."),
    url: str | None = typer.Option(None, help="Gateway HTTP URL (default: from the running `dcpgw up`)."),
    data_dir: Path = typer.Option(DEFAULT_DATA_DIR, help="Where `dcpgw up` keeps its state file."),
    user: str | None = _USER,
    password: str | None = _PASSWORD,
    cacert: Path | None = _CACERT,
    max_wait: float = typer.Option(300.0, "--max-wait", min=0.0,
                                   help="Seconds one batch may keep being refused with 503 backpressure "
                                        "(retried after each Retry-After) before load gives up."),
) -> None:
    """Write DOCS JSON documents through the HTTP API, with a progress bar.

    A batch the gateway refuses with 503 and Retry-After (write backpressure: Kafka is behind) is sent again
    after the delay, until --max-wait seconds have passed for that batch."""
    from rich.progress import Progress

    base = _connect(url, data_dir, user, password, cacert)
    pad = "x" * max(0, size - 48)
    written = 0
    failed: list[dict[str, Any]] = []  # entries the engine refused for good (not retryable)

    def stopped(why: str, code: int, refused: bool = False) -> NoReturn:
        # refused: the gateway answered the batch with a 4xx -- nothing of it was written
        after = ("the refused batch was not written" if refused else
                 "a batch in flight may or may not have been written")
        typer.echo(f"error: {why}: {written} of {docs} documents acknowledged ({after}; re-running with "
                   f"--start {start} overwrites)", err=True)
        raise typer.Exit(code)

    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        with Progress(transient=not sys.stderr.isatty()) as bar:
            task = bar.add_task("load", total=docs)
            for lo in range(start, start + docs, batch):
                hi = min(lo + batch, start + docs)
                entries = [{"key": f"{prefix}{i:07d}", "value": {"n": i, "pad": pad}} for i in range(lo, hi)]
                first_refusal: float | None = None
                while entries:
                    res = _post_with_backpressure(f"{base}/docs/_bulk", json.dumps(entries).encode(), max_wait,
                                                  bar, task)
                    written += int(res["written"])
                    # entries refused alone (docs/gateway.md "_bulk"): a node down or a vbucket on the move is
                    # retried (503 class) until --max-wait; any other refusal is reported at the end
                    retry: list[dict[str, Any]] = []
                    for entry, item in zip(entries, res.get("items", []), strict=False):
                        if item.get("status", 200) < 300:
                            continue
                        # 503, or NOT_MY_VBUCKET (404 not_my_vbucket: the vbucket moved by a rebalance or
                        # failover between routing and writing, docs/cluster.md): the entry alone is retried
                        again = item["status"] == 503 or item.get("error") == "not_my_vbucket"
                        (retry if again else failed).append(entry if again else item)
                    entries = retry
                    if entries:
                        now = time.monotonic()
                        first_refusal = first_refusal or now
                        if now - first_refusal > max_wait:
                            raise _RequestFailed(f"{len(entries)} entries still refused after {max_wait:g}s "
                                                 f"(--max-wait)")
                        bar.update(task, description=f"load (retrying {len(entries)} refused entries)")
                        time.sleep(0.2)
                bar.update(task, advance=hi - lo, description="load")
    except KeyboardInterrupt:
        stopped("interrupted (SIGINT)", 130)
    except _Terminated:
        stopped("terminated (SIGTERM)", 143)
    except _RequestFailed as e:
        # nothing acknowledged: the gateway could not be used at all (exit 2, as for every start-up error)
        stopped(str(e), 1 if written else 2, refused=e.status is not None and 400 <= e.status < 500)
    finally:
        signal.signal(signal.SIGTERM, previous)
    if failed:
        f = failed[0]
        typer.echo(f"error: wrote {written} documents; {len(failed)} refused (first: {f.get('key')}: "
                   f"{f.get('status')} {f.get('error')}: {f.get('message')})", err=True)
        raise typer.Exit(1)
    typer.echo(f"wrote {written} documents")


def _post_with_backpressure(url: str, body: bytes, max_wait: float, bar: Any, task: Any) -> Any:
    """POST ``body``; while the gateway answers 503 with ``Retry-After`` (nothing written), send it again
    after the delay. :class:`_RequestFailed` (one line) once ``max_wait`` seconds have passed since the
    first refusal, or on any other failure."""
    first: float | None = None
    while True:
        try:
            return _request("POST", url, body)
        except _RetryLater as e:
            now = time.monotonic()
            if first is None:
                first = now
            left = first + max_wait - now
            if left <= 0:
                raise _RequestFailed(f"gave up after {max_wait:g}s of 503 backpressure answers "
                                     f"(--max-wait); last: {e}") from e
            delay = min(max(e.retry_after, 0.05), left)
            bar.update(task, description=f"load (backpressure: retrying in {delay:g}s)")
            time.sleep(delay)


# ---------------------------------------------------------------------- status
@app.command()
def status(
    url: str | None = typer.Option(None, help="Gateway HTTP URL (default: from the running `dcpgw up`)."),
    data_dir: Path = typer.Option(DEFAULT_DATA_DIR, help="Where `dcpgw up` keeps its state file."),
    user: str | None = _USER,
    password: str | None = _PASSWORD,
    cacert: Path | None = _CACERT,
    top: int = typer.Option(10, min=0, help="Show the N vbuckets that lag most."),
    as_json: bool = typer.Option(False, "--json", help="Print raw JSON."),
) -> None:
    """Show the running gateway's stats and its most lagging vbuckets."""
    from rich.console import Console
    from rich.table import Table

    base = _connect(url, data_dir, user, password, cacert)
    ready = _readiness(base)
    stats = _http("GET", f"{base}/stats")
    streams = _http("GET", f"{base}/streams")
    if as_json:
        typer.echo(json.dumps({"ready": ready, "stats": stats, "streams": streams}))
        return
    con = Console()
    t = Table(title=f"dcpgw {base}")
    t.add_column("stat")
    t.add_column("value", justify="right")
    t.add_row("ready", "yes" if ready.get("status") == "ok" else f"no ({ready.get('status')})")
    for reason in ready.get("reasons", []):
        t.add_row("  not ready because", str(reason))
    for k, v in stats.items():
        t.add_row(k, str(v))
    con.print(t)
    if top:
        worst = sorted(streams, key=lambda s: -s["lag"])[:top]
        vt = Table(title=f"top {top} lagging vbuckets")
        for col in ("vbucket", "partition", "engine_high_seqno", "published_seqno", "acknowledged_seqno", "lag"):
            vt.add_column(col, justify="right")
        for s in worst:
            vt.add_row(*(str(s[c]) for c in ("vbucket", "partition", "engine_high_seqno", "published_seqno",
                                              "acknowledged_seqno", "lag")))
        con.print(vt)


# ---------------------------------------------------------------------- cluster
cluster_app = typer.Typer(help="The running gateway's cluster: status, vbucket map, failover, recover, rebalance.",
                          no_args_is_help=True)
app.add_typer(cluster_app, name="cluster")

from gateway.xdcr_cli import xdcr_app  # noqa: E402 -- dcpgw xdcr (docs/xdcr.md)

app.add_typer(xdcr_app, name="xdcr")

_URL = typer.Option(None, help="Gateway HTTP URL (default: from the running `dcpgw up`).")
_DATA_DIR = typer.Option(DEFAULT_DATA_DIR, help="Where `dcpgw up` keeps its state file.")


@cluster_app.command("status")
def cluster_status(
    url: str | None = _URL,
    data_dir: Path = _DATA_DIR,
    user: str | None = _USER,
    password: str | None = _PASSWORD,
    cacert: Path | None = _CACERT,
    as_json: bool = typer.Option(False, "--json", help="Print raw JSON."),
) -> None:
    """Nodes (up / down / failed over), their active and replica vbucket counts, the map revision."""
    from rich.console import Console
    from rich.table import Table

    base = _connect(url, data_dir, user, password, cacert)
    st = _http("GET", f"{base}/cluster")
    if as_json:
        typer.echo(json.dumps(st))
        return
    t = Table(title=f"cluster: map revision {st['revision']}, {st['num_vbuckets']} vbuckets, "
                    f"{st['replicas']} replica(s)")
    for col in ("node", "status", "active vbuckets", "replica vbuckets"):
        t.add_column(col, justify="left" if col in ("node", "status") else "right")
    for n in st["nodes"]:
        t.add_row(n["name"], n["status"], str(n["active_vbuckets"]), str(n["replica_vbuckets"]))
    con = Console()
    con.print(t)
    gw = st.get("gateway", {})
    con.print(f"gateway: {gw.get('following_map')}/{st['num_vbuckets']} vbuckets streaming from their active, "
              f"{gw.get('restreams')} re-streams, {gw.get('rollbacks')} rollbacks, "
              f"mitigation {'on' if gw.get('rollback_mitigation') else 'off'}")
    if st["vbuckets_without_active"]:
        con.print(f"[red]vbuckets without an active copy: {st['vbuckets_without_active']}[/red]")


@cluster_app.command("map")
def cluster_map(
    url: str | None = _URL,
    data_dir: Path = _DATA_DIR,
    user: str | None = _USER,
    password: str | None = _PASSWORD,
    cacert: Path | None = _CACERT,
    as_json: bool = typer.Option(False, "--json", help="Print raw JSON."),
) -> None:
    """The vbucket map: every vbucket's chain (active first, then replicas; - is an empty slot)."""
    base = _connect(url, data_dir, user, password, cacert)
    m = _http("GET", f"{base}/cluster/map")
    if as_json:
        typer.echo(json.dumps(m))
        return
    typer.echo(f"revision {m['revision']}, nodes {', '.join(m['nodes'])}")
    for vb, chain in enumerate(m["chains"]):
        typer.echo(f"{vb:>5} " + " ".join(n or "-" for n in chain))


@cluster_app.command("failover")
def cluster_failover(
    node: str = typer.Argument(..., help="The node to fail over (e.g. n1)."),
    graceful: bool = typer.Option(False, "--graceful", help="Catch the replicas up first (no data loss, "
                                  "no rollback); the node must be up."),
    url: str | None = _URL,
    data_dir: Path = _DATA_DIR,
    user: str | None = _USER,
    password: str | None = _PASSWORD,
    cacert: Path | None = _CACERT,
    timeout: float = typer.Option(120.0, help="Seconds to wait for the gateway to follow the new map."),
) -> None:
    """Fail NODE over (hard by default) and show the gateway re-streaming its vbuckets from the new actives."""
    base = _connect(url, data_dir, user, password, cacert)
    kind = "graceful" if graceful else "hard"
    with _cluster_progress() as bar:
        before = _http("GET", f"{base}/cluster")
        task = bar.add_task(f"{kind} failover of {node}", total=None)
        report = _http("POST", f"{base}/cluster/failover",
                       json.dumps({"node": node, "graceful": graceful}).encode(), timeout=timeout)
        bar.update(task, total=1, completed=1,
                   description=f"{kind} failover of {node}: {len(report['promoted'])} vbuckets promoted, "
                               f"map revision {report['revision']}")
        total = int(before["num_vbuckets"]) - len(report["lost"])
        follow = bar.add_task("gateway re-streaming from the new actives", total=total)
        deadline = time.monotonic() + timeout
        st = _wait_following(bar, follow, base, total, deadline, timeout)
        rollbacks = int(st["gateway"]["rollbacks"]) - int(before["gateway"]["rollbacks"])
    new_branches = sum(1 for e in report["entries"].values() if e is not None)
    typer.echo(json.dumps({"node": node, "graceful": graceful, "revision": report["revision"],
                           "promoted": len(report["promoted"]), "new_branches": new_branches,
                           "lost": report["lost"], "gateway_rollbacks": rollbacks}))


@contextlib.contextmanager
def _cluster_progress() -> Iterator[Any]:
    """The progress bars of a failover / rebalance on stderr; kept when the command ends well, erased when it
    fails (its error is then one line, with no half-drawn bar left next to it)."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn

    bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                   TextColumn("{task.completed}/{task.total}"), console=Console(stderr=True), transient=False)
    with bar:
        try:
            yield bar
        except BaseException:
            bar.live.transient = True
            raise


def _wait_following(bar: Any, task: Any, base: str, total: int, deadline: float, timeout: float) -> dict[str, Any]:
    """Poll ``GET /cluster`` until the gateway streams ``total`` vbuckets from their mapped active (progress on
    ``task``); the last status. Exits with a message at ``deadline``."""
    while True:
        st = _http("GET", f"{base}/cluster")
        done = int(st["gateway"]["following_map"])
        bar.update(task, completed=min(done, total))
        if done >= total:
            return dict(st)
        if time.monotonic() > deadline:
            _fail(f"the gateway follows the map for only {done}/{total} vbuckets after {timeout:.0f}s")
        time.sleep(0.2)


@cluster_app.command("recover")
def cluster_recover(
    node: str = typer.Argument(..., help="The failed-over node to bring back (e.g. n1)."),
    delta: bool = typer.Option(False, "--delta", help="Keep its data: only what differs from the actives is "
                               "rolled back (after the rollback repair) and streamed. The default."),
    full: bool = typer.Option(False, "--full", help="Wipe its data and stream every copy from zero."),
    url: str | None = _URL,
    data_dir: Path = _DATA_DIR,
    user: str | None = _USER,
    password: str | None = _PASSWORD,
    cacert: Path | None = _CACERT,
    timeout: float = typer.Option(120.0, help="Seconds to wait for the answer."),
) -> None:
    """Recover failed-over NODE (ns_server's delta / full recovery, docs/cluster.md "Delta recovery"); prints
    the recovery report as one JSON line. Run ``dcpgw cluster rebalance`` afterwards to restore the map's
    balance (the recovered node holds no active copy until then)."""
    if delta and full:
        _fail("--delta and --full exclude each other")
    mode = "full" if full else "delta"
    base = _connect(url, data_dir, user, password, cacert)
    report = _http("POST", f"{base}/cluster/recover", json.dumps({"node": node, "mode": mode}).encode(),
                   timeout=timeout)
    if report.get("message"):
        typer.echo(report["message"], err=True)
    typer.echo(json.dumps(report))


@cluster_app.command("rebalance")
def cluster_rebalance(
    add: list[str] = typer.Option([], "--add", help="A node to rebalance in (repeat for several)."),
    remove: list[str] = typer.Option([], "--remove", help="A node to rebalance out (repeat for several)."),
    url: str | None = _URL,
    data_dir: Path = _DATA_DIR,
    user: str | None = _USER,
    password: str | None = _PASSWORD,
    cacert: Path | None = _CACERT,
    timeout: float = typer.Option(600.0, help="Seconds to wait for the rebalance and the gateway to follow."),
) -> None:
    """Rebalance nodes in / out (vbuckets move by DCP takeover while writes continue); progress bars for the
    vbuckets moved and the gateway following the new map. Prints one JSON line at the end."""
    base = _connect(url, data_dir, user, password, cacert)
    before = _http("GET", f"{base}/cluster")
    with _cluster_progress() as bar:
        p = _http("POST", f"{base}/cluster/rebalance", json.dumps({"add": add, "remove": remove}).encode())
        what = " ".join([*(f"+{n}" for n in add), *(f"-{n}" for n in remove)]) or "(same nodes)"
        task = bar.add_task(f"rebalance {what}", total=max(int(p["total"]), 1))
        deadline = time.monotonic() + timeout
        while p["status"] == "running":
            if time.monotonic() > deadline:
                _fail(f"the rebalance moved {p['moved']}/{p['total']} vbuckets in {timeout:.0f}s (still running)")
            time.sleep(0.1)
            p = _http("GET", f"{base}/cluster/rebalance")
            bar.update(task, completed=int(p["moved"]),
                       description=f"rebalance {what}: {len(p['moving'])} moving, {p['items_left']} items left")
        if p["status"] != "done":
            _fail(f"rebalance {p['status']}: {p['error']}")
        bar.update(task, completed=max(int(p["total"]), 1), description=f"rebalance {what}: done")
        total = int(before["num_vbuckets"]) - len(before["vbuckets_without_active"])
        follow = bar.add_task("gateway streaming from the new actives", total=total)
        st = _wait_following(bar, follow, base, total, deadline, timeout)
    typer.echo(json.dumps({"status": p["status"], "moved": p["moved"], "total": p["total"],
                           "revision": p["revision"], "nodes": p["nodes"], "reverts": p["reverts"],
                           "gateway_rollbacks": int(st["gateway"]["rollbacks"]) - int(before["gateway"]["rollbacks"])}))


# ---------------------------------------------------------------------- users
user_app = typer.Typer(help="The users of the data directory (users.json): add, list, delete, passwd. The running "
                            "gateway sees a change at its next request (docs/security.md).", no_args_is_help=True)
app.add_typer(user_app, name="user")

_USERS_DATA_DIR = typer.Option(DEFAULT_DATA_DIR, "--data-dir", help="The data directory holding users.json.")


def _user_store(data_dir: Path, *, create: bool = False) -> Any:
    """The user store of ``data_dir``; only ``create`` (``user add``) makes a data directory that is missing -- a
    mistyped --data-dir of list / delete / passwd is an error, not an empty new store."""
    from engine.exceptions import InvalidArgument
    from engine.security import UserStore

    if data_dir.exists() and not data_dir.is_dir():
        _fail(f"data directory {data_dir} is not a directory")
    if not create and not data_dir.exists():
        _fail(f"data directory {data_dir} does not exist (`dcpgw up` or `dcpgw user add` creates it)")
    try:
        return UserStore.open(data_dir)
    except (InvalidArgument, OSError) as e:
        _fail(str(e))


def _user_call(fn: Any, *args: Any) -> Any:
    from engine.exceptions import InvalidArgument

    try:
        return fn(*args)
    except (InvalidArgument, OSError) as e:
        _fail(str(e))


@user_app.command("add")
def user_add(
    name: str = typer.Argument(..., help="The user name."),
    password: str = typer.Option(..., "--password", help="Its password."),
    role: list[str] = typer.Option(..., "--role", help="A role: admin, data_writer, data_reader, dcp_reader, "
                                   "replication_target (repeat for several)."),
    data_dir: Path = _USERS_DATA_DIR,
) -> None:
    """Add user NAME with its password and roles."""
    from engine.security import parse_role

    roles = [_user_call(parse_role, r) for r in role]
    u = _user_call(_user_store(data_dir, create=True).add, name, password, roles)
    typer.echo(f"added user {u.name} ({', '.join(sorted(r.value for r in u.roles))})")


@user_app.command("list")
def user_list(
    data_dir: Path = _USERS_DATA_DIR,
    as_json: bool = typer.Option(False, "--json", help="Print raw JSON."),
) -> None:
    """List the users and their roles (never a password)."""
    users = _user_call(_user_store(data_dir).list)
    rows = [{"name": u.name, "roles": sorted(r.value for r in u.roles)} for u in users]
    if as_json:
        typer.echo(json.dumps(rows))
        return
    for r in rows:
        typer.echo(f"{r['name']}\t{','.join(r['roles'])}")


@user_app.command("delete")
def user_delete(
    name: str = typer.Argument(..., help="The user name."),
    data_dir: Path = _USERS_DATA_DIR,
) -> None:
    """Delete user NAME (its bearer tokens stop working)."""
    _user_call(_user_store(data_dir).delete, name)
    typer.echo(f"deleted user {name}")


@user_app.command("passwd")
def user_passwd(
    name: str = typer.Argument(..., help="The user name."),
    password: str = typer.Option(..., "--password", help="The new password."),
    data_dir: Path = _USERS_DATA_DIR,
) -> None:
    """Set the password of user NAME (its bearer tokens stop working)."""
    _user_call(_user_store(data_dir).passwd, name, password)
    typer.echo(f"changed the password of user {name}")


# ---------------------------------------------------------------------- replicate
@app.command()
def replicate(
    topic: str | None = typer.Option(None, help="Topic to replicate (default: the running gateway's)."),
    db: Path = typer.Option(Path("replica.sqlite"), help="SQLite file: table docs + consumer state."),
    bootstrap: str | None = typer.Option(None, envvar="KAFKA_BOOTSTRAP_SERVERS",
                                         help="Kafka bootstrap servers (default: the running gateway's)."),
    data_dir: Path = typer.Option(DEFAULT_DATA_DIR, help="Where `dcpgw up` keeps its state file."),
    group_id: str | None = typer.Option(None, "--group", help="Consumer group (default: manual assignment)."),
    until_caught_up: bool = typer.Option(False, "--until-caught-up",
                                         help="Stop once every partition is consumed to its end."),
) -> None:
    """Keep the SQLite table `docs` of DB equal to the bucket streamed into TOPIC (rollback-aware)."""
    import sqlite3

    from connectors.exceptions import ConnectorError
    from connectors.replicate import Replicator

    st = _state(data_dir)
    bootstrap = bootstrap or st.get("bootstrap_servers")
    topic = topic or st.get("topic")
    if not bootstrap or not topic:
        _fail("no running gateway found: pass --bootstrap and --topic (or set KAFKA_BOOTSTRAP_SERVERS)")
    kafka = _kafka_client(bootstrap)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        with Replicator(kafka, topic, db, group_id=group_id) as rep:
            with contextlib.suppress(KeyboardInterrupt):
                # a corrupt record: copied to the dead-letter topic once, counted, passed over (docs/client.md)
                rep.run(until_caught_up=until_caught_up, skip_corrupt=True)
            n = rep.conn.execute("SELECT COUNT(*) FROM docs").fetchone()[0]
            typer.echo(json.dumps({"topic": topic, "db": str(db), "docs": n, "snapshots": rep.snapshots,
                                   "changes": rep.changes, "rollbacks": len(rep.rollbacks),
                                   "oversize": len(rep.oversize), "dead_letters": rep.dead_letters}))
    except ConnectorError as e:
        _fail(str(e))
    except (sqlite3.Error, OSError) as e:
        _fail(f"replica database {db}: {e}")


# ---------------------------------------------------------------------- index
@app.command()
def index(
    ctx: typer.Context,
    topic: str | None = typer.Option(None, help="Topic to index (default: the running gateway's)."),
    index_dir: Path = typer.Option(Path("search-index"), help="Directory of the index and its document store."),
    http_port: int = typer.Option(8090, min=0, max=65535, help="Port of the query API (0 picks a free one)."),
    http_host: str = typer.Option("127.0.0.1", help="Address of the query API."),
    bootstrap: str | None = typer.Option(None, envvar="KAFKA_BOOTSTRAP_SERVERS",
                                         help="Kafka bootstrap servers (default: the running gateway's)."),
    mapping: Path | None = typer.Option(None, help="Mapping file, JSON or TOML (default: dynamic)."),
    until_caught_up: bool = typer.Option(False, "--until-caught-up",
                                         help="Stop once every partition is indexed to its end."),
    source_url: str | None = typer.Option(None, envvar="DCPGW_SOURCE_URL",
                                          help="The gateway's HTTP API, for request_plus / at_plus (default: the "
                                               "running gateway's)."),
    user: str | None = typer.Option(None, envvar="DCPGW_USER", help="HTTP Basic user for --source-url."),
    password: str | None = typer.Option(None, envvar="DCPGW_PASSWORD", help="HTTP Basic password."),
    commit_interval: float = typer.Option(1.0, min=0.0, help="Seconds between index commits under load."),
    commit_docs: int = typer.Option(20_000, min=1, help="Changed documents that trigger an index commit."),
    data_dir: Path = typer.Option(DEFAULT_DATA_DIR, help="Where `dcpgw up` keeps its state file."),
    backend: str = typer.Option("tantivy", help="tantivy (an index in INDEX_DIR), elasticsearch or opensearch "
                                                "(--es-url)."),
    es_url: str | None = typer.Option(None, envvar="DCPGW_ES_URL",
                                      help="Elasticsearch / OpenSearch URL (--backend elasticsearch|opensearch)."),
    es_index: str | None = typer.Option(None, help="Index name (default: the topic's, docs/search.md)."),
    es_routing: str = typer.Option("key", help="key (by _id) or vbucket (routing=<vbucket>)."),
    es_batch_docs: int = typer.Option(1000, min=1, help="Operations per bulk request at most."),
    es_batch_bytes: int = typer.Option(5 << 20, min=1, help="Bytes per bulk request at most (about)."),
    es_batch_ms: int = typer.Option(1000, min=1, help="Milliseconds an operation waits before a bulk."),
    es_max_retries: int = typer.Option(3, min=0,
                                       help="Retries of a request the cluster refused (429/5xx/no connection) "
                                            "before the indexer backs off and tries again later."),
) -> None:
    """Index TOPIC into a search index, exact after rollbacks -- a tantivy index in INDEX_DIR (the default) or an
    Elasticsearch / OpenSearch index (--backend, --es-url; INDEX_DIR then holds the document store) -- and answer
    search queries on HTTP_PORT: GET/POST /search with consistency not_bounded / at_plus / request_plus, /status,
    /metrics."""
    import sqlite3

    from connectors.exceptions import ConnectorError
    from connectors.search.consistency import GatewaySource
    from connectors.search.indexer import SearchIndexer
    from connectors.search.mapping import DocumentMapping
    from connectors.search.server import serve

    try:
        doc_mapping = DocumentMapping.load(mapping)
    except ConnectorError as e:
        _fail(str(e))
    if backend not in ("tantivy", "elasticsearch", "opensearch"):
        _fail(f"--backend {backend!r}: must be tantivy, elasticsearch or opensearch")
    es_settings = None
    if backend == "tantivy":  # the --es-* options configure a search cluster: never ignored silently
        es_given = [f"--{name.replace('_', '-')}" for name in (
            "es_url", "es_index", "es_routing", "es_batch_docs", "es_batch_bytes", "es_batch_ms", "es_max_retries")
            if getattr(ctx.get_parameter_source(name), "name", None) == "COMMANDLINE"]  # not DCPGW_ES_URL
        if es_given:
            _fail(f"{', '.join(es_given)}: only with --backend elasticsearch or opensearch (the backend is tantivy)")
    if backend in ("elasticsearch", "opensearch"):
        from connectors.search.elastic import ElasticsearchSettings

        if not es_url:
            _fail(f"--backend {backend} needs --es-url URL (or DCPGW_ES_URL)")
        try:
            es_settings = ElasticsearchSettings(
                es_url, flavor=backend, index=es_index, routing=es_routing,  # type: ignore[arg-type]
                batch_docs=es_batch_docs, batch_bytes=es_batch_bytes, batch_ms=es_batch_ms,
                max_retries=es_max_retries)
        except ConnectorError as e:
            _fail(str(e))
    st = _state(data_dir)
    bootstrap = bootstrap or st.get("bootstrap_servers")
    topic = topic or st.get("topic")
    if not bootstrap or not topic:
        _fail("no running gateway found: pass --bootstrap and --topic (or set KAFKA_BOOTSTRAP_SERVERS)")
    source_url = source_url or st.get("http_url")
    if source_url:
        user, password, _source = _credentials(data_dir, user, password)  # as every command of the HTTP API
    try:  # a port in use fails here, before the index is opened
        socket.create_server((http_host, http_port)).close()
    except OSError as e:
        _fail(f"cannot listen on {http_host}:{http_port}: {e.strerror or e}")
    kafka = _kafka_client(bootstrap)

    index_backend: Any = None
    if es_settings is not None:
        from connectors.search.elastic import ElasticsearchBackend

        index_dir.mkdir(parents=True, exist_ok=True)
        index_backend = ElasticsearchBackend(es_settings, index_dir, topic=topic)

    async def main() -> dict[str, Any]:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def stopping() -> None:
            stop.set()
            if index_backend is not None:
                index_backend.stop.set()  # a bulk being retried gives up (nothing is checkpointed)

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stopping)
        src = GatewaySource(source_url, user, password) if source_url else None
        with SearchIndexer(kafka, topic, index_dir, mapping=doc_mapping, commit_docs=commit_docs,
                           commit_interval=commit_interval, backend=index_backend) as ix:
            return await serve(ix, host=http_host, port=http_port, source=src, until_caught_up=until_caught_up,
                               stop=stop, on_listening=lambda p: typer.echo(
                                   f"search API on http://{http_host}:{p} (index {index_dir})", err=True))

    try:
        typer.echo(json.dumps(asyncio.run(main())))
    except ConnectorError as e:
        _fail(str(e))
    except (sqlite3.Error, OSError, ValueError) as e:
        _fail(f"search index {index_dir}: {e}")
    finally:
        if index_backend is not None:
            index_backend.close()


# ---------------------------------------------------------------------- tail
@app.command()
def tail(
    vbucket: int = typer.Argument(..., help="The vbucket whose records to print."),
    topic: str | None = typer.Option(None, help="Topic (default: the running gateway's)."),
    bootstrap: str | None = typer.Option(None, envvar="KAFKA_BOOTSTRAP_SERVERS",
                                         help="Kafka bootstrap servers (default: the running gateway's)."),
    data_dir: Path = typer.Option(DEFAULT_DATA_DIR, help="Where `dcpgw up` keeps its state file."),
    max_records: int = typer.Option(0, "--max", min=0, help="Stop after N records (0 = no limit)."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep waiting for new records."),
) -> None:
    """Print the decoded records of VBUCKET's partition, from the beginning."""
    from confluent_kafka import KafkaError, KafkaException, TopicPartition

    from gateway.exceptions import RecordFormatError
    from gateway.kafka import consumer
    from gateway.resume import READ_TO_END_FETCH_WAIT_MS
    from schemas.codec import decode
    from schemas.topics import partition_for

    st = _state(data_dir)
    bootstrap = bootstrap or st.get("bootstrap_servers")
    topic = topic or st.get("topic")
    if not bootstrap or not topic:
        _fail("no running gateway found: pass --bootstrap and --topic (or set KAFKA_BOOTSTRAP_SERVERS)")
    if vbucket < 0:
        _fail(f"vbucket {vbucket} is negative")
    c = consumer(_kafka_client(bootstrap), {"enable.auto.commit": False, "enable.partition.eof": True,
                                            "fetch.wait.max.ms": READ_TO_END_FETCH_WAIT_MS},
                 group_id=f"dcpgw-tail-{os.getpid()}")
    try:
        try:
            md = c.list_topics(topic, timeout=10)
        except KafkaException as e:
            _fail(f"cannot read topic {topic!r} on {bootstrap}: {e.args[0].str() if e.args else e}")
        t = md.topics.get(topic)
        if t is None or t.error is not None or not t.partitions:
            _fail(f"topic {topic!r} not found on {bootstrap}")
        # The bucket's vbucket count when this is the running gateway's topic, else the partition count
        # (a vbucket v is in partition v mod partitions; records name their vbucket).
        nvb = int(st["num_vbuckets"]) if topic == st.get("topic") and "num_vbuckets" in st else len(t.partitions)
        if vbucket >= nvb:
            what = "vbuckets" if nvb != len(t.partitions) or "num_vbuckets" in st else "partitions"
            _fail(f"vbucket {vbucket} does not exist: topic {topic!r} has {nvb} {what} (0..{nvb - 1})")
        part = partition_for(vbucket, len(t.partitions))
        c.assign([TopicPartition(topic, part, 0)])
        n = 0
        while True:
            m = c.poll(1.0)
            if m is None:
                continue
            kerr = m.error()
            if kerr is not None:
                if kerr.code() == KafkaError._PARTITION_EOF:
                    if follow:
                        continue
                    break
                _fail(str(kerr))
            offset = m.offset() or 0
            try:
                r = decode(m.key(), m.value(), m.headers())
            except RecordFormatError as e:
                typer.echo(f"{offset:>8} <undecodable record: {e}>")
                continue
            if r.vbucket != vbucket:
                continue
            typer.echo(_describe(offset, r))
            n += 1
            if max_records and n >= max_records:
                break
    finally:
        c.close()


def _describe(offset: int, r: Any) -> str:
    head = f"{offset:>8} {r.type.value:<12} vb={r.vbucket} seqno={r.seqno} vbuuid={r.vbuuid}"
    if r.is_data:
        val = r.value if r.value is None else r.value[:80].decode("utf-8", "replace")
        return f"{head} snap=[{r.snap_start},{r.snap_end}] key={r.key!r} rev={r.rev_seqno} value={val}"
    if r.type.value == "snapshot":
        return f"{head} range=[{r.snap_start},{r.snap_end}] flags={r.snapshot_flags}"
    if r.failover_log is not None:
        return f"{head} failover_log={[(e.vbuuid, e.seqno) for e in r.failover_log]}"
    return head


# ---------------------------------------------------------------------- entry point
def main(args: list[str] | None = None) -> NoReturn:
    """The ``dcpgw`` console script (pyproject.toml): ``app`` with command-line usage errors (a bad option
    value, an unknown option or command, a missing argument) as **one** ``error:`` line on stderr and exit
    status 2 instead of click's / rich's multi-line box (docs/reliability.md "Start-up failures and
    command-line errors"). ``dcpgw`` without arguments and ``--help`` still print the help."""
    try:  # typer >= 0.2x carries its own copy of click
        from typer._click import exceptions as click_errors
    except ImportError:  # pragma: no cover - older typer on click
        from click import exceptions as click_errors  # type: ignore[no-redef]

    command = typer.main.get_command(app)
    try:
        rv = command.main(args=args, prog_name="dcpgw", standalone_mode=False)
    except click_errors.NoArgsIsHelpError as e:
        text = e.format_message()  # rich printed the help already (text is then empty)
        if text.strip():
            typer.echo(text)
        sys.exit(e.exit_code)
    except click_errors.UsageError as e:
        where = e.ctx.command_path if e.ctx is not None else "dcpgw"
        message = " ".join(e.format_message().split())
        typer.echo(f"error: {where}: {message} (see `{where} --help`)", err=True)
        sys.exit(2)
    except click_errors.ClickException as e:
        typer.echo(f"error: {' '.join(e.format_message().split())}", err=True)
        sys.exit(e.exit_code)
    except typer.Abort:
        typer.echo("error: aborted", err=True)
        sys.exit(1)
    # standalone_mode=False: typer.Exit(code) comes back as its code, a command's normal end as None
    sys.exit(rv if isinstance(rv, int) else 0)


if __name__ == "__main__":
    main()
