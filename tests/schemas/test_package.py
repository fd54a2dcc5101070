"""The schemas package as a contract: what it loads, what depends on it, and the ONE position type with its
serialization (docs/record-format.md, docs/client.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import engine.exceptions
import gateway.exceptions
from connectors.client.replay import ConsumerPosition
from gateway.resume import PublishPosition
from schemas import errors
from schemas.codec import SCHEMA_FINGERPRINTS, load_schema, parsed_schema, schema_fingerprint
from schemas.failover_log import FailoverEntry
from schemas.position import VBucketPosition

ROOT = Path(__file__).resolve().parents[2]


def _modules_after_import(*modules: str) -> set[str]:
    code = ("import sys\n" + "".join(f"import {m}\n" for m in modules)
            + "print(' '.join(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_connectors_import_nothing_of_gateway_or_engine() -> None:
    loaded = _modules_after_import("connectors.client.consumer", "connectors.client.state", "connectors.replicate",
                                   "connectors.spark.core", "connectors.spark.native")
    assert "schemas.codec" in loaded
    assert not {m for m in loaded if m.split(".")[0] in ("gateway", "engine")}


def test_schemas_import_nothing_of_the_other_packages_and_load_no_schema_at_import() -> None:
    code = ("import sys\nimport schemas.codec, schemas.position, schemas.topics\n"
            "print(schemas.codec.parsed_schema.cache_info().currsize,"
            " sorted({m.split('.')[0] for m in sys.modules} & {'engine', 'gateway', 'connectors'}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.split(None, 1) == ["0", "[]\n"]


def test_the_fingerprint_constants_are_the_schema_files() -> None:
    for fp, name in SCHEMA_FINGERPRINTS.items():
        assert schema_fingerprint(parsed_schema(name)) == fp
        assert schema_fingerprint(load_schema(name.rsplit(".", 1)[1].replace("Event", "_event").lower())) == fp


def test_the_exceptions_of_the_other_packages_are_the_contracts() -> None:
    assert engine.exceptions.DcpGatewayError is errors.DcpGatewayError
    assert engine.exceptions.InvalidArgument is errors.InvalidArgument
    assert issubclass(engine.exceptions.InvalidArgument, engine.exceptions.EngineError)
    assert gateway.exceptions.RecordFormatError is errors.RecordFormatError
    assert gateway.exceptions.UnknownSchemaError is errors.UnknownSchemaError


# ---------------------------------------------------------------------------------------------------- positions
_u64 = st.integers(0, 2**64 - 1)
_log = st.lists(st.builds(FailoverEntry, st.integers(1, 2**48 - 1), _u64), max_size=4)


@given(vb=st.integers(0, 1023), vbuuid=_u64, seqno=_u64, snap=st.tuples(_u64, _u64), log=_log,
       offset=st.integers(-1, 2**62))
def test_one_serialization_round_trips(vb: int, vbuuid: int, seqno: int, snap: tuple[int, int],
                                       log: list[FailoverEntry], offset: int) -> None:
    base = VBucketPosition(vb, vbuuid, seqno, snap[0], snap[1], log)
    assert VBucketPosition.from_json(base.to_json()) == base
    assert base.to_dict()["failover_log"] == [[e.vbuuid, e.seqno] for e in log]
    consumer = ConsumerPosition(vb, vbuuid, seqno, snap[0], snap[1], log, offset)
    assert ConsumerPosition.from_json(consumer.to_json()) == consumer
    assert consumer.applied_seqno == seqno
    publish = PublishPosition(vb, vbuuid, seqno, snap[0], snap[1], log, boundary=snap[0], offset=offset,
                              boundaries=[1, 2], pending_rollback=True)
    assert PublishPosition.from_json(publish.to_json()) == publish
    # the extensions serialize the base's keys the base's way
    for p in (consumer, publish):
        d = p.to_dict()
        assert {k: d[k] for k in base.to_dict()} == VBucketPosition.to_dict(p)


def test_checkpoints_written_before_the_one_position_type_still_load() -> None:
    # gateway/position.py's PublishPosition.to_json, as the compacted checkpoint topic holds it
    old = (b'{"vbucket":3,"seqno":120,"snap_start":100,"snap_end":130,"failover_log":[[77,90],[5,0]],'
           b'"vbuuid":77,"boundary":100,"offset":4711,"boundaries":[40,100],"pending_rollback":false}')
    p = PublishPosition.from_json(old)
    assert p == PublishPosition(3, 77, 120, 100, 130, [FailoverEntry(77, 90), FailoverEntry(5, 0)],
                                boundary=100, offset=4711, boundaries=[40, 100], pending_rollback=False)
    assert p.request_args()["vbuuid"] == 77


def test_consumer_state_written_before_the_one_position_type_still_loads() -> None:
    # connectors/client/replay.py's VBucketState.to_dict, as dcp_consumer_state rows and Spark offsets hold it
    old = {"vbucket": 0, "vbuuid": 1530, "applied_seqno": 812, "snap_start": 800, "snap_end": 812, "offset": 99,
           "failover_log": [[1530, 700], [12, 0]]}
    p = ConsumerPosition.from_dict(json.loads(json.dumps(old)))
    assert p == ConsumerPosition(0, 1530, 812, 800, 812, [FailoverEntry(1530, 700), FailoverEntry(12, 0)], 99)
    assert p.applied_seqno == 812
    # engine/position.py's StreamPosition.to_dict (no vbuuid: the newest failover entry's)
    q = VBucketPosition.from_dict({"vbucket": 2, "seqno": 5, "snap_start": 5, "snap_end": 9,
                                   "failover_log": [[44, 0]]})
    assert (q.vbuuid, q.seqno, q.in_complete_snapshot) == (44, 5, False)


def test_a_malformed_position_is_refused() -> None:
    with pytest.raises(KeyError):
        VBucketPosition.from_dict({"vbucket": 1, "snap_start": 0, "snap_end": 0, "failover_log": []})
    with pytest.raises(errors.InvalidArgument):
        VBucketPosition.from_dict({"vbucket": 1, "seqno": 0, "snap_start": 0, "snap_end": 0,
                                   "failover_log": [[-1, 0]]})
