"""hybrid benchmarks (see benchmarks/README.md)."""
