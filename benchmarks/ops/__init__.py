"""Kernel and replay-sampling benchmarks of hpcrl._C."""
