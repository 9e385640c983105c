"""parallel benchmarks (see benchmarks/README.md)."""
