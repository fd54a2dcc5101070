"""The key-value core (kv_engine ``engines/ep/src``: ``Item``, ``HashTable``/``VBucket``, ``CheckpointManager``,
the KVStore, the durability monitors a vbucket owns, and the bucket's background tasks). Never imports
``engine.network`` (docs/engine.md "Layout")."""
