"""``dcpgw up --gateways K`` (docs/scale-out.md "dcpgw up --gateways"): the ``up`` process hosts a group of K
gateway processes publishing its engine.

* the engine stays in the ``up`` process (the HTTP API writes into it as always) and is also served over the
  memcached binary protocol by a :class:`~engine.network.server.NodeServer` on the same event loop, on a loopback
  port -- the DCP connections of the other members come in there;
* the ``up`` process's own publisher is member 1 of the group ``dcpgw-<topic>`` (it starts with no vbucket; the
  membership thread hands it its share, :class:`~gateway.kafka.membership.VBucketHandoff` served by the pump
  loop);
* K - 1 child processes ``dcpgw gateway --source 127.0.0.1:PORT --group dcpgw-<topic>`` are the other members,
  with the same settings (the parent's environment, its config file, and the settings given on the command
  line as ``DCPGW_*`` variables).

On stop the ``up`` process leaves the group first (its vbuckets released while its pump loop still runs), then
stops the children (SIGTERM: they leave cleanly) and the node server.
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
from typing import TYPE_CHECKING, Any

from engine import Bucket
from engine.network.server import NodeServer
from gateway.kafka.membership import Membership, VBucketHandoff
from gateway.resume import PublishPosition, load_checkpoints, replay_tail

if TYPE_CHECKING:
    from gateway.config import GatewaySettings
    from gateway.publisher import Publisher

log = logging.getLogger(__name__)

#: settings a child member must share with the ``up`` process (passed as DCPGW_* variables)
_SHARED = ("bucket", "topic_prefix", "value_format", "stream_from", "key_filter_prefix", "key_filter_regex",
           "flow_control_buffer_bytes", "checkpoint_interval_s", "rollback_mitigation", "oversize_policy",
           "create_topic_partitions", "group_partitions", "group_session_timeout_ms")


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


class GroupHost:
    """The node server, the children and the ``up`` process's own membership."""

    def __init__(self, settings: GatewaySettings, bootstrap_servers: str, bucket: Bucket, publisher: Publisher,
                 client_config: dict[str, Any], topic: str, partitions: int) -> None:
        self.settings = settings
        self.bootstrap_servers = bootstrap_servers
        self.bucket = bucket
        self.publisher = publisher
        self.client_config = client_config
        self.topic = topic
        self.partitions = partitions
        self.group = group_name(topic)
        self.server = NodeServer(bucket, "dcpgw-up", host="127.0.0.1", port=0,
                                 flush_interval=settings.flush_interval_s)
        self.handoff = VBucketHandoff()
        nvb = bucket.num_vbuckets
        self.membership = Membership(client_config, topic, self.group, nvb, self.handoff, self._recover,
                                     partitions=min(settings.group_partitions, nvb),
                                     session_timeout_ms=settings.group_session_timeout_ms,
                                     member_name=f"dcpgw-up-{os.getpid()}")
        self.children: list[subprocess.Popen[bytes]] = []
        self.port = 0

    def _recover(self, vbuckets: list[int]) -> dict[int, PublishPosition]:
        saved = load_checkpoints(self.client_config, self.topic)
        return replay_tail(self.client_config, self.topic, self.partitions, self.bucket.num_vbuckets, saved,
                           vbuckets=vbuckets)

    async def start(self) -> None:
        self.port = await self.server.start()
        self.membership.start()
        env = child_env(self.settings, self.bootstrap_servers)
        for _ in range(self.settings.gateways - 1):
            self.children.append(subprocess.Popen(
                [sys.executable, "-m", "gateway.cli", "gateway", "--source", f"127.0.0.1:{self.port}", "--group",
                 self.group, "--parent-pid", str(os.getpid())], env=env))
        log.info("gateway group %s: engine served on 127.0.0.1:%d, %d more gateway processes (pids %s)",
                 self.group, self.port, len(self.children), [c.pid for c in self.children])

    def serve(self) -> None:
        """On the pump loop: serve the membership's changes (never waits)."""
        pub = self.publisher
        self.handoff.serve(pub.remove_vbuckets, lambda vbs: pub.unacked(vbs) == 0, pub.add_vbuckets)

    @property
    def error(self) -> BaseException | None:
        return self.membership.error

    async def stop(self, timeout: float = 30.0) -> None:
        """Leave the group (the pump loop must still run: it serves the revoke), then stop the children and the
        node server (the bucket stays open: the service closes it)."""
        self.membership.stop()
        deadline = time.monotonic() + timeout
        while self.membership.alive and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.handoff.close()
        for c in self.children:
            if c.poll() is None:
                c.send_signal(signal.SIGTERM)
        for c in self.children:
            try:
                await asyncio.to_thread(c.wait, max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.kill()
                await asyncio.to_thread(c.wait, 5)
        if self.server._server is not None:
            self.server._server.close()
        for conn in list(self.server.conns):
            conn.closed = True
            with contextlib.suppress(Exception):
                conn.writer.close()
