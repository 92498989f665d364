"""Throughput benchmarks (`python -m trainer bench`)."""
