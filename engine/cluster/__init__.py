"""The cluster (ns_server's part): the revisioned vbucket map, the cluster manager (failover, observe), the
rebalance, map recovery from the nodes' stores, and the in-process :class:`~engine.cluster.local.Cluster`
(docs/cluster.md)."""
