"""Shared pieces of the benchmark suite: timing, the JSON schema, report, compare, paths."""
