"""Embedded Couchbase-style DCP engine: vbuckets, checkpoints, durable storage, failover logs, DCP streams.

Quick use::

    from engine import Bucket, BucketConfig
    bucket = Bucket(BucketConfig(data_dir=Path("data")))
    token = bucket.set("k", b'{"a": 1}').token
    producer = bucket.dcp_producer("my-consumer")
    producer.stream_request(token.vbucket, 0)
    for message in producer.step():
        ...
"""

# First: decides whether the engine's compiled modules or their sources run (engine/compiled.py).
import engine.compiled  # noqa: F401

# isort: split
from engine.bucket import Bucket, open_bucket
from engine.config import BucketConfig
from engine.dcp.producer import DcpProducer
from engine.dcp.stream import (
    MAX_SEQNO,
    Message,
    SnapshotFlags,
    SnapshotMarker,
    StreamEnd,
    StreamEndReason,
    StreamFlags,
)
from engine.exceptions import (
    DcpGatewayError,
    EngineError,
    InvalidArgument,
    KeyExists,
    KeyNotFound,
    NotMyVBucket,
    NotStored,
    RangeError,
    RollbackRequired,
    StateCasMismatch,
    Status,
    TemporaryFailure,
    ValueTooLarge,
)
from engine.kv.item import Datatype, Item, Op
from engine.kv.vbucket import GetResult, MutationResult, MutationToken, VBucketState, vbucket_of
from schemas.failover_log import FailoverEntry, FailoverLog

__all__ = [
    "MAX_SEQNO",
    "Bucket",
    "BucketConfig",
    "Datatype",
    "DcpGatewayError",
    "DcpProducer",
    "EngineError",
    "FailoverEntry",
    "FailoverLog",
    "GetResult",
    "InvalidArgument",
    "Item",
    "KeyExists",
    "KeyNotFound",
    "Message",
    "MutationResult",
    "MutationToken",
    "NotMyVBucket",
    "NotStored",
    "Op",
    "RangeError",
    "RollbackRequired",
    "SnapshotFlags",
    "SnapshotMarker",
    "StateCasMismatch",
    "Status",
    "StreamEnd",
    "StreamEndReason",
    "StreamFlags",
    "TemporaryFailure",
    "VBucketState",
    "ValueTooLarge",
    "open_bucket",
    "vbucket_of",
]
