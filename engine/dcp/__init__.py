"""DCP (kv_engine ``engines/ep/src/dcp``): the producer, active streams fed by memory (checkpoint cursors) and by
the backfill component (disk), takeover streams, the connection map and the replica side (consumer / passive
streams). Never imports ``engine.network`` (docs/engine.md "Layout")."""
