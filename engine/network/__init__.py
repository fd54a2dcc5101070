"""The network edges: the binary protocol, the asyncio node server (``python -m engine.network.server``), the
remote clients of a node and the process cluster that spawns and kills node processes (docs/cluster.md
"Node processes"). The engine core (``engine.kv``, ``engine.dcp``) never imports this package."""
