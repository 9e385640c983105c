"""The scripts that print the tables of docs/benchmarks.md, one folder per family; run
each as ``python -m benchmarks.FAMILY.SCRIPT`` from the repository root (see
benchmarks/README.md)."""
