"""Benchmark runner, reports and reference workloads (``lowband bench``, ``lowband demo``)."""
