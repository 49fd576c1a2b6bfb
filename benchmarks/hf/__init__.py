"""Benchmarks of the Hugging Face (RLHF) workload."""
