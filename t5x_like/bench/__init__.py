"""Benchmarks behind `t5x-like bench` (data now; model and decode steps later)."""
