"""The gateway process: engine + publisher + checkpoints + background tasks + HTTP API, on one event loop.

The engine and the publisher are synchronous; this module is the edge where time and I/O live. Every engine
call happens on the event loop thread (the engine is single-threaded by design).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from aiohttp import web

from engine import Bucket
from gateway.config import GatewaySettings
from gateway.metrics import GatewayMetrics
from gateway.publisher import KeyFilter, Publisher
from gateway.records import RecordEncoder, ValueFormat, topic_name
from gateway.resume import CheckpointWriter, ensure_topics, recover_positions

log = logging.getLogger(__name__)


class GatewayService:
    """One bucket streamed into one topic, with its HTTP API."""

    def __init__(self, settings: GatewaySettings, bootstrap_servers: str) -> None:
        self.settings = settings
        self.bootstrap_servers = bootstrap_servers
        self.topic = topic_name(settings.topic_prefix, settings.bucket)
        self.metrics = GatewayMetrics()
        self.bucket: Bucket | None = None
        self.publisher: Publisher | None = None
        self.checkpoints: CheckpointWriter | None = None
        self.runner: web.AppRunner | None = None
        self.http_port: int = settings.http_port
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = asyncio.Event()
        self._wake = asyncio.Event()
        self.started_at = 0.0
        self.recovered_records = 0

    # ------------------------------------------------------------------ config helpers
    def _client_config(self) -> dict[str, Any]:
        conf = dict(self.settings.admin_config())
        conf["bootstrap.servers"] = self.bootstrap_servers
        return conf

    def _producer_config(self) -> dict[str, Any]:
        conf = dict(self.settings.producer_config())
        conf["bootstrap.servers"] = self.bootstrap_servers
        return conf

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        s = self.settings
        self.bucket = Bucket(s.engine_config())
        nparts = s.create_topic_partitions or s.num_vbuckets
        client = self._client_config()
        loop = asyncio.get_running_loop()
        partitions = await loop.run_in_executor(
            None, ensure_topics, client, self.topic, nparts, s.topic_replication_factor)
        positions = await loop.run_in_executor(
            None, recover_positions, client, self.topic, partitions, s.num_vbuckets)
        self.publisher = Publisher(
            self.bucket, self._producer_config(), self.topic, partitions,
            RecordEncoder(ValueFormat(s.value_format)), positions,
            stream_from=s.stream_from,
            key_filter=KeyFilter(s.key_filter_prefix, s.key_filter_regex),
            flow_control_bytes=s.flow_control_buffer_bytes,
            rollback_mitigation=s.rollback_mitigation,
            connection_name=f"dcpgw:{s.bucket}",
        )
        self.checkpoints = CheckpointWriter(self._producer_config(), self.topic)
        self.publisher.open()
        from gateway.api import build_app  # local: api imports this module for typing

        app = build_app(self)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, s.http_host, s.http_port)
        await site.start()
        server = getattr(site, "_server", None)
        if server is not None and server.sockets:
            self.http_port = server.sockets[0].getsockname()[1]
        self.started_at = time.time()
        self._tasks = [
            asyncio.create_task(self._pump_loop(), name="dcpgw-pump"),
            asyncio.create_task(self._every(s.checkpoint_interval_s, self._checkpoint), name="dcpgw-ckpt"),
            asyncio.create_task(self._every(s.expiry_pager_interval_s, self._expiry), name="dcpgw-expiry"),
            asyncio.create_task(self._every(s.compaction_interval_s, self._compact), name="dcpgw-compact"),
        ]
        if not s.rollback_mitigation:
            self._tasks.append(asyncio.create_task(self._every(s.flush_interval_s, self._flush), name="flush"))
        log.info("gateway up: topic %s (%d partitions), http://%s:%d", self.topic, partitions, s.http_host,
                 self.http_port)

    def wake(self) -> None:
        """Writes happened: the pump loop should run now."""
        self._wake.set()

    async def _pump_loop(self) -> None:
        pub = self.publisher
        assert pub is not None
        idle = 0
        while not self._stopping.is_set():
            n = pub.pump()
            if n:
                idle = 0
                await asyncio.sleep(0)
                continue
            idle = min(idle + 1, 10)
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=0.001 * idle)

    async def _every(self, interval: float, fn: Any) -> None:
        while not self._stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), timeout=interval)
            if self._stopping.is_set():
                return
            try:
                fn()
            except Exception:  # a background task must not die silently
                log.exception("background task %s failed", getattr(fn, "__name__", fn))

    def _checkpoint(self) -> None:
        assert self.publisher is not None and self.checkpoints is not None
        cps = self.publisher.take_checkpoints()
        if cps:
            self.checkpoints.write(cps)

    def _expiry(self) -> None:
        assert self.bucket is not None
        if self.bucket.run_expiry_pager():
            self.wake()

    def _compact(self) -> None:
        assert self.bucket is not None
        self.bucket.compact()

    def _flush(self) -> None:
        assert self.bucket is not None
        if self.bucket.flush():
            self.wake()

    async def stop(self) -> None:
        self._stopping.set()
        self._wake.set()
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self.runner is not None:
            await self.runner.cleanup()
        if self.publisher is not None:
            self.publisher.close(timeout=10)
            self._checkpoint()
        if self.checkpoints is not None:
            self.checkpoints.flush()
        if self.bucket is not None:
            self.bucket.close(clean=True)
        # Drop the Kafka clients now (librdkafka handles are destroyed with their last reference).
        self.publisher = None
        self.checkpoints = None

    async def run_until_stopped(self) -> None:
        await self._stopping.wait()

    def request_stop(self) -> None:
        self._stopping.set()
        self._wake.set()
