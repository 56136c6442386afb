"""The sections of `benchmarks/gpu_bench.py`, one module each, over one timing harness (`timing`)."""
