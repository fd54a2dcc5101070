"""The ``dcpgw`` command line, run as a real process."""

from __future__ import annotations

import os
import signal
import time

from confluent_kafka.admin import AdminClient
from typer.testing import CliRunner

from gateway import __version__
from gateway.cli import app
from tests.gateway.processes import dcpgw_background


def test_version_prints_the_package_version() -> None:
    result = CliRunner().invoke(app, ["version"])
    assert result.exit_code == 0
    assert result.stdout.strip() == __version__


def test_broker_command_serves_until_interrupted() -> None:
    proc = dcpgw_background("broker", env=os.environ)
    try:
        assert proc.stdout is not None
        bootstrap = pid = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and bootstrap is None:
            line = proc.stdout.readline()
            if not line:
                break
            if line.startswith("embedded Tansu broker (pid "):
                pid = int(line.split("pid ", 1)[1].split(")", 1)[0])
            if line.startswith("KAFKA_BOOTSTRAP_SERVERS="):
                bootstrap = line.strip().split("=", 1)[1]
        assert bootstrap is not None and pid is not None, proc.stderr.read() if proc.stderr else ""
        metadata = AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=10)
        assert metadata.brokers

        proc.send_signal(signal.SIGINT)  # Ctrl-C
        assert proc.wait(timeout=30) == 0
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            pass
        else:
            raise AssertionError(f"broker pid {pid} still alive after dcpgw broker exited")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
