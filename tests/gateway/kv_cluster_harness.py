"""An in-process cluster with one KV listener per node (gateway/kv_cluster.py) on a background event loop that
also pumps the cluster's replication, as ``dcpgw up --nodes N`` does, without Kafka: the fast way to put the
official SDK or a raw client in front of several nodes."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

from engine.cluster.local import Cluster
from engine.network.kv.frontend import StandaloneHooks
from engine.security.roles import Role
from engine.security.users import UserStore
from gateway.kv_cluster import ClusterKvPorts

T = TypeVar("T")
PASSWORD = "kv-cluster-secret"


class KvClusterNodes:
    """``nodes`` engine nodes with ``replicas`` replicas, each behind its own KV port, pumped every millisecond."""

    def __init__(self, data_dir: Path, *, nodes: int = 3, replicas: int = 1, num_vbuckets: int = 16,
                 first_port: int = 0, ssl_context: ssl.SSLContext | None = None, **cluster: Any) -> None:
        self.users = UserStore.open(data_dir / "users")
        self.users.add("app", PASSWORD, [Role.DATA_READER, Role.DATA_WRITER])
        self.cluster = Cluster.create(data_dir / "cluster", nodes=nodes, replicas=replicas,
                                      num_vbuckets=num_vbuckets, **cluster)
        self.loop = asyncio.new_event_loop()
        self.ports = ClusterKvPorts(self.cluster, self.users, bucket="default", host="127.0.0.1",
                                    first_port=first_port, ssl_context=ssl_context, hooks=StandaloneHooks(),
                                    conflict_resolution=cluster.get("conflict_resolution", "seqno"))
        self._pump: asyncio.Task[None] | None = None
        ready: Future[None] = Future()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            try:
                self.loop.run_until_complete(self.ports.start())
                self._pump = self.loop.create_task(self._pump_loop())
                ready.set_result(None)
            except BaseException as e:  # handed to the constructor
                ready.set_exception(e)
                return
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True, name="kv-cluster")
        self.thread.start()
        ready.result(30)

    async def _pump_loop(self) -> None:
        while True:
            self.cluster.pump(rounds=1)
            if self.cluster.rebalance_running is not None:
                self.cluster.pump(rounds=1)
            await self.ports.sync()
            await asyncio.sleep(0.001)

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the loop's thread (the cluster's owner) and return its result."""
        fut: Future[T] = Future()

        def run() -> None:
            try:
                fut.set_result(fn())
            except BaseException as e:  # handed back to the caller
                fut.set_exception(e)

        self.loop.call_soon_threadsafe(run)
        return fut.result(60)

    def port(self, node: str) -> int:
        return self.call(lambda: self.ports.ports[node])

    def close(self) -> None:
        async def down() -> None:
            if self._pump is not None:
                self._pump.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._pump
            await self.ports.stop()
            self.cluster.close()

        asyncio.run_coroutine_threadsafe(down(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
