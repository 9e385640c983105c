"""peers benchmarks (see benchmarks/README.md)."""
