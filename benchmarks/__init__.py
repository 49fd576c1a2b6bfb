"""hpcrl benchmark suite: ``python -m benchmarks [--quick] [--out DIR]`` (see benchmarks/__main__.py).

Modules: collectives (nccl-tests style sweep + FastSAC flat-gradient path), cost_model (alpha-beta fit
and projection to 1024 GPUs), report (report.md), compare (regression gate), schema (JSON checks).
The older per-issue scripts (op_kernels.py, sac_throughput.py, ppo_throughput.py) are run as subprocesses
and their JSON is wrapped in the common header. A script's folder comes first on its sys.path: no module
here may take the name of a package a benchmark imports (kernels.py shadowed the `kernels` package that
transformers imports).
"""
