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
import threading
import time
from collections.abc import Callable
from typing import Any

from gateway.kafka.membership import (
    DEFAULT_SESSION_TIMEOUT_MS,
    Membership,
    VBucketHandoff,
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
                                     member_name=member_name)
        #: vbuckets taken over / released so far (events, for status and tests)
        self.taken = 0
        self.released = 0
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
            raise m.error
        if m.stopping and not m.alive:
            return False
        self.serve()
        pub = self.publisher
        pub.pump()
        now = self.clock()
        if now >= self._next_cp:
            self.checkpoints.write(pub.take_checkpoints())
            self._next_cp = now + self.checkpoint_interval
        return True

    def finish(self) -> None:
        """Close: the publisher waits (bounded) for its deliveries, the checkpoints are flushed."""
        self.handoff.close()
        self.membership.stop()
        pub = self.publisher
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
