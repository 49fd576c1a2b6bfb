"""FastSAC benchmarks: update ladder, throughput, learning curves, hpcrl vs the real CleanRL."""
