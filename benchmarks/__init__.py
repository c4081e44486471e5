"""Benchmarks of qwen38: per-op (benchmarks.ops) and whole-model runs; results JSON under results/."""
