"""Scale-out by Kafka group membership (docs/scale-out.md): N gateway processes share one engine's (or
cluster's) vbuckets by joining one Kafka consumer group on a coordination topic, as Kafka Connect distributes a
connector's tasks.

The coordination topic ``<topic>.members`` has T partitions (by default ``min(num_vbuckets, 64)``) and holds no
records: it exists only to be assigned. A member that is assigned coordination partition ``p`` owns every vbucket
``v`` with ``v % T == p``. The group uses the *eager* ``roundrobin`` assignor (Tansu never completes a
cooperative rebalance, docs/kafka-compat.md): at every rebalance each member first gives back everything it
owns (``on_revoke``), then the group leader assigns afresh. Because the join completes only once every live
member re-joined, i.e. once every ``on_revoke`` callback returned, a vbucket's new owner starts only after its
old owner stopped -- provided the old owner's revoke waits until its stream is closed and its in-flight records
are acknowledged. A member that stops answering (killed, partitioned, paused) is expelled after
``session.timeout.ms`` and its vbuckets are assigned to the others (fencing limits: docs/scale-out.md).

The group's consumer runs on a thread of its own: librdkafka runs the rebalance callbacks inside ``poll()``, so
they may block there -- waiting for the publisher's event loop to release or resume vbuckets -- without ever
blocking that loop. :class:`VBucketHandoff` is the meeting point: the membership thread posts a change and
waits; the loop serves it on its own thread between pumps (:meth:`VBucketHandoff.serve`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import NewTopic

from gateway.exceptions import BrokerError, GatewayError
from gateway.kafka.clients import admin_client, consumer

log = logging.getLogger(__name__)

#: coordination partitions when none are given (at most one per vbucket)
DEFAULT_MEMBER_PARTITIONS: Final = 64
#: how long a member may stay silent before the group expels it (Kafka's default is 45 s; a gateway wants its
#: vbuckets moved sooner)
DEFAULT_SESSION_TIMEOUT_MS: Final = 10_000
#: fencing (docs/scale-out.md "Fencing"): a confirmed generation is a lease of this fraction of the session
#: timeout, and a member's records may wait at most as long in its producer (``message.timeout.ms``)
LEASE_FRACTION: Final = 1 / 3
#: a fail-stop member's producer queue is kept short, so that records rarely wait long in it
FENCED_QUEUE_MAX_KBYTES: Final = 16 * 1024
#: the JoinGroup rebalance timeout (librdkafka ``max.poll.interval.ms``, its default): a conforming coordinator
#: completes a join within it, removing the members that did not re-join
REBALANCE_TIMEOUT_MS: Final = 300_000
#: OffsetCommit answers that say this member is no longer in the group's current generation
_EXPELLED: Final = frozenset({KafkaError.UNKNOWN_MEMBER_ID, KafkaError.ILLEGAL_GENERATION,
                              KafkaError.FENCED_INSTANCE_ID})


class MemberFenced(GatewayError):
    """This member may no longer own its vbuckets (its generation is stale or unconfirmed for too long: it was
    paused or cut off past its session timeout); it must publish nothing more (docs/scale-out.md "Fencing")."""


def fenced_producer_config(producer_config: dict[str, Any], session_timeout_ms: int) -> dict[str, Any]:
    """A fail-stop member's producer settings: a record not delivered within the lease
    (``LEASE_FRACTION`` of the session timeout) fails locally instead of being sent late, after another member
    may have taken its vbucket over (librdkafka ``message.timeout.ms``), and a shorter local queue."""
    conf = dict(producer_config)
    lease_ms = max(1, int(session_timeout_ms * LEASE_FRACTION))
    conf["message.timeout.ms"] = min(int(conf.get("message.timeout.ms", lease_ms)), lease_ms)
    conf["queue.buffering.max.kbytes"] = min(int(conf.get("queue.buffering.max.kbytes", FENCED_QUEUE_MAX_KBYTES)),
                                             FENCED_QUEUE_MAX_KBYTES)
    return conf


def members_topic_name(topic: str) -> str:
    """The coordination topic of the gateways publishing ``topic``."""
    return f"{topic}.members"


def vbuckets_of(partitions: Iterable[int], num_partitions: int, num_vbuckets: int) -> list[int]:
    """The vbuckets a member owns when it is assigned ``partitions`` of a T-partition coordination topic:
    vbucket v belongs to partition ``v % T``."""
    mine = set(partitions)
    return [vb for vb in range(num_vbuckets) if vb % num_partitions in mine]


def ensure_members_topic(client_config: dict[str, Any], topic: str, partitions: int,
                         timeout: float = 30.0) -> int:
    """Create the coordination topic with ``partitions`` partitions unless it exists; returns its partition
    count (an existing topic keeps its own: every member must compute the same vbucket -> partition rule)."""
    name = members_topic_name(topic)
    admin = admin_client(client_config)
    md = admin.list_topics(timeout=timeout)
    have = md.topics.get(name)
    if have is None or have.error is not None:
        fut = admin.create_topics([NewTopic(name, partitions, 1)], operation_timeout=timeout)[name]
        try:
            fut.result(timeout)
        except KafkaException as e:
            if "TOPIC_ALREADY_EXISTS" not in str(e):
                raise BrokerError(f"cannot create the coordination topic {name}: {e}") from e
        deadline = time.monotonic() + timeout
        while True:
            have = admin.list_topics(name, timeout=timeout).topics.get(name)
            if have is not None and have.error is None and have.partitions:
                break
            if time.monotonic() > deadline:
                raise BrokerError(f"the coordination topic {name} did not appear")
            time.sleep(0.1)
    return len(have.partitions)


Change = Literal["assign", "revoke"]


@dataclass
class _Request:
    kind: Change
    vbuckets: list[int]
    #: for "assign": the recovered positions (built on the membership thread)
    payload: Any = None
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class VBucketHandoff:
    """Thread-safe hand-off of vbucket changes from the membership thread to the publisher's loop.

    The membership thread calls :meth:`assign` / :meth:`revoke`, which block until the loop served them (or the
    handoff is closed); the loop calls :meth:`serve` between pumps, never blocking:

    * ``start_revoke(vbs)``: stop streaming ``vbs`` (called once); ``released(vbs)``: True once their in-flight
      records are acknowledged and their checkpoints written -- the revoke then completes;
    * ``add(payload)``: resume the vbuckets from the recovered positions.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: list[_Request] = []
        #: a revoke being released: the loop checks it every serve()
        self._releasing: _Request | None = None
        self.closed = False

    def _post(self, req: _Request, timeout: float | None) -> None:
        with self._lock:
            if self.closed:
                return
            self._queue.append(req)
        if not req.done.wait(timeout):
            raise GatewayError(f"the publisher did not {req.kind} vbuckets {req.vbuckets[:8]}... in {timeout} s")
        if req.error is not None:
            raise req.error

    def assign(self, vbuckets: list[int], payload: Any, timeout: float | None = None) -> None:
        self._post(_Request("assign", vbuckets, payload), timeout)

    def revoke(self, vbuckets: list[int], timeout: float | None = None) -> None:
        self._post(_Request("revoke", vbuckets), timeout)

    @property
    def pending(self) -> bool:
        return bool(self._queue) or self._releasing is not None

    def serve(self, start_revoke: Callable[[list[int]], None], released: Callable[[list[int]], bool],
              add: Callable[[Any], None]) -> None:
        """On the loop's thread: advance the current change (never waits)."""
        while True:
            req = self._releasing
            if req is not None:
                try:
                    ok = released(req.vbuckets)
                except BaseException as e:  # handed to the waiting thread
                    req.error, ok = e, True
                if not ok:
                    return
                self._releasing = None
                req.done.set()
            with self._lock:
                if not self._queue:
                    return
                req = self._queue.pop(0)
            try:
                if req.kind == "revoke":
                    start_revoke(req.vbuckets)
                    self._releasing = req
                    continue
                add(req.payload)
            except BaseException as e:  # handed to the waiting thread
                req.error = e
            req.done.set()

    def close(self) -> None:
        """Nothing more is served: every waiting change returns (the process is stopping)."""
        with self._lock:
            self.closed = True
            reqs, self._queue = self._queue, []
        if self._releasing is not None:
            reqs.append(self._releasing)
            self._releasing = None
        for r in reqs:
            r.done.set()


class Membership:
    """One gateway process's membership of the group ``group`` on ``<topic>.members``.

    ``recover(vbuckets)`` runs on the membership thread when vbuckets are assigned (blocking Kafka reads: the
    checkpoint topic and the partition tail, gateway/resume.py) and returns what the loop's ``add`` gets."""

    def __init__(self, client_config: dict[str, Any], topic: str, group: str, num_vbuckets: int,
                 handoff: VBucketHandoff, recover: Callable[[list[int]], Any], *,
                 partitions: int | None = None, session_timeout_ms: int = DEFAULT_SESSION_TIMEOUT_MS,
                 member_name: str = "dcpgw", change_timeout: float | None = 120.0, fail_stop: bool = False,
                 join_timeout_s: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        if not group:
            raise GatewayError("the group name must not be empty")
        self.client_config = client_config
        self.topic = topic
        self.group = group
        self.num_vbuckets = num_vbuckets
        self.handoff = handoff
        self.recover = recover
        self.partitions = partitions or min(num_vbuckets, DEFAULT_MEMBER_PARTITIONS)
        self.session_timeout_ms = session_timeout_ms
        self.member_name = member_name
        self.change_timeout = change_timeout
        #: vbuckets this member owns now (written by the membership thread)
        self.owned: list[int] = []
        #: rebalances seen (assignments received)
        self.generations = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._consumer: Consumer | None = None
        #: fencing (docs/scale-out.md "Fencing"): a fail-stop member confirms its generation every tenth of the
        #: session timeout (a synchronous offset commit of its coordination partitions, which the coordinator
        #: refuses from an expelled member) and may publish only until ``lease_until`` (``clock`` time); losing
        #: the assignment (``on_lost``) or a refused commit sets ``fenced`` instead of releasing cleanly
        self.fail_stop = fail_stop
        self.clock = clock
        self.lease_s = session_timeout_ms / 1000 * LEASE_FRACTION
        self.check_interval_s = max(0.1, session_timeout_ms / 10_000)
        self.lease_until = 0.0
        self.fenced: str | None = None
        self._assigned: list[int] = []
        self._next_check = 0.0
        #: a member without an assignment gives up after this long (docs/kafka-compat.md "noida-db: consumer
        #: groups": a coordinator that never expels a dead member never completes the next join); by default the
        #: bound a conforming coordinator keeps: the rebalance timeout plus the session timeout
        self.join_timeout_s = (join_timeout_s if join_timeout_s is not None
                               else (REBALANCE_TIMEOUT_MS + session_timeout_ms) / 1000)
        #: ``clock`` time since which this member waits for an assignment (None: it has one)
        self.waiting_since: float | None = None

    def start(self) -> None:
        self.partitions = ensure_members_topic(self.client_config, self.topic, self.partitions)
        self._thread = threading.Thread(target=self._run, name=f"dcpgw-membership-{self.group}", daemon=True)
        self._thread.start()

    def _vbuckets(self, parts: list[TopicPartition]) -> list[int]:
        return vbuckets_of((p.partition for p in parts if p.partition is not None), self.partitions,
                           self.num_vbuckets)

    def _on_assign(self, c: Consumer, parts: list[TopicPartition]) -> None:
        vbs = self._vbuckets(parts)
        self.generations += 1
        self.waiting_since = None
        # the SyncGroup answer that carried this assignment confirms the generation
        self.lease_until = self.clock() + self.lease_s
        self._assigned = [p.partition for p in parts if p.partition is not None]
        log.info("group %s: assigned %d coordination partitions, %d vbuckets (member %s)", self.group, len(parts),
                 len(vbs), self.member_name)
        if vbs:
            try:
                payload = self.recover(vbs)
                if self.fail_stop:
                    self._confirm(c)  # recovery may have taken a while: renew the lease before publishing
                    if self.fenced is not None:
                        return
                self.handoff.assign(vbs, payload, self.change_timeout)
            except BaseException as e:
                self.error = e
                log.exception("group %s: could not resume vbuckets", self.group)
                self._stop.set()
                return
        self.owned = vbs

    def _on_revoke(self, c: Consumer, parts: list[TopicPartition]) -> None:
        owned = set(self.owned)
        vbs = [vb for vb in self._vbuckets(parts) if vb in owned]
        log.info("group %s: %d vbuckets revoked", self.group, len(vbs))
        self.waiting_since = self.clock()  # eager protocol: a re-join follows
        if vbs:
            try:
                self.handoff.revoke(vbs, self.change_timeout)
            except BaseException as e:
                self.error = e
                log.exception("group %s: could not release vbuckets", self.group)
                self._stop.set()
        self.owned = []
        self._assigned = []

    def _on_lost(self, c: Consumer, parts: list[TopicPartition]) -> None:
        # The group expelled this member (it was silent longer than the session timeout): others may already
        # stream these vbuckets. Stop at once (docs/scale-out.md "Fencing").
        log.warning("group %s: this member lost its assignment (session timeout)", self.group)
        self.waiting_since = self.clock()
        if self.fail_stop:
            self._fence("the group expelled this member (session timeout): its assignment is lost")
            return
        self._on_revoke(c, parts)

    def _fence(self, why: str) -> None:
        if self.fenced is None:
            self.fenced = why
            log.error("group %s: fenced: %s", self.group, why)
        self.lease_until = 0.0
        self.owned = []

    def _confirm(self, c: Consumer) -> bool:
        """Generation check: commit offset 0 of this member's coordination partitions synchronously. The
        coordinator accepts it only from a member of the current generation (Kafka and Tansu answer
        ``UNKNOWN_MEMBER_ID`` / ``ILLEGAL_GENERATION`` to an expelled one; ``REBALANCE_IN_PROGRESS`` still
        means a known member, whose eager revoke will follow), so an accepted commit renews the lease from
        the moment it was sent. True when renewed."""
        if not self._assigned:
            return False
        t0 = self.clock()
        name = members_topic_name(self.topic)
        try:
            done = c.commit(offsets=[TopicPartition(name, p, 0) for p in self._assigned], asynchronous=False)
            codes = [tp.error.code() for tp in done or [] if tp.error is not None]
        except KafkaException as e:
            err = e.args[0] if e.args and isinstance(e.args[0], KafkaError) else None
            codes = [err.code() if err is not None else KafkaError._FAIL]
        expelled = [code for code in codes if code in _EXPELLED]
        if expelled:
            self._fence(f"the group refused this member's generation ({KafkaError(expelled[0]).name()})")
            return False
        if any(code != KafkaError.REBALANCE_IN_PROGRESS for code in codes):
            log.debug("group %s: generation check failed (%s); the lease is not renewed", self.group, codes)
            return False
        self.lease_until = t0 + self.lease_s
        return True

    def _check_join(self) -> None:
        """A member must never run without an assignment silently: raise once the join has waited longer than
        ``join_timeout_s`` (docs/scale-out.md "Brokers")."""
        since = self.waiting_since
        if since is not None and self.clock() - since > self.join_timeout_s:
            raise GatewayError(
                f"group {self.group}: no assignment from the group coordinator in {self.join_timeout_s:.0f} s: "
                "its rebalance never completed (a coordinator that does not expel a member silent past "
                "session.timeout.ms, e.g. noida-db, docs/kafka-compat.md); this member publishes nothing")

    def lease_expired(self) -> bool:
        """A fail-stop member must stop publishing: fenced, or its generation unconfirmed past the lease."""
        return self.fenced is not None or self.clock() >= self.lease_until

    def _run(self) -> None:
        try:
            c = consumer(self.client_config, {
                "partition.assignment.strategy": "roundrobin",
                "session.timeout.ms": self.session_timeout_ms,
                "heartbeat.interval.ms": max(100, self.session_timeout_ms // 10),
                "enable.auto.commit": False,
                "enable.auto.offset.store": False,
                "auto.offset.reset": "latest",
                "max.poll.interval.ms": REBALANCE_TIMEOUT_MS,
                "client.id": self.member_name,
            }, group_id=self.group)
            self._consumer = c
            c.subscribe([members_topic_name(self.topic)], on_assign=self._on_assign, on_revoke=self._on_revoke,
                        on_lost=self._on_lost)
            self.waiting_since = self.clock()
            while not self._stop.is_set():
                c.poll(0.1)  # the coordination topic holds no records: this serves the group protocol
                self._check_join()
                if self.fail_stop and self.owned and self.fenced is None:
                    now = self.clock()
                    # every tenth of the session timeout, and at once when the loop waits for the lease (e.g. after
                    # a long hand-over that kept this thread in a callback)
                    if now >= self._next_check or now >= self.lease_until:
                        self._next_check = now + self.check_interval_s
                        self._confirm(c)
        except BaseException as e:  # reported through self.error
            self.error = e
            log.exception("group %s: membership failed", self.group)
        finally:
            c2 = self._consumer
            if c2 is not None:
                # leaving the group revokes this member's partitions first (on_revoke: released cleanly)
                with contextlib.suppress(KafkaException, RuntimeError):
                    c2.close()

    def stop(self) -> None:
        """Leave the group (the vbuckets are released first, so the loop must keep serving meanwhile)."""
        self._stop.set()

    def join(self, timeout: float = 60.0) -> bool:
        t = self._thread
        if t is not None:
            t.join(timeout)
            return not t.is_alive()
        return True

    @property
    def stopping(self) -> bool:
        """:meth:`stop` was called, or the membership ended on an error."""
        return self._stop.is_set()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()
