"""The gateway's Kafka layer: the one place that builds producers, consumers and admin clients."""
