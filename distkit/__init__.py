"""distkit: the shared, non-lesson parts of the distributed-training chapters.

* :mod:`distkit.runtime`: backend/device choice, process group set-up and tear-down, seeding,
  one-line errors (``run_main``; ``UsageError`` lives in :mod:`distkit.errors`); :mod:`distkit.slurm`:
  who a process is when ``srun`` started it; :mod:`distkit.paths`: every output path checked on rank
  0 before the first step.
* :mod:`distkit.logs`: ``[rank N]`` logging and a rank-0 progress bar.
* :mod:`distkit.harness`: step timing, memory per rank, communication bytes per collective
  (counted by :mod:`distkit.comm_counter`, timed by :mod:`distkit.timing`, memory measured by
  :mod:`distkit.memory`), and the JSON record every measured run writes (schema documented there,
  its file format in :mod:`distkit.record_format`) that the READMEs and ``benchmarks/`` read.
* :mod:`distkit.data`: MNIST with an offline fallback; :mod:`distkit.models`: the MNIST CNN, the
  small GPT and its synthetic token task; :mod:`distkit.text`: real text offline (Python's reference
  documentation, a byte per token) with the token task's interface; :mod:`distkit.checkpoint`:
  atomic, safe checkpoints.
* :mod:`distkit.fsdp_view`: chapter 02's evidence (each rank's shards, one step traced collective by
  collective).
* :mod:`distkit.flags`: range-checked argparse types and the flags every script shares, one name and
  one meaning per concept (``add_training_args``, ``add_checkpoint_args``, ``add_bucket_arg``).
* :mod:`distkit.strategies`: the strategy names (``Strategy``, a StrEnum), the benchmark matrix's
  (``MEASURED``) and the planner's (``PLANNED``).
* :mod:`distkit.theory`: the textbook formulas the chapters print (ZeRO, Megatron TP, pipeline
  bubble, ring attention, expert parallelism, activations, FLOPs per token, bus bytes);
  :mod:`distkit.predictors`: the per-strategy model-state and communication bytes built on them
  (FSDP2's padding, DeepSpeed's partitions, the TP plans; the model-parallel families, TP, PP, CP
  and EP, in :mod:`distkit.predictors_model_parallel`); :mod:`distkit.compare`: a record next to
  its prediction. The one place chapters and benchmarks take their predictions from.
* :mod:`distkit.cell_numbers`: one benchmark cell read from its record, which one it is (model,
  device) and its numbers (step time, throughput, memory, bus bytes, MFU, scaling efficiency), for
  every table, plot and notebook of the benchmarks.
* :mod:`distkit.tp_plans`: the Megatron tensor-parallel plan of the small GPT and of the Llama.
* :mod:`distkit.planner` (a package): does it fit, which strategy, how fast, built on the
  predictors and calibrated from the records.
* :mod:`distkit.deepspeed`: what chapter 03 needs around DeepSpeed that is not its lesson (config
  checks and ``"auto"`` values, the CPU accelerator set-up, engine clean-up, ZeRO state counting).
* :mod:`distkit.records`: records of runs (command, machine, torch version, date) and every README
  output block, table and plot regenerated from them (``python -m distkit.records render``), with
  the chapter notebooks re-executed by :mod:`distkit.notebooks`; both stamp what they write with
  :mod:`distkit.provenance` (machine, command, torch version, date); :mod:`distkit.shown_output`:
  what an output block shows of a record (paths relative to the repository, torchrun's failure
  report folded to one line).
* :mod:`distkit.mutation`: a script with one deliberate bug, for the negative controls.
* :mod:`distkit.offline`: the two commands that carry this repository to an offline GPU node.
* :mod:`distkit.jobs`: a command under a time limit, its whole process tree ended at the limit;
  :mod:`distkit.rehearsal`: what the GPU check swaps when it is rehearsed on a CPU machine;
  :mod:`distkit.verdict`: whether a GPU-check stage ended well (a pytest run's exit code and JUnit
  file, the check's own calls into CUDA).
"""
from .runtime import (
    ArgumentParser,
    DistContext,
    UsageError,
    add_runtime_args,
    choose_backend_and_device,
    distributed,
    init_distributed,
    run_main,
    seed_everything,
    shutdown_distributed,
)

__all__ = ["ArgumentParser", "DistContext", "UsageError", "add_runtime_args", "choose_backend_and_device",
           "distributed", "init_distributed", "run_main", "seed_everything", "shutdown_distributed"]
__version__ = "0.1.0"
