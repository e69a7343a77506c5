"""The benchmark harness every chapter shares, so every strategy is measured the same way.

Three measurements, one JSON record per run:

* **time**: a step timer that skips warm-up steps; on GPU it synchronises the device so a step's
  time includes its kernels, on CPU it reads ``time.perf_counter``. A run's step time is the median timed step
  of its slowest rank; throughput is what one step processes / that step time (one definition).
* **memory per rank**: on GPU the largest ``torch.cuda.max_memory_allocated`` of the harness's own
  steps: the peak statistic is reset as each step begins (it then starts from what is allocated at
  that moment, so the model state, optimizer state and anything else held between steps count) and
  read as it ends, both outside the timed region. Work between or after the steps (an evaluation, a
  checkpoint, gathering the full weights) does not count, nor a compiled model's instrumented steps
  (they run eager). On CPU the peak that
  ``torch.distributed._tools.mem_tracker.MemTracker`` measures on the instrumented step: the bytes of
  every tensor storage alive at the step's peak, by category (parameters, gradients, optimizer state,
  activations, temporaries and communication buffers), exactly, where the process's peak RSS (kept
  as a secondary figure) adds some 330 MiB of interpreter and libraries that hide every difference
  between strategies. The categories are recorded on GPU too. On both, the bytes of parameters,
  gradients and optimizer state this rank *holds* (sharded tensors count only their local shard),
  which is what the ZeRO/FSDP formulas predict.
* **communication per step by collective**, counted from the collectives that really ran: a
  ``TorchDispatchMode`` (:class:`~distkit.comm_counter.CommCounter`) sees every ``c10d`` operation
  (DDP's C++ bucket all-reduce, FSDP's all-gather and reduce-scatter, DTensor's functional
  collectives, DeepSpeed's calls) with its
  tensors and process group, and adds up their sizes. Counting runs on its own step(s) after the
  warm-up (the *instrumented* step, which also tracks memory) and never on a timed step, so it adds
  nothing to the measured step time.

The timers live in :mod:`distkit.timing`, the memory measurements in :mod:`distkit.memory`, the
counters in :mod:`distkit.comm_counter`; the harness combines them, and what scripts use of them is
importable from here.

For every collective the record keeps the payload (``bytes``: the tensor handed to the collective,
the *total* buffer for gathers/scatters as nccl-tests counts it) and ``bus_bytes``: the bytes each
rank sends on the wire in a ring/bandwidth-optimal algorithm, i.e. payload x the nccl-tests bus factor
(all-reduce 2(n-1)/n, all-gather / reduce-scatter / all-to-all (n-1)/n, broadcast / reduce /
send / recv 1). Bus bytes are what to compare between strategies.

The record (schema 2)
---------------------
Every measured run appends one JSON line, built by :func:`make_record` (the harness calls it from
:meth:`Harness.finish`; scripts that measure something other than a training step, like chapter
04's bandwidth test, call it directly). Its fields:

* ``schema`` (2), ``command`` (how the script was started), ``timestamp``, ``torch_version``,
  ``machine`` (:func:`machine_info`), ``backend``, ``device``, ``world_size``: provenance;
* ``strategy``: what ran, a :class:`~distkit.strategies.Strategy` (``ddp``, ``fsdp_full_shard``,
  ``zero2``, ``tp_sp``, ``pp_1f1b``, ...) or a measurement name such as ``bandwidth``;
* ``model``: the model's configuration, one way everywhere: ``{"arch": "gpt", <GPTConfig fields>}``
  for the small GPT, ``{"arch": "llama", <LlamaModelConfig fields>}`` for the Llama-architecture
  model, ``{"arch": "<name>", ...}`` for any other model, ``null`` when none;
* ``param_count``: the full model's parameters (not a shard's);
* ``config``: the script's settings (global batch, precision, mesh, micro-batches, engine settings);
* ``metrics``: the measurement (for training runs: ``step_time_s_median``, ``step_times_s_per_rank``
  (every timed step, so the median and the rates can be recomputed), ``samples_per_step``,
  ``tokens_per_step``, ``samples_per_s``, ``tokens_per_s``, per-rank ``peak_memory_bytes`` (what
  ``peak_memory_kind`` says: ``cuda_max_allocated``, ``cpu_mem_tracker``, or ``cpu_peak_rss`` where
  MemTracker could not run, e.g. compiled code; ``rehearsal_peak_rss`` in a GPU-check rehearsal),
  where steps were metered (CUDA, a rehearsal) ``peak_memory_step_bytes_per_rank`` ([step, bytes,
  counted] per step) and ``peak_memory_steps_per_rank`` (the counted steps, the peak's window),
  ``peak_memory_by_category`` (MemTracker's peak
  folded into :data:`MEMORY_CATEGORIES`, plus ``activations_high_water``, the activations' own
  largest size in the step; or None), ``peak_rss_bytes``, ``model_state_bytes`` and
  ``comm_per_step``; for transformers also
  throughput as practitioners report it: ``tokens_per_s_per_device``, ``model_flops_per_token``
  (:func:`distkit.theory.training_flops_per_token`), ``peak_flops_per_s`` (measured on each rank's
  device by :func:`measure_peak_flops` at the end of the run, the slowest rank's), ``peak_flops_dtype``
  (the dtype it was measured in: the one the training's matmuls ran in, observed by a
  :class:`~distkit.comm_counter.MatmulCounter` on the instrumented step) and ``mfu``; and for every
  run ``float32_matmul_precision`` (``torch.get_float32_matmul_precision()``: "highest" = TF32 off for
  float32 matmuls, torch's default; "high" lets them use TF32, which changes both an fp32 peak and the
  numerics);
* anything the script adds (``losses``, ``predicted`` ...).

:func:`read_records` returns records in this schema whatever version wrote them
(:func:`upgrade_record`); both, and :func:`describe_model`, live in :mod:`distkit.record_format`
(which distkit.compare reads records with) and are importable from here.
"""
from __future__ import annotations

import os
import shlex
import statistics
import sys
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist

from .comm_counter import CommCounter, MatmulCounter, bus_factor
from .memory import (
    MEMORY_CATEGORIES,
    StepPeakMeter,
    fresh_memory_peak,
    is_compiled,
    memory_tracker,
    model_state_bytes,
    peak_by_category,
    peak_memory_bytes,
    peak_rss_bytes,
    reset_peak_rss,
    step_peak_meter,
)
from .models import CONFIG_CLASSES, GPTConfig, LlamaModelConfig, config_from_dict
from .record_format import RECORD_SCHEMA, append_record, describe_model, read_records, upgrade_record
from .runtime import DistContext
from .strategies import Strategy
from .timing import (
    RegionTimer,
    StepTimer,
    device_clock,
    machine_info,
    measure_peak_flops,
    throughput_metrics,
)

# What scripts import from here (bus_factor and CommCounter live in distkit.comm_counter).
__all__ = ["CommCounter", "Harness", "MEMORY_CATEGORIES", "MatmulCounter", "RECORD_SCHEMA", "RegionTimer",
           "StepTimer", "append_record", "bus_factor", "describe_model", "device_clock", "fresh_memory_peak",
           "is_compiled", "machine_info",
           "make_record", "measure_peak_flops", "memory_tracker", "model_state_bytes", "peak_by_category",
           "peak_memory_bytes", "peak_rss_bytes", "read_records", "reset_peak_rss", "throughput_metrics",
           "upgrade_record"]


def calling_script() -> str:
    """The name of the script that is building a harness: the file of the first caller outside this
    package (a chapter script, also when a wrapper such as ``inject_faults.py`` or a mutant of it runs
    the script's code), so that a record's ``config.script`` is derived, never typed."""
    package = Path(__file__).resolve().parent
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.endswith(".py") and package not in Path(name).resolve().parents:
            return Path(name).stem
        frame = frame.f_back
    return Path(sys.argv[0]).stem


@dataclass
class Harness:
    """Measures a training loop: ``with harness.step(samples=...): <one optimizer step>``.

    Step order: ``warmup_steps`` untimed steps, then ``comm_steps`` *instrumented* steps (untimed:
    instruments intercept every op): communication counted on each, memory tracked by category
    (:func:`memory_tracker`) on the first, unless ``track_memory`` is False or the model runs
    compiled code (instrumented steps of a compiled model run eager: a dispatch mode would make
    Dynamo fall back to eager for good; eager memory is not the compiled model's, so such runs report
    the CPU peak RSS), then timed steps. During the memory-tracked step :attr:`memory_tracker` is the
    running tracker (scripts may read it from hooks), else None. ``samples`` / ``tokens`` are the
    number processed by the whole job in that step (the global batch), the same value on every rank.
    Call :meth:`finish` on every rank at the end; it gathers all ranks' numbers and, on rank 0,
    appends the record to ``results_file``.

    ``model_config``: the model's configuration for the record's ``model`` field (a
    :class:`~distkit.models.GPTConfig`, or a dict with an ``arch`` key); by default the small GPT's
    own ``cfg`` when ``model`` is one. ``param_count``: the full
    model's parameter count when the module cannot tell (a ZeRO-3 parameter's ``numel()`` is 0
    once partitioned; a pipeline rank holds only its stages); by default counted from ``model``.
    ``state_modules``: the modules whose parameters, gradients and optimizer state this rank holds
    (a pipeline rank's stages); by default ``model``.

    MFU's peak FLOP/s is measured in the dtype the training's matmuls ran in: a
    :class:`~distkit.comm_counter.MatmulCounter` on the instrumented step adds up their FLOPs by
    dtype and the one with the most wins (bfloat16 under autocast, FSDP's ``MixedPrecisionPolicy``
    or a bf16 DeepSpeed engine; float32 when no instrumented step ran). ``compute_dtype`` overrides
    that observation. The record says which dtype it was (``peak_flops_dtype``).

    Peak memory on CUDA is that of the steps alone (:meth:`step` resets CUDA's peak statistic as a
    step begins and reads it as it ends, outside the timed region; :func:`~distkit.memory.step_peak_meter`
    chooses the meter, a GPU-check rehearsal's CPU stand-in included), so what a script does between or
    after its steps is not counted; :func:`peak_memory_bytes` still gives the whole window. A compiled
    model's peak is that of its compiled steps: its instrumented steps run eager and are read but not
    counted (the record lists each metered step's reading and which steps the peak covers).
    """

    ctx: DistContext
    strategy: Strategy | str
    model: torch.nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    warmup_steps: int = 2
    comm_steps: int = 1
    config: dict[str, Any] = field(default_factory=dict)
    model_config: GPTConfig | dict[str, Any] | None = None
    param_count: int | None = None
    state_modules: torch.nn.Module | Iterable[torch.nn.Module] | None = None
    compute_dtype: torch.dtype | None = None
    track_memory: bool = True
    memory_tracker: Any = field(init=False, default=None)
    _memory_peak: dict[str, int] | None = field(init=False, default=None)
    _timer: StepTimer = field(init=False)
    _comm: CommCounter = field(init=False)
    _matmuls: MatmulCounter = field(init=False)
    _comm_done: int = field(init=False, default=0)
    _step_meter: StepPeakMeter | None = field(init=False, default=None)
    _step_peaks: list[list] = field(init=False, default_factory=list)  # [step, bytes, counted] per metered step
    _step_reserved: int | None = field(init=False, default=None)  # the largest of the counted steps
    _steps: int = field(init=False, default=0)
    _timed_samples: float = field(init=False, default=0.0)
    _timed_tokens: float = field(init=False, default=0.0)
    _state_bytes: dict[str, int] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.config.setdefault("script", calling_script())
        self._timer = StepTimer(self.ctx.device, warmup_steps=0)
        self._comm = CommCounter()
        self._matmuls = MatmulCounter()
        self._step_meter = step_peak_meter(self.ctx.device)
        # GPU peak memory counts from here: whatever an earlier configuration in this process left
        # for the garbage collector or the CUDA cache must not count against this one. (CPU peak RSS
        # is per process; scripts that run several configurations call fresh_memory_peak themselves.)
        if self.ctx.device.type == "cuda":
            fresh_memory_peak(self.ctx.device)

    @contextmanager
    def step(self, samples: float = 0, tokens: float = 0) -> Iterator[None]:
        """Wrap one training step (forward, backward, optimizer step)."""
        index = self._steps
        self._steps += 1
        instrumented = self.warmup_steps <= index < self.warmup_steps + self.comm_steps
        # a compiled model's instrumented step runs eager (see _instruments): not its memory
        counted = not (instrumented and is_compiled(self._state_module()))
        with self._step_memory_peak(index, counted):
            if index < self.warmup_steps:
                yield
            elif instrumented:
                with self._instruments(first=index == self.warmup_steps):
                    yield
                self._comm_done += 1
            else:
                with self._timer.time():
                    yield
                self._timed_samples += samples
                self._timed_tokens += tokens
        if index < self.warmup_steps + self.comm_steps:  # warm-up or instrumented
            # Gradients and optimizer state exist after a step; keep the largest sample. Only on
            # untimed steps: walking every tensor must not add to a measured step.
            current = self.state_bytes()
            if sum(current.values()) >= sum(self._state_bytes.values()):
                self._state_bytes = current

    @contextmanager
    def _step_memory_peak(self, index: int, counted: bool) -> Iterator[None]:
        """The peak of step ``index`` alone, by :func:`~distkit.memory.step_peak_meter` (none on a plain
        CPU run): reset as the step begins, read as it ends, outside the step timer's region (timing
        is unaffected). Every reading is kept; only ``counted`` ones make the record's peak and the
        allocator's reserved peak (what frameworks such as torchtitan report)."""
        if self._step_meter is None:
            yield
            return
        self._step_meter.begin()
        yield
        peak, reserved = self._step_meter.end()
        self._step_peaks.append([index, peak, counted])
        if counted and reserved is not None:
            self._step_reserved = max(self._step_reserved or 0, reserved)

    @contextmanager
    def _instruments(self, first: bool) -> Iterator[None]:
        """An instrumented step: collectives and matmul dtypes counted, memory tracked on the first."""
        module = self._state_module()
        compiled = is_compiled(module)
        with ExitStack() as instruments:
            if compiled:
                # Dynamo runs code under a dispatch mode eagerly and keeps it eager for the
                # rest of the process; under the force_eager stance it is not consulted at all,
                # so the compiled code is used again on the timed steps. The collectives
                # (module hooks, the DDP reducer, DTensor) and the matmuls' dtypes are the same in eager.
                instruments.enter_context(torch.compiler.set_stance("force_eager"))
            instruments.enter_context(self._comm)
            instruments.enter_context(self._matmuls)
            if first and self.track_memory and not compiled:
                self.memory_tracker = memory_tracker(module, self.optimizer, self.memory_externals())
                instruments.enter_context(self.memory_tracker)
            yield
        if self.memory_tracker is not None:
            self._memory_peak = peak_by_category(self.memory_tracker)
            self.memory_tracker = None

    def _state_module(self) -> torch.nn.Module | None:
        """``state_modules`` (several modules as one ``ModuleList``), else ``model``: what this rank
        holds, for the model-state bytes and the memory tracker."""
        if self.state_modules is None or isinstance(self.state_modules, torch.nn.Module):
            return self.model if self.state_modules is None else self.state_modules
        return torch.nn.ModuleList(list(self.state_modules))

    def memory_externals(self) -> list[Any]:
        """Tensors, modules or optimizers held before the step that the memory tracker must count
        besides the model and the optimizer (override for engines with their own copies)."""
        return []

    def _declared_config(self) -> GPTConfig | LlamaModelConfig | dict[str, Any] | None:
        """``model_config``, else the model's own ``cfg`` (the small GPT and the Llama say what they
        are; DDP wraps the model it trains)."""
        if self.model_config is not None:
            return self.model_config
        return getattr(getattr(self.model, "module", self.model), "cfg", None)

    def _model_config(self) -> GPTConfig | LlamaModelConfig | None:
        """The transformer's config (:meth:`_declared_config` as a config object, the mixture-of-experts
        GPT's included: its FLOPs per token count its active experts), else None."""
        config = self._declared_config()
        if isinstance(config, dict) and config.get("arch") in CONFIG_CLASSES:
            config = config_from_dict(config)
        return config if isinstance(config, (GPTConfig, LlamaModelConfig)) else None

    def state_bytes(self) -> dict[str, int]:
        """Model-state bytes on this rank now: the parameters and gradients of ``state_modules``
        (default ``model``) and the optimizer's state (override by subclassing for engines that keep
        their own copies, like DeepSpeed's)."""
        return model_state_bytes(self._state_module(), self.optimizer)

    @property
    def step_times(self) -> list[float]:
        """This rank's timed step durations in seconds (what the record's median is taken over)."""
        return list(self._timer.times)

    def compute_dtype_for_peak(self) -> torch.dtype:
        """The dtype MFU's peak FLOP/s is measured in: ``compute_dtype`` if given, else the dtype of
        most matmul FLOPs on the instrumented step(s), else float32 (no instrumented step ran)."""
        if self.compute_dtype is not None:
            return self.compute_dtype
        return self._matmuls.dominant_dtype() or torch.float32

    def local_metrics(self) -> dict[str, Any]:
        """This rank's numbers (no communication)."""
        times = self._timer.times
        peak, kind = peak_memory_bytes(self.ctx.device), "cpu_peak_rss"
        counted = [step for step in self._step_peaks if step[2]]
        if self._step_meter is not None:
            kind = self._step_meter.kind
            if counted:  # the counted steps alone (before any: the window's)
                peak = max(step[1] for step in counted)
        elif self._memory_peak is not None:
            peak, kind = self._memory_peak["total"], "cpu_mem_tracker"
        # Measured after the run on every rank at once (ranks sharing CPU cores measure their share);
        # only for transformers, whose FLOPs per token are known.
        dtype = self.compute_dtype_for_peak()
        flops = measure_peak_flops(self.ctx.device, dtype) if self._model_config() else None
        metrics = {
            "peak_flops_per_s": flops,
            "peak_flops_dtype": str(dtype).removeprefix("torch.") if flops else None,
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "timed_steps": len(times),
            "time_s": sum(times),
            "step_time_s_median": statistics.median(times) if times else None,
            "step_times_s": list(times),
            "peak_memory_bytes": peak,
            "peak_memory_kind": kind,
            "peak_memory_by_category": self._memory_peak,
            "peak_reserved_bytes": self._step_reserved,  # CUDA's allocator, its counted steps; None elsewhere
            "peak_rss_bytes": peak_rss_bytes(),
            "model_state_bytes": self._state_bytes or self.state_bytes(),
            "comm_per_step": self._comm.summary(max(self._comm_done, 1)) if self._comm_done else {},
        }
        if self._step_meter is not None:  # a plain CPU run meters no step: its record keeps its fields
            metrics["peak_memory_steps"] = [step[0] for step in counted]
            metrics["peak_memory_step_bytes"] = [list(step) for step in self._step_peaks]
        return metrics

    def finish(self, results_file: str | os.PathLike | None = None,
               extra: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """Gather every rank's metrics; on rank 0 build the record, append it, and return it."""
        local = self.local_metrics()
        if dist.is_initialized() and self.ctx.world_size > 1:
            per_rank: list[dict] = [None] * self.ctx.world_size  # type: ignore[list-item]
            dist.all_gather_object(per_rank, local)
        else:
            per_rank = [local]
        if not self.ctx.is_main:
            return None
        timed = per_rank[0]["timed_steps"]
        medians = [m["step_time_s_median"] for m in per_rank if m["step_time_s_median"] is not None]
        # One definition of speed everywhere: the step time is the median over timed steps of the
        # slowest rank (a step ends when its slowest rank does; the median ignores a stray slow
        # step), and throughput is what one step processes divided by that step time.
        step_s = max(medians) if medians else None
        samples_per_step = self._timed_samples / timed if timed else 0.0
        tokens_per_step = self._timed_tokens / timed if timed else 0.0
        metrics = {
            "timed_steps": timed,
            "step_time_s_median": step_s,
            # every timed step of every rank, so a reader (or a test) can recompute the median and the rates
            "step_times_s_per_rank": [m["step_times_s"] for m in per_rank],
            "samples_per_step": samples_per_step,
            "tokens_per_step": tokens_per_step,
            "samples_per_s": samples_per_step / step_s if step_s else None,
            "tokens_per_s": tokens_per_step / step_s if step_s and tokens_per_step else None,
            "peak_memory_bytes_per_rank": [m["peak_memory_bytes"] for m in per_rank],
            "peak_memory_kind": per_rank[0]["peak_memory_kind"],
            **{f"{key}_per_rank": [m[key] for m in per_rank]  # metered steps (not on a plain CPU run)
               for key in ("peak_memory_steps", "peak_memory_step_bytes") if key in per_rank[0]},
            "peak_memory_by_category_per_rank": [m["peak_memory_by_category"] for m in per_rank],
            "peak_reserved_bytes_per_rank": [m["peak_reserved_bytes"] for m in per_rank],
            "peak_rss_bytes_per_rank": [m["peak_rss_bytes"] for m in per_rank],
            "model_state_bytes_per_rank": [m["model_state_bytes"] for m in per_rank],
            "comm_per_step_per_rank": [m["comm_per_step"] for m in per_rank],
            "comm_per_step": per_rank[0]["comm_per_step"],
            "float32_matmul_precision": per_rank[0]["float32_matmul_precision"],
        }
        param_count = self.param_count if self.param_count is not None else _param_count(self.model)
        model_config = self._declared_config()
        transformer = self._model_config()
        if transformer is not None:
            from .theory import training_flops_per_token

            measured = [m for m in per_rank if m["peak_flops_per_s"]]
            slowest = min(measured, key=lambda m: m["peak_flops_per_s"]) if measured else None
            metrics.update(throughput_metrics(metrics["tokens_per_s"], self.ctx.world_size,
                                              training_flops_per_token(transformer),
                                              slowest["peak_flops_per_s"] if slowest else None))
            metrics["peak_flops_dtype"] = slowest["peak_flops_dtype"] if slowest else None
        record = make_record(self.ctx, self.strategy, model=model_config, param_count=param_count,
                             config=self.config, metrics=metrics, extra=extra)
        if results_file is not None:
            append_record(results_file, record)
        return record


def make_record(ctx: DistContext, strategy: Strategy | str, *, metrics: dict[str, Any],
                model: GPTConfig | dict[str, Any] | None = None, param_count: int | None = None,
                config: dict[str, Any] | None = None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """One harness record (schema 2, see the module docstring) with this run's provenance."""
    record = {
        "schema": RECORD_SCHEMA,
        "command": shlex.join([os.path.relpath(sys.argv[0]) if sys.argv[0] else "python"] + sys.argv[1:]),
        "strategy": strategy,
        "world_size": ctx.world_size,
        "backend": ctx.backend,
        "device": ctx.device.type,
        "machine": machine_info(ctx.device),
        "torch_version": torch.__version__,
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "model": describe_model(model),
        "param_count": param_count,
        "config": dict(config or {}),
        "metrics": metrics,
    }
    if extra:
        record.update(extra)
    return record


def _param_count(model: torch.nn.Module | None) -> int | None:
    """The model's full parameter count (a DTensor counts its global shape)."""
    if model is None:
        return None
    return sum(p.numel() for p in model.parameters())
