"""``dcpgw up --kv-port`` (docs/kv-protocol.md "The port"): a port in use or out of range is one line and a
non-zero exit before anything starts."""

from __future__ import annotations

import socket
from pathlib import Path

from tests.gateway.test_cli_errors import dcpgw, one_error_line


def test_kv_port_in_use(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = dcpgw("up", "--no-progress", "--data-dir", str(tmp_path / "d"), "--http-port", "0",
                    "--kv-port", str(port), KAFKA_BOOTSTRAP_SERVERS="127.0.0.1:1")
    line = one_error_line(res)
    assert f"127.0.0.1:{port} (kv_port)" in line and "in use" in line, line


def test_kv_port_in_use_with_nodes_fails_before_the_embedded_broker_starts(tmp_path: Path) -> None:
    """With ``--nodes`` the first node's KV port is ``--kv-port``: taken, it is one line before anything (the
    embedded broker included) is started."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = dcpgw("up", "--no-progress", "--data-dir", str(tmp_path / "d"), "--http-port", "0",
                    "--nodes", "3", "--replicas", "1", "--kv-port", str(port))
    line = one_error_line(res)  # no broker log line before it
    assert f"127.0.0.1:{port} (kv_port)" in line and "in use" in line, line
    assert not (tmp_path / "d" / "cluster").exists()


def test_kv_port_out_of_range(tmp_path: Path) -> None:
    res = dcpgw("up", "--no-progress", "--data-dir", str(tmp_path / "d"), DCPGW_KV_PORT="70000")
    line = one_error_line(res)
    assert "kv_port" in line and "DCPGW_KV_PORT" in line, line


def test_kv_port_default_is_11210() -> None:
    from gateway.config import GatewaySettings

    assert GatewaySettings.model_fields["kv_port"].default == 11210
