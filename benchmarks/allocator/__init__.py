"""allocator benchmarks (see benchmarks/README.md)."""
