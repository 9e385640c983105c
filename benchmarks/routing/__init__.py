"""routing benchmarks (see benchmarks/README.md)."""
