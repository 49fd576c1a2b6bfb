"""hpcrl: Slurm-native data-parallel FastSAC and detached PPO on torch.distributed."""

__version__ = "0.1.0"
