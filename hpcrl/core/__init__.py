"""The bottom layer: facts and helpers every other layer may use and that use nothing else of hpcrl.

- :mod:`~hpcrl.core.conventions` — exit codes, the PPO rank layout, the rendezvous-port rule (torch-free:
  the launcher and the sbatch scripts read them on login nodes)
- :mod:`~hpcrl.core.config_check` — range checks of typed configs and the one-line error types
  (:class:`ConfigError`, :class:`DataError`, :class:`RunDirError`)
- :mod:`~hpcrl.core.rundir_files` — private file modes and atomic replacement
- :mod:`~hpcrl.core.diskfault` — a failed write as one :class:`DiskFault` (exit 74)
- :mod:`~hpcrl.core.h5io` — nested tensors to HDF5 and back (replay shards, checkpoints)
- :mod:`~hpcrl.core.process_state`, :mod:`~hpcrl.core.lazy_names` — /proc reads; lazily loaded public names

Nothing is imported here: ``hpcrl.core.conventions`` must load without torch.
"""
