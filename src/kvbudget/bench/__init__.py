"""Benchmarks: latency, memory and scaling (:mod:`.grid`), the memory-bandwidth bound
(:mod:`.bandwidth`), and the side-by-side run against kvpress (:mod:`.peer`)."""
