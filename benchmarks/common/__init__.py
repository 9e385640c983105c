"""common benchmarks (see benchmarks/README.md)."""
