"""The KV port: the memcached binary protocol as Couchbase Server serves it to the official SDKs
(docs/kv-protocol.md).

One component per concept: :mod:`.opcodes` (client opcodes and statuses the port adds to the node protocol),
:mod:`.features` (HELLO negotiation), :mod:`.sasl` (SCRAM-SHA512/256/1 and PLAIN servers against the user store),
:mod:`.error_map` (GET_ERROR_MAP), :mod:`.cluster_config` (the injected cluster config provider; the single-node
one), :mod:`.access` (the role each opcode needs), :mod:`.session` (one connection's state), :mod:`.documents`
(document operations against the engine) and :mod:`.frontend` (the listener on the event loop). The framing is
engine/network/protocol.py's.
"""
