"""``dcpgw up --gateways K`` (docs/scale-out.md "dcpgw up --gateways"): the ``up`` process hosts the engine and
K gateway processes publish it, as one group.

* the engine stays in the ``up`` process (the HTTP API and the KV port write into it as always) and is also
  served over the memcached binary protocol by a :class:`~engine.network.server.NodeServer` on the same event
  loop, on a loopback port -- the members' DCP connections come in there;
* the ``up`` process publishes nothing itself and is no member of the group: K child processes ``dcpgw gateway
  --source 127.0.0.1:PORT --group dcpgw-<topic>`` are the group's members, with the same settings (the parent's
  environment, its config file, and the settings given on the command line as ``DCPGW_*`` variables), each with
  the delivery budget and the in-process delivery recovery of any ``dcpgw gateway`` (gateway/member.py);
* a child that exits while the ``up`` process runs (killed, fenced, failed) is started again, after a pause that
  doubles while it keeps exiting soon after its start; meanwhile the group gives its vbuckets to the others
  (after the session timeout when it did not leave cleanly).

On stop the children are sent SIGTERM (each leaves the group cleanly: its vbuckets released once Kafka
acknowledged its records) while the node server still serves them; then the node server stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine import Bucket
from engine.network.server import NodeServer
from gateway.resume import CheckpointFollower

if TYPE_CHECKING:
    from gateway.config import GatewaySettings

log = logging.getLogger(__name__)

#: settings a child member must share with the ``up`` process (passed as DCPGW_* variables)
_SHARED = ("bucket", "topic_prefix", "value_format", "stream_from", "key_filter_prefix", "key_filter_regex",
           "flow_control_buffer_bytes", "checkpoint_interval_s", "rollback_mitigation", "oversize_policy",
           "create_topic_partitions", "group_partitions", "group_session_timeout_ms")

#: a child that exited is started again after this pause, doubled (up to RESTART_MAX_S) while it keeps exiting
#: within RESTART_RESET_S of its start
RESTART_MIN_S = 1.0
RESTART_MAX_S = 30.0
RESTART_RESET_S = 60.0


def group_name(topic: str) -> str:
    return f"dcpgw-{topic}"


def child_env(settings: GatewaySettings, bootstrap_servers: str) -> dict[str, str]:
    env = dict(os.environ)
    env["KAFKA_BOOTSTRAP_SERVERS"] = bootstrap_servers
    env.pop("DCPGW_KAFKA__BOOTSTRAP_SERVERS", None)
    for name in _SHARED:
        value = getattr(settings, name, None)
        key = f"DCPGW_{name.upper()}"
        if value is None:
            env.pop(key, None)
        else:
            env[key] = str(value).lower() if isinstance(value, bool) else str(value)
    return env


@dataclass
class GatewayChild:
    """One ``dcpgw gateway`` child process (slot ``index``) and its restarts."""

    index: int
    proc: subprocess.Popen[bytes]
    started: float
    restarts: int = 0
    #: exit status of the previous process of this slot (None: never exited)
    last_exit: int | None = None
    #: when the slot's next process is started (set while it waits to be restarted)
    restart_at: float | None = None
    pause_s: float = RESTART_MIN_S

    def status(self) -> dict[str, Any]:
        return {"pid": self.proc.pid, "running": self.proc.poll() is None, "restarts": self.restarts,
                "last_exit": self.last_exit}


class GroupHost:
    """The node server and the K gateway child processes of ``dcpgw up --gateways K``."""

    def __init__(self, settings: GatewaySettings, bootstrap_servers: str, bucket: Bucket, topic: str) -> None:
        self.settings = settings
        self.bootstrap_servers = bootstrap_servers
        self.bucket = bucket
        self.topic = topic
        self.group = group_name(topic)
        self.server = NodeServer(bucket, "dcpgw-up", host="127.0.0.1", port=0,
                                 flush_interval=settings.flush_interval_s)
        self.children: list[GatewayChild] = []
        self.port = 0
        self._env: dict[str, str] = {}
        self._stopping = False
        self._supervisor: asyncio.Task[None] | None = None
        #: the members' progress, read from the checkpoint topic (their acknowledged positions)
        self.progress: CheckpointFollower | None = None

    def _spawn(self) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "gateway", "--source", f"127.0.0.1:{self.port}", "--group",
             self.group, "--parent-pid", str(os.getpid())], env=self._env)

    async def start(self) -> None:
        self.port = await self.server.start()
        client = {**dict(self.settings.admin_config()), "bootstrap.servers": self.bootstrap_servers}
        self.progress = CheckpointFollower(client, self.topic)
        self.progress.start()
        self._env = child_env(self.settings, self.bootstrap_servers)
        now = time.monotonic()
        for i in range(self.settings.gateways):
            self.children.append(GatewayChild(i, self._spawn(), now))
        self._supervisor = asyncio.create_task(self._supervise(), name="dcpgw-gateways")
        log.info("gateway group %s: engine served on 127.0.0.1:%d, %d gateway processes (pids %s)",
                 self.group, self.port, len(self.children), [c.proc.pid for c in self.children])

    def status(self) -> dict[str, Any]:
        """``GET /health`` / ``/stats`` ``gateways``: the group and its processes."""
        return {"group": self.group, "source": f"127.0.0.1:{self.port}",
                "processes": [c.status() for c in self.children]}

    def check_children(self, now: float | None = None) -> None:
        """Start again every child that exited (once its pause is over); never waits."""
        if self._stopping:
            return
        now = time.monotonic() if now is None else now
        for c in self.children:
            code = c.proc.poll()
            if code is None:
                continue
            if c.restart_at is None:
                c.last_exit = code
                if now - c.started >= RESTART_RESET_S:
                    c.pause_s = RESTART_MIN_S
                c.restart_at = now + c.pause_s
                log.warning("gateway process %d (pid %d) of group %s exited with status %d: started again in "
                            "%.0f s (its vbuckets go to the other members meanwhile)", c.index, c.proc.pid,
                            self.group, code, c.pause_s)
                c.pause_s = min(RESTART_MAX_S, c.pause_s * 2)
            elif now >= c.restart_at:
                c.proc = self._spawn()
                c.started, c.restart_at = now, None
                c.restarts += 1
                log.info("gateway process %d of group %s started again: pid %d (restart %d)", c.index,
                         self.group, c.proc.pid, c.restarts)

    async def _supervise(self) -> None:
        while not self._stopping:
            await asyncio.sleep(0.5)
            self.check_children()

    async def stop(self, timeout: float = 30.0) -> None:
        """Stop the children (SIGTERM: each leaves the group cleanly while the node server still serves its
        streams), then the node server (the bucket stays open: the service closes it)."""
        self._stopping = True
        if self._supervisor is not None:
            self._supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._supervisor
        deadline = time.monotonic() + timeout
        for c in self.children:
            if c.proc.poll() is None:
                c.proc.send_signal(signal.SIGTERM)
        for c in self.children:
            try:
                await asyncio.to_thread(c.proc.wait, max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("gateway process %d (pid %d) did not leave within %.0f s: killed", c.index,
                            c.proc.pid, timeout)
                c.proc.kill()
                await asyncio.to_thread(c.proc.wait, 5)
        if self.progress is not None:
            await asyncio.to_thread(self.progress.close)
        if self.server._server is not None:
            self.server._server.close()
        for conn in list(self.server.conns):
            conn.closed = True
            with contextlib.suppress(Exception):
                conn.writer.close()
