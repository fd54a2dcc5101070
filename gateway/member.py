"""One gateway process as a member of a group of gateways sharing one engine's vbuckets (docs/scale-out.md).

:class:`GroupMember` owns a :class:`~gateway.publisher.Publisher` that starts with no vbucket, a
:class:`~gateway.resume.CheckpointWriter` and a :class:`~gateway.kafka.membership.Membership`. Its loop
(:meth:`GroupMember.run`, one thread: the publisher is single-threaded) pumps the publisher, writes checkpoints
and serves the membership's changes between pumps:

* assigned vbuckets: their positions were recovered on the membership thread (checkpoint topic + tail of
  their partitions, exactly as after a restart) and the loop opens their streams;
* revoked vbuckets: the loop closes their streams, keeps pumping until every record of theirs Kafka has not
  acknowledged is acknowledged, hands their checkpoints to the writer, and only then lets the revoke callback
  return -- so the group's next owner never sees a record of them appear after its tail replay.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from gateway.config import GatewaySettings
from gateway.exceptions import GatewayError
from gateway.kafka.membership import (
    DEFAULT_SESSION_TIMEOUT_MS,
    MemberFenced,
    Membership,
    VBucketHandoff,
    fenced_producer_config,
)
from gateway.publisher import Publisher
from gateway.resume import CheckpointWriter, PublishPosition, load_checkpoints, replay_tail

log = logging.getLogger(__name__)


class GroupMember:
    """A gateway process's publisher driven by group membership. ``make_publisher(vbuckets)`` builds the
    publisher (its source, producer settings, encoder) for an initially empty set of vbuckets."""

    def __init__(self, make_publisher: Callable[[list[int]], Publisher], client_config: dict[str, Any],
                 producer_config: dict[str, Any], topic: str, num_partitions: int, num_vbuckets: int,
                 group: str, *, member_partitions: int | None = None,
                 session_timeout_ms: int = DEFAULT_SESSION_TIMEOUT_MS, checkpoint_interval: float = 1.0,
                 member_name: str = "dcpgw", clock: Callable[[], float] = time.monotonic) -> None:
        self.client_config = client_config
        self.topic = topic
        self.num_partitions = num_partitions
        self.num_vbuckets = num_vbuckets
        self.checkpoint_interval = checkpoint_interval
        self.clock = clock
        self.publisher = make_publisher([])
        self.checkpoints = CheckpointWriter(producer_config, topic)
        self.handoff = VBucketHandoff()
        self.membership = Membership(client_config, topic, group, num_vbuckets, self.handoff, self._recover,
                                     partitions=member_partitions, session_timeout_ms=session_timeout_ms,
                                     member_name=member_name, fail_stop=True, clock=clock)
        #: vbuckets taken over / released so far (events, for status and tests)
        self.taken = 0
        self.released = 0
        #: why this member stopped publishing at once (docs/scale-out.md "Fencing"); None: it was not fenced
        self.fenced: str | None = None
        #: loop rounds that published nothing because the lease was not confirmed yet
        self.waits_for_lease = 0
        self._next_cp = 0.0

    # ------------------------------------------------------------------ the membership thread
    def _recover(self, vbuckets: list[int]) -> dict[int, PublishPosition]:
        """Where ``vbuckets`` stand in Kafka: their checkpoints, then the tail of their partitions
        (gateway/resume.py), as a restarted gateway recovers them."""
        saved = load_checkpoints(self.client_config, self.topic)
        return replay_tail(self.client_config, self.topic, self.num_partitions, self.num_vbuckets, saved,
                           vbuckets=vbuckets)

    # ------------------------------------------------------------------ the loop's thread
    def _start_revoke(self, vbuckets: list[int]) -> None:
        self.publisher.remove_vbuckets(vbuckets)

    def _released(self, vbuckets: list[int]) -> bool:
        if self.publisher.unacked(vbuckets):
            return False
        # their last acknowledged positions go to the checkpoint topic (never waits; a checkpoint that lands
        # after the next owner's is older, which only lengthens a later tail replay)
        self.checkpoints.write(self.publisher.take_checkpoints())
        self.released += len(vbuckets)
        return True

    def _add(self, positions: dict[int, PublishPosition]) -> None:
        self.publisher.add_vbuckets(positions)
        self.taken += len(positions)

    def serve(self) -> None:
        self.handoff.serve(self._start_revoke, self._released, self._add)

    def start(self) -> None:
        """Open the publisher (no vbucket yet) and join the group."""
        self.publisher.open()
        self.membership.start()
        self._next_cp = self.clock() + self.checkpoint_interval

    def leave(self) -> None:
        """Leave the group: the membership thread revokes (the loop must keep stepping until :meth:`step`
        says it is done)."""
        self.membership.stop()

    def step(self) -> bool:
        """One round of the loop: serve membership changes, pump, checkpoint. False once the member left the
        group (after :meth:`leave`). Raises the membership's error, if any."""
        m = self.membership
        if m.error is not None:
            if isinstance(m.error, GatewayError):
                raise m.error
            raise GatewayError(f"group {m.group}: membership failed: {m.error}") from m.error
        if m.stopping and not m.alive:
            return False
        self.serve()
        pub = self.publisher
        # docs/scale-out.md "Fencing": never hand Kafka a record once the generation is unconfirmed past the
        # lease (paused, cut off from the coordinator): the group may have given the vbuckets away. Wait for
        # the membership thread to confirm it again; if the group refused it (or the assignment was lost),
        # stop for good.
        if m.fenced is not None:
            self.fenced = m.fenced
            raise MemberFenced(f"fenced, publishing nothing more: {m.fenced}")
        if pub.assigned and m.lease_expired():
            self.waits_for_lease += 1
            return True
        pub.pump()
        now = self.clock()
        if now >= self._next_cp:
            self.checkpoints.write(pub.take_checkpoints())
            self._next_cp = now + self.checkpoint_interval
        return True

    def finish(self) -> None:
        """Close: the publisher waits (bounded) for its deliveries, the checkpoints are flushed. A fenced member
        first drops what its producer still queues or has in flight (never delivered late) and writes no
        checkpoint."""
        self.handoff.close()
        self.membership.stop()
        pub = self.publisher
        if self.fenced is not None:
            pub.purge()
            pub.close(0)
            self.membership.join(5.0)
            return
        pub.close()
        self.checkpoints.write(pub.take_checkpoints())
        self.checkpoints.flush()
        self.membership.join(5.0)

    def run(self, stop: threading.Event) -> None:
        """Join the group and publish until ``stop`` is set; then leave the group (its vbuckets released
        cleanly, so the others take them over at once) and close."""
        self.start()
        try:
            idle_poll = self.publisher.kafka.poll
            while True:
                if stop.is_set():
                    self.leave()
                before = self.publisher.records_sent
                if not self.step():
                    break
                if self.publisher.records_sent == before:
                    idle_poll(0.005)
        finally:
            self.finish()


def watch_parent(parent_pid: int, stop: threading.Event, interval: float = 0.5) -> threading.Thread:
    """Set ``stop`` once this process is no longer ``parent_pid``'s child (the ``dcpgw up --gateways`` process
    that started it died, even by SIGKILL): the member then leaves the group cleanly instead of lingering."""

    def watch() -> None:
        while not stop.wait(interval):
            if os.getppid() != parent_pid:
                log.warning("parent process %d is gone: leaving the group", parent_pid)
                stop.set()

    t = threading.Thread(target=watch, name="dcpgw-parent-watch", daemon=True)
    t.start()
    return t


def run_attached_member(settings: GatewaySettings, bootstrap_servers: str, addresses: list[str], group: str,
                        stop: threading.Event, *, on_ready: Callable[[GroupMember], None] | None = None) -> None:
    """``dcpgw gateway --source HOST:PORT[,...] --group NAME``: one more member of ``group``, streaming the vbuckets
    the group assigns it from the running node processes at ``addresses`` into the settings' topic, until
    ``stop`` is set (then it leaves the group cleanly)."""
    from gateway.publisher import DEFAULT_LARGE_RECORD_BYTES, KeyFilter
    from gateway.resume import ensure_topics, topic_record_limit, wait_for_kafka
    from gateway.source import AttachedNodesSource
    from schemas.codec import RecordEncoder
    from schemas.records import ValueFormat
    from schemas.topics import topic_name

    s = settings
    client = {**dict(s.admin_config()), "bootstrap.servers": bootstrap_servers}
    producer_conf = {**dict(s.producer_config()), "bootstrap.servers": bootstrap_servers}
    wait_for_kafka(client, s.kafka_connect_timeout_s)
    topic = topic_name(s.topic_prefix, s.bucket)
    me = f"{socket.gethostname()}:{os.getpid()}"
    source = AttachedNodesSource(addresses, f"dcpgw:{s.bucket}:{group}:{me}", s.flow_control_buffer_bytes)
    source.open()
    nvb = source.num_vbuckets
    needed = s.max_record_bytes()
    partitions = ensure_topics(client, topic, s.create_topic_partitions or nvb, s.topic_replication_factor, 30.0,
                               needed)
    limit = topic_record_limit(client, topic, needed)
    large = max(1, DEFAULT_LARGE_RECORD_BYTES if limit is None else min(limit, needed) - 1024)

    # a member's records never wait in its producer past its lease (docs/scale-out.md "Fencing")
    producer_conf = fenced_producer_config(producer_conf, s.group_session_timeout_ms)

    def make(vbs: list[int]) -> Publisher:
        return Publisher(source, producer_conf, topic, partitions, RecordEncoder(ValueFormat(s.value_format)), {},
                         stream_from=s.stream_from, key_filter=KeyFilter(s.key_filter_prefix, s.key_filter_regex),
                         flow_control_bytes=s.flow_control_buffer_bytes, rollback_mitigation=s.rollback_mitigation,
                         connection_name=source.connection_name, oversize_policy=s.oversize_policy,
                         large_record_bytes=large, vbuckets=vbs)

    member = GroupMember(make, client, producer_conf, topic, partitions, nvb, group,
                         member_partitions=min(s.group_partitions, nvb),
                         session_timeout_ms=s.group_session_timeout_ms,
                         checkpoint_interval=s.checkpoint_interval_s, member_name=f"dcpgw-{me}")
    log.info("gateway member of group %s: topic %s (%d partitions), %d vbuckets on %s", group, topic, partitions,
             nvb, ", ".join(addresses))
    if on_ready is not None:
        on_ready(member)
    member.run(stop)
