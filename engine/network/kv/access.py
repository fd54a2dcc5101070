"""Which role each KV opcode needs (Couchbase RBAC privileges mapped onto the product's roles;
docs/kv-protocol.md "Authorization", docs/security.md "Roles").

``admin`` may do everything; otherwise a request needs one of the roles listed for its opcode (kv_engine checks
a privilege per opcode: Read -> ``data_reader``, Upsert / Insert / Delete -> ``data_writer``, the
``*_WITH_META`` writes -> ``replication_target`` (XDCR inbound), MetaRead (GET_META, OBSERVE_SEQNO) -> any of
the data roles). Opcodes answered before authentication (HELLO, SASL, GET_ERROR_MAP, NOOP) need nothing; every
other opcode needs an authenticated user (EACCESS otherwise) and, when it touches documents, a selected bucket
(NO_BUCKET otherwise). A new opcode is added here with its roles, in one line.
"""

from __future__ import annotations

from typing import Final

from engine.network.kv.opcodes import ClientOpcode as Op
from engine.security.roles import Role

_R: Final = (Role.DATA_READER,)
_W: Final = (Role.DATA_WRITER,)
_META_READ: Final = (Role.DATA_READER, Role.DATA_WRITER, Role.DCP_READER, Role.REPLICATION_TARGET)
_ANY: Final = tuple(Role)

#: opcodes a connection may send before it authenticated
BEFORE_AUTH: Final = frozenset({Op.HELLO, Op.SASL_LIST_MECHS, Op.SASL_AUTH, Op.SASL_STEP, Op.GET_ERROR_MAP,
                                Op.NOOP})

#: opcode -> the roles any one of which allows it (admin always does); bucket-level opcodes only
NEEDS: Final[dict[int, tuple[Role, ...]]] = {
    Op.GET: _R,
    Op.GET_REPLICA: _R,
    Op.GET_LOCKED: _R,
    Op.UNLOCK_KEY: _R,
    Op.GAT: _W,  # and _R: see BOTH
    Op.SET: _W,
    Op.ADD: _W,
    Op.REPLACE: _W,
    Op.DELETE: _W,
    Op.APPEND: _W,
    Op.PREPEND: _W,
    Op.INCREMENT: _W,  # and _R: see BOTH
    Op.DECREMENT: _W,
    Op.TOUCH: _W,
    Op.OBSERVE_SEQNO: _META_READ,
    Op.GET_META: _META_READ,
    Op.SET_WITH_META: (Role.REPLICATION_TARGET,),
    Op.ADD_WITH_META: (Role.REPLICATION_TARGET,),
    Op.DEL_WITH_META: (Role.REPLICATION_TARGET,),
    Op.GET_CLUSTER_CONFIG: _ANY,
    Op.SELECT_BUCKET: _ANY,
}

#: opcodes that read as well as write (the answer carries the document's value): kv_engine checks both the
#: Read and the Upsert privilege, so they need ``data_reader`` too
BOTH: Final[dict[int, tuple[Role, ...]]] = {Op.GAT: _R, Op.INCREMENT: _R, Op.DECREMENT: _R}

#: opcodes that need a selected bucket (NO_BUCKET otherwise)
NEEDS_BUCKET: Final = frozenset(NEEDS) - {Op.GET_CLUSTER_CONFIG, Op.SELECT_BUCKET}


def allowed(roles: frozenset[Role], opcode: int) -> bool:
    """Whether a user with ``roles`` may send ``opcode`` (an opcode absent from :data:`NEEDS` needs only an
    authenticated user)."""
    if Role.ADMIN in roles:
        return True
    need = NEEDS.get(opcode)
    if need is None:
        return True
    also = BOTH.get(opcode, ())
    return any(r in roles for r in need) and (not also or any(r in roles for r in also))
