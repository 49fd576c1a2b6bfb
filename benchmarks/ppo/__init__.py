"""Detached-PPO benchmarks: throughput, weight publish, a frozen maker."""
