"""speculative benchmarks (see benchmarks/README.md)."""
