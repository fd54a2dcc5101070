"""Scale-out by group membership on noida-db, the second Kafka-API server here (docs/kafka-compat.md "noida-db:
consumer groups", docs/scale-out.md "Brokers").

noida-db 0.2.3 serves FindCoordinator, JoinGroup, SyncGroup, Heartbeat, LeaveGroup and OffsetCommit with the
eager ``roundrobin`` assignor, but it never expels a member that went silent past its ``session.timeout.ms``,
and it answers a live member's OffsetCommit with ``ILLEGAL_GENERATION`` (Kafka: ``REBALANCE_IN_PROGRESS``) once
another member starts a join. So the issue's scenario (kill -9 one of two members, the other takes its
vbuckets) cannot pass on it: these tests pin what the gateway does instead -- it never publishes without a
valid assignment, and says so in one error:

* a join behind a killed member never completes: the member gives up after its join timeout with an error
  naming the cause (on the embedded broker the same join completes once the dead member is expelled);
* a second ``dcpgw gateway`` joining fences the first (the coordinator refused its generation): it exits with
  status 2 and one ``error:`` line; its leaving may fence the second the same way; the topic still passes the
  invariants checker with no duplicate.

Skipped, with the reason, where noida-db is not installed or cannot run here."""

from __future__ import annotations

import select
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.network.process_cluster import ProcessCluster
from gateway.broker import Broker
from gateway.exceptions import GatewayError
from gateway.invariants import check_partition, data_positions
from gateway.kafka.membership import Membership, VBucketHandoff, ensure_members_topic, members_topic_name
from tests.engine.process_model import actives_state
from tests.gateway.kafka_util import read_topic
from tests.gateway.processes import Churn, Member, check_member_topic, member_env, noida_broker, wait_for

NVB = 16

#: a bare group member in a process of its own: joins, says "assigned", then polls until it is killed
_BARE_MEMBER = """
import sys
from confluent_kafka import Consumer
c = Consumer({"bootstrap.servers": sys.argv[1], "group.id": sys.argv[2], "session.timeout.ms": 6000,
              "heartbeat.interval.ms": 600, "partition.assignment.strategy": "roundrobin",
              "enable.auto.commit": False})
c.subscribe([sys.argv[3]], on_assign=lambda c, p: print("assigned", len(p), flush=True))
while True:
    c.poll(0.1)
"""


@pytest.fixture(scope="module")
def noida() -> Iterator[Broker]:
    with noida_broker() as broker:
        yield broker


@pytest.fixture(params=["embedded", "noida"])
def group_broker(request: pytest.FixtureRequest) -> tuple[str, Broker]:
    """(name, broker): the suite's broker (the embedded Tansu one here), or noida-db."""
    broker: Broker = request.getfixturevalue("kafka_broker" if request.param == "embedded" else "noida")
    return request.param, broker


def test_join_behind_a_killed_member_completes_only_where_the_coordinator_expels_it(
        group_broker: tuple[str, Broker]) -> None:
    """A bare member joins and is killed with SIGKILL; a gateway membership then joins the same group. The
    embedded broker expels the dead member after its 6 s session timeout (Kafka's minimum) and assigns every
    coordination partition to the gateway; noida-db never does, and the gateway's membership ends on its join timeout with
    an error naming the cause, having owned nothing."""
    name, broker = group_broker
    conf = {"bootstrap.servers": broker.bootstrap_servers}
    topic = f"nj{uuid.uuid4().hex[:8]}"
    group = f"g-{uuid.uuid4().hex[:6]}"
    assert ensure_members_topic(conf, topic, 4) == 4
    bare = subprocess.Popen([sys.executable, "-c", _BARE_MEMBER, broker.bootstrap_servers, group,
                             members_topic_name(topic)], stdout=subprocess.PIPE, text=True)
    try:
        assert bare.stdout is not None
        assert select.select([bare.stdout], [], [], 30)[0], "the bare member never got an assignment"
        assert bare.stdout.readline().startswith("assigned 4"), "the bare member never got an assignment"
    finally:
        bare.kill()
        bare.wait(10)
    handoff = VBucketHandoff()
    m = Membership(conf, topic, group, NVB, handoff, lambda vbs: vbs, session_timeout_ms=6000,
                   change_timeout=5, join_timeout_s=15)
    m.start()
    try:
        deadline = time.monotonic() + 40  # "did not hang" bound
        while m.error is None and not m.owned and time.monotonic() < deadline:
            handoff.serve(lambda vbs: None, lambda vbs: True, lambda payload: None)
            time.sleep(0.05)
        if name == "embedded":
            assert m.error is None, m.error
            assert m.owned == list(range(NVB))
        else:
            assert isinstance(m.error, GatewayError), m.error
            assert "no assignment from the group coordinator" in str(m.error)
            assert m.generations == 0 and m.owned == []
    finally:
        m.stop()
        deadline = time.monotonic() + 30
        while m.alive and time.monotonic() < deadline:
            handoff.serve(lambda vbs: None, lambda vbs: True, lambda payload: None)
            time.sleep(0.05)
        handoff.close()


@pytest.mark.slow
def test_second_member_joining_fences_the_first_and_no_member_runs_silently(noida: Broker, tmp_path: Path) -> None:
    """Two ``dcpgw gateway`` members on noida-db, one after the other, while documents are written: the
    coordinator refuses the first member's generation as soon as the second joins, so the first stops for good
    (status 2, one ``error: fenced`` line naming ``ILLEGAL_GENERATION``). Its leaving starts one more rebalance,
    which may fence the second in turn (the same race, docs/kafka-compat.md "noida-db: consumer groups"): the
    second either exits the same way or streams all 16 vbuckets and its topic replays to the engine. Either way
    every partition passes the invariants checker with no duplicate."""
    c = ProcessCluster.start(tmp_path / "engine", nodes=1, replicas=0, num_vbuckets=NVB, checkpoint_max_items=5)
    prefix = f"nso{uuid.uuid4().hex[:8]}"
    topic = f"{prefix}.default"
    env = member_env(noida, prefix)
    group = f"g-{uuid.uuid4().hex[:6]}"
    load = Churn(c)

    def fenced_once(m: Member) -> None:
        log = m.log.read_text()
        assert m.proc.returncode == 2, log[-3000:]
        errors = [line for line in log.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "fenced" in errors[0] and "ILLEGAL_GENERATION" in errors[0], log[-3000:]

    source = ",".join(f"{n.host}:{n.port}" for n in c.nodes.values())
    a = Member(env, source, group, tmp_path / "a.log")
    members = [a]
    try:
        wait_for(lambda: a.assignments() == [NVB], "the first member streams every vbucket", 60, load, members)
        t_end = time.monotonic() + 2
        wait_for(lambda: time.monotonic() > t_end, "load", 10, load)
        b = Member(env, source, group, tmp_path / "b.log")
        members = [a, b]
        wait_for(lambda: a.proc.poll() is not None, "the first member stops", 60, load, members)
        fenced_once(a)
        t_end = time.monotonic() + 3 * 6  # several generation checks of b after a left
        wait_for(lambda: time.monotonic() > t_end or b.proc.poll() is not None, "b settles", 30, load, members)
        assert load.written > 50
        if b.proc.poll() is not None:
            fenced_once(b)
            recs = read_topic(noida.bootstrap_servers, topic)
            for part in range(8):
                mine = [(o, r) for p, o, r in recs if p == part]
                check_partition(mine)
                dup = [k for k, n in data_positions(mine).items() if n > 1]
                assert not dup, dup[:5]
        else:
            assert b.assignments()[-1] == NVB, b.log.read_text()[-3000:]
            check_member_topic(noida, topic, actives_state(c), members)
    finally:
        for m in members:
            m.stop()
        c.close(clean=False)
