"""The rebalance mover over node processes: the in-process mover's phases (engine/cluster/rebalance.py,
docs/rebalance.md), driven through the nodes' memcached-protocol connections instead of in-process DCP
connections. It lives with the network edges because it speaks to :class:`~engine.network.remote.RemoteNode`s;
the cluster layer never imports this package."""

from __future__ import annotations

from engine.cluster.rebalance import Rebalance, VBucketMove
from engine.dcp.takeover import ALMOST_CAUGHT_UP_ITEMS
from engine.exceptions import InvalidArgument
from engine.kv.vbucket import VBucketState
from engine.network.remote import RemoteNode

__all__ = ["ProcessRebalance"]


class ProcessRebalance(Rebalance):
    """The rebalance over node processes (engine/network/process_cluster.py). A node's consumers are its own
    replication links (``replication:<src>-><dst>``, the named connection on both sides): the mover feeds
    a copy by adding its vbucket to the destination's links (SET_REPLICATION), polls ``stats dcp-vbtakeover``
    on the source, and starts the takeover with DCP_ADD_STREAM(TAKEOVER) on the destination, whose link
    re-requests the vbucket as a takeover stream; the acks travel back as DCP responses. The same phases,
    state checks and reverts as in process; a takeover not finished within ``takeover_timeout`` seconds is
    reverted."""

    takeover_timeout = 30.0

    def _client(self, name: str) -> RemoteNode:
        node = self.cluster.node_control(name)
        if not isinstance(node, RemoteNode):
            raise InvalidArgument("the process mover needs node processes")
        return node

    def _feed(self, move: VBucketMove) -> None:
        for n in move.fed:
            move.fed[n] = None  # the destination's link adds the stream itself (from SET_REPLICATION)

    def _pump_connections(self) -> None:
        return None  # the nodes replicate on their own

    def _collect(self, move: VBucketMove) -> bool:
        return True

    def _estimates(self, move: VBucketMove) -> list[int]:
        out = []
        for n in move.fed:
            st = self._client(move.source).takeover_stats(move.vbucket, f"replication:{move.source}->{n}")
            # no stream yet: not ready, whatever the vbucket's size
            out.append(ALMOST_CAUGHT_UP_ITEMS if st.get("status") == "does_not_exist" else int(st["estimate"]))
        return out

    def _begin_takeover(self, move: VBucketMove) -> None:
        move.takeover_deadline = self.cluster.monotonic_time() + self.takeover_timeout
        self._client(move.target).add_stream_takeover(move.source, move.vbucket)

    def _takeover_result(self, move: VBucketMove) -> bool | None:
        c = self.cluster
        old = c.node_control(move.source).vbucket_info(move.vbucket).state
        new = c.node_control(move.target).vbucket_info(move.vbucket).state
        if old is VBucketState.DEAD and new is VBucketState.ACTIVE:
            return True
        if self.cluster.monotonic_time() > move.takeover_deadline:
            return False
        return None

    def _cancel_takeover(self, move: VBucketMove) -> None:
        return None  # the source ends a takeover stream whose vbucket was made active again (takeover.py)

    def _refeed_target(self, move: VBucketMove) -> None:
        return None  # the link re-adds the stream once the vbucket is a replica again

    def _release(self, move: VBucketMove) -> None:
        return None  # the next SET_REPLICATION drops the mover's streams

    def _close_connections(self) -> None:
        return None
