"""Run-level pieces, between the collectives (:mod:`hpcrl.comm`) and the algorithms (:mod:`hpcrl.sac`,
:mod:`hpcrl.ppo`): what one run owns on disk and prints.

- :mod:`~hpcrl.run.rundir` — the run directory and its lock (:func:`claim`), identity, outcome, reuse rules
- :mod:`~hpcrl.run.checkpoint` — atomic checkpoints: manifest, write, restore, rows saved beside them
- :mod:`~hpcrl.run.metrics` — ``metrics.jsonl`` + TensorBoard (+ W&B) through :class:`RunLogger`
- :mod:`~hpcrl.run.progress` — the progress line and the closing summary
- :mod:`~hpcrl.run.cli` — flags to typed configs (tyro), exit codes; :mod:`~hpcrl.run.config_file` — ``--config``

The names below load on first use, so that an entry point importing :mod:`hpcrl.run.cli` to refuse a bad
flag does not import torch.
"""

from __future__ import annotations

from hpcrl.core.lazy_names import lazy_names

__all__ = ["CheckpointError", "RunDirError", "RunDirLock", "RunLogger", "claim"]
__getattr__, __dir__ = lazy_names(__name__, {"CheckpointError": "checkpoint_manifest", "RunDirError": "rundir",
                                             "RunDirLock": "rundir", "RunLogger": "metrics", "claim": "rundir"})
