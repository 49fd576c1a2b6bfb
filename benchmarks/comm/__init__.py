"""Communication benchmarks: collectives sweep, alpha-beta cost model, scaling sweeps."""
