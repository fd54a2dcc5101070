"""Benchmarks of dcp-gateway (engine throughput, end-to-end latency, memory)."""
