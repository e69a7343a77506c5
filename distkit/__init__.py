"""distkit: the shared, non-lesson parts of the distributed-training chapters.

* :mod:`distkit.runtime`: backend/device choice, process group set-up and tear-down, seeding,
  one-line errors (``run_main``, ``UsageError``).
* :mod:`distkit.logs`: ``[rank N]`` logging and a rank-0 progress bar.
* :mod:`distkit.harness`: step timing, memory per rank, communication bytes per collective, and
  the JSON records that ``benchmarks/`` reads.
* :mod:`distkit.data`: MNIST with an offline fallback; :mod:`distkit.models`: the MNIST CNN, the
  small GPT and its synthetic token task; :mod:`distkit.checkpoint`: atomic, safe checkpoints.
* :mod:`distkit.flags`: range-checked argparse types and the flags every script shares, one name and
  one meaning per concept (``add_training_args``, ``add_checkpoint_args``, ``add_bucket_arg``).
* :mod:`distkit.theory`: every formula (ZeRO, FSDP2, Megatron TP, pipeline bubble, bus bytes), the one
  place chapters and benchmarks take their predictions from.
* :mod:`distkit.records`: records of runs (command, machine, torch version, date) and every README
  output block, table and plot regenerated from them (``python -m distkit.records render``).
"""
from .runtime import (ArgumentParser, DistContext, UsageError, add_runtime_args,
                      choose_backend_and_device, distributed, init_distributed, run_main,
                      seed_everything, shutdown_distributed)

__all__ = ["ArgumentParser", "DistContext", "UsageError", "add_runtime_args", "choose_backend_and_device",
           "distributed", "init_distributed", "run_main", "seed_everything", "shutdown_distributed"]
__version__ = "0.1.0"
