"""decode benchmarks (see benchmarks/README.md)."""
