"""The KV port of ``dcpgw up`` (docs/kv-protocol.md): the engine's memcached-binary-protocol front end
(engine/network/kv) on the gateway's event loop, with the gateway's write hooks -- backpressure (TMPFAIL while
``max_unacked_bytes`` wait for Kafka), the unacknowledged-write accounting and the pump's wake-up, and sync
writes waited for without blocking the loop (the same as the HTTP API's ``?durability=``)."""

from __future__ import annotations

import asyncio
import os
from typing import TYPE_CHECKING

from engine.bucket import Bucket
from engine.exceptions import SyncWriteAmbiguous, TemporaryFailure
from engine.kv.durability import SyncWrite
from engine.kv.vbucket import MutationResult
from engine.network.kv.cluster_config import ClusterConfigProvider, SingleNodeConfig
from engine.network.kv.frontend import KVServer
from engine.network.kv.sasl import UserDirectory
from engine.security.users import UserStore
from gateway.exceptions import Backpressure, GatewayError

if TYPE_CHECKING:
    from gateway.service import GatewayService


__all__ = ["GatewayWriteHooks", "KVServer", "kv_provider", "start_kv_port"]


class GatewayWriteHooks:
    """engine/network/kv/documents.py ``WriteHooks`` for the gateway."""

    def __init__(self, svc: GatewayService) -> None:
        self.svc = svc

    def admit_write(self) -> None:
        try:
            self.svc.admit_write()
        except Backpressure as e:  # the SDK retries a TMPFAIL (docs/kv-protocol.md "Statuses")
            raise TemporaryFailure(str(e)) from None

    def wrote(self, res: MutationResult, nbytes: int) -> None:
        self.svc.note_write(res.vbucket, res.seqno, nbytes)
        self.svc.wake()

    async def completed(self, bucket: Bucket, sw: SyncWrite) -> MutationResult:
        # gateway/api.py ``_completed``: the pump loop replicates and the flusher persists; timeouts run here
        svc = self.svc
        svc.wake()
        while not sw.done:
            if bucket.closed:
                raise SyncWriteAmbiguous(f"sync write of {sw.key!r}: its node went down before it completed")
            bucket.process_durability_timeouts()
            if sw.done:
                break
            await asyncio.sleep(0.001)
            svc.wake()
        return sw.result()


def kv_provider(svc: GatewayService, port: list[int], tls: bool) -> ClusterConfigProvider:
    """The cluster config provider of this gateway: one node (``--nodes N`` brings its own provider)."""
    return SingleNodeConfig(lambda: svc.bucket, svc.settings.bucket, lambda: port[0], tls=tls)


async def start_kv_port(svc: GatewayService) -> KVServer:
    """Listen on ``kv_port`` (0: a free port) on ``http_host``, with the service's user store and TLS context;
    the returned server's ``port`` is the one bound. A port that cannot be bound is one GatewayError."""
    s = svc.settings
    users: UserDirectory = svc.users if svc.users is not None else UserStore.open(s.data_dir)
    ssl_context = svc.tls_context
    port = [s.kv_port]
    server = KVServer(kv_provider(svc, port, ssl_context is not None), users, host=s.http_host, port=s.kv_port,
                      ssl_context=ssl_context, hooks=GatewayWriteHooks(svc))
    try:
        port[0] = await server.start()
    except OSError as e:
        raise GatewayError(f"cannot listen on {s.http_host}:{s.kv_port} (kv_port): "
                           f"{os.strerror(e.errno) if e.errno else e}") from e
    return server
