"""hpcrl benchmark suite: ``python -m benchmarks [--quick] [--out DIR]`` (see benchmarks/__main__.py).

Scripts by topic (index of claims, commands and JSON: benchmarks/README.md): common (timing, schema,
report, compare), comm (collectives, cost_model, scaling), sac, ppo, hf, ops, peers. The suite's older
steps (ops/op_kernels.py, sac/sac_throughput.py, ppo/ppo_throughput.py, ppo/weight_publish.py) run as
subprocesses and their JSON is wrapped in the common header. A script's folder comes first on its sys.path:
no module in a topic folder may take the name of a package a benchmark imports (kernels.py shadowed the
`kernels` package that transformers imports).
"""
