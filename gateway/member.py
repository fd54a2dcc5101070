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
from gateway.publisher import DeliveryBudget, DeliveryTimedOut, ProducerFailed, Publisher
from gateway.resume import CheckpointWriter, PublishPosition, load_checkpoints, replay_tail

log = logging.getLogger(__name__)

#: a member's records are to be delivered within this fraction of its producer's ``message.timeout.ms`` (the
#: lease): :class:`~gateway.publisher.DeliveryBudget`'s target (docs/scale-out.md "Delivery within the lease")
DELIVERY_TARGET_FRACTION = 0.25


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
        #: in-process recoveries after records timed out in librdkafka (docs/scale-out.md "Delivery within the
        #: lease"): how many, the vbuckets waiting to be resumed from their partitions' tails, when the producer
        #: was renewed (``clock`` time) and when the coordinator was first seen answering after it
        self.recoveries = 0
        self._recovering: set[int] = set()
        self._renewed_at: float | None = None
        self._answered_at: float | None = None
        #: after the coordinator answered a request sent after the renewal, how long records the broker received
        #: before (possibly persisted: in flight when they timed out) are given to land before the tails are read
        self.settle_s = max(1.0, self.membership.check_interval_s)

    # ------------------------------------------------------------------ the membership thread
    def _recover(self, vbuckets: list[int]) -> dict[int, PublishPosition]:
        """Where ``vbuckets`` stand in Kafka: their checkpoints, then the tail of their partitions
        (gateway/resume.py), as a restarted gateway recovers them."""
        saved = load_checkpoints(self.client_config, self.topic)
        return replay_tail(self.client_config, self.topic, self.num_partitions, self.num_vbuckets, saved,
                           vbuckets=vbuckets)

    # ------------------------------------------------------------------ the loop's thread
    def _start_revoke(self, vbuckets: list[int]) -> None:
        self._recovering.difference_update(vbuckets)  # the next owner recovers them
        self.publisher.remove_vbuckets(vbuckets)

    def _released(self, vbuckets: list[int]) -> bool:
        if self.publisher.unacked(vbuckets):
            return False
        if self._renewed_at is not None and not self._settled():
            # records of them that timed out in flight may still land: the next owner reads the tails after
            return False
        # their last acknowledged positions go to the checkpoint topic (never waits; a checkpoint that lands
        # after the next owner's is older, which only lengthens a later tail replay)
        self.checkpoints.write(self.publisher.take_checkpoints())
        self.released += len(vbuckets)
        return True

    def _add(self, positions: dict[int, PublishPosition]) -> None:
        self._recovering.difference_update(positions)  # recovered by the membership thread, after the renewal
        self.publisher.add_vbuckets(positions)
        self.taken += len(positions)

    # ------------------------------------------------------------------ delivery timeouts (in-process restart)
    def _delivery_failed(self, e: DeliveryTimedOut | ProducerFailed) -> None:
        """Records timed out in librdkafka (a busy or paused broker) while this member held its lease, or the
        idempotent producer failed: what a restart would do, in-process. Every vbucket's stream is closed, the
        producer's records are dropped (purged, never delivered late) and a new producer takes over; the
        vbuckets are resumed from their partitions' tails once records that were in flight had time to land
        (:meth:`_resume_recovered`). Acknowledged positions stay valid: their checkpoints are written."""
        pub = self.publisher
        vbs = sorted(pub.assigned)
        pub.remove_vbuckets(vbs)
        dropped = pub.renew_producer()
        self.checkpoints.write(pub.take_checkpoints())
        self._recovering.update(vbs)
        self._renewed_at = self.clock()
        self._answered_at = None
        self.recoveries += 1
        log.warning("group %s: %s; %d records dropped, %d vbuckets resume from their partitions' tails in this "
                    "process (delivery recovery %d)", self.membership.group, e, dropped, len(vbs), self.recoveries)

    def _settled(self) -> bool:
        """True once records handed to the broker before the producer was renewed can no longer land: the
        coordinator accepted a generation check sent after the renewal, and ``settle_s`` passed since."""
        renewed = self._renewed_at
        if renewed is None:
            return True
        m = self.membership
        now = self.clock()
        if self._answered_at is None:
            if m.lease_until - m.lease_s < renewed:
                return False  # no answer yet to a request sent after the renewal (the broker is still stalled)
            self._answered_at = now
        if now < self._answered_at + self.settle_s:
            return False
        self._renewed_at = self._answered_at = None
        return True

    def _resume_recovered(self) -> None:
        """Resume the vbuckets of a delivery recovery from their partitions' tails, once :meth:`_settled`
        (blocking Kafka reads on the loop's thread, as long as a restart's)."""
        vbs = sorted(self._recovering)
        positions = self._recover(vbs)
        self._recovering.clear()
        self.publisher.add_vbuckets(positions)
        log.info("group %s: %d vbuckets resumed from their partitions' tails (delivery recovery %d)",
                 self.membership.group, len(vbs), self.recoveries)

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
        if (pub.assigned or self._recovering) and m.lease_expired():
            self.waits_for_lease += 1
            return True
        if self._recovering and self._settled():
            self._resume_recovered()
            return True  # the replay took a while: the lease is checked again before anything is published
        try:
            pub.pump()
        except (DeliveryTimedOut, ProducerFailed) as e:
            # docs/scale-out.md "Delivery within the lease": a busy broker does not end a member holding its lease
            self._delivery_failed(e)
            return True
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
            while True:
                if stop.is_set():
                    self.leave()
                before = self.publisher.records_sent
                if not self.step():
                    break
                if self.publisher.records_sent == before:
                    self.publisher.kafka.poll(0.005)  # the current producer: a delivery recovery renews it
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

    # a member's records never wait in its producer past its lease (docs/scale-out.md "Fencing"), and it hands
    # librdkafka only what the broker delivers well within it ("Delivery within the lease")
    producer_conf = fenced_producer_config(producer_conf, s.group_session_timeout_ms)
    target_s = int(producer_conf["message.timeout.ms"]) / 1000 * DELIVERY_TARGET_FRACTION

    def make(vbs: list[int]) -> Publisher:
        return Publisher(source, producer_conf, topic, partitions, RecordEncoder(ValueFormat(s.value_format)), {},
                         stream_from=s.stream_from, key_filter=KeyFilter(s.key_filter_prefix, s.key_filter_regex),
                         flow_control_bytes=s.flow_control_buffer_bytes, rollback_mitigation=s.rollback_mitigation,
                         connection_name=source.connection_name, oversize_policy=s.oversize_policy,
                         large_record_bytes=large, vbuckets=vbs, delivery_budget=DeliveryBudget(target_s))

    member = GroupMember(make, client, producer_conf, topic, partitions, nvb, group,
                         member_partitions=min(s.group_partitions, nvb),
                         session_timeout_ms=s.group_session_timeout_ms,
                         checkpoint_interval=s.checkpoint_interval_s, member_name=f"dcpgw-{me}")
    log.info("gateway member of group %s: topic %s (%d partitions), %d vbuckets on %s", group, topic, partitions,
             nvb, ", ".join(addresses))
    if on_ready is not None:
        on_ready(member)
    member.run(stop)
