"""hpcrl: Slurm-native data-parallel FastSAC and detached PPO on torch.distributed."""

import torch  # noqa: F401  (hpcrl._C links against libtorch: torch must be loaded first)

__version__ = "0.1.0"
