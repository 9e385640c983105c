"""robustness benchmarks (see benchmarks/README.md)."""
