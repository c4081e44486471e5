"""Per-op benchmarks: `python3 -m benchmarks.ops.bench_<family> --json PATH`."""
