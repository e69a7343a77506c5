"""DeepSpeed plumbing for chapter 03 that is not the DeepSpeed lesson itself.

The chapter scripts keep what a reader learns DeepSpeed from in the open: the JSON config,
``deepspeed.initialize``, ``engine.backward`` / ``engine.step``, ``save_checkpoint`` /
``load_checkpoint``. What they share besides lives here:

* reading and checking a DeepSpeed JSON config (:func:`load_ds_config`, one error line naming the
  file) and resolving this repository's ``"auto"`` values for the model and device at hand
  (:func:`resolve_auto`);
* importing DeepSpeed for the device the runtime chose without JIT-compiling ops the scripts do not
  use (:func:`import_deepspeed`);
* tearing an engine down so that the next configuration in the same process is measured on a clean
  slate (:func:`release_engine`, :func:`clean_slate`);
* counting the model state a ZeRO engine keeps (it lives inside DeepSpeed, not in
  ``model.parameters()``) for the shared harness (:class:`ZeroHarness`, :func:`zero_harness`), and
  the settings the engine actually runs with (:func:`engine_settings`).

The formulas these measurements are compared with are in :mod:`distkit.theory`
(``zero_fp32_state_bytes``, ``zero_paper_bytes``, ``deepspeed_prediction``).
"""
from __future__ import annotations

import json
import logging
import math
import os
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

from .flags import check_value, positive_float, positive_int
from .harness import Harness, fresh_memory_peak
from .runtime import UsageError

STAGES = (0, 1, 2, 3)
# The held-out batch both the trainer and the inference script score: TokenTask.global_batch(EVAL_STEP,
# EVAL_BATCH) is never a training batch of these short runs.
EVAL_STEP, EVAL_BATCH = 10_000, 32

# Element counts that size a transient buffer or a window of gathered parameters. "auto" (see
# resolve_auto) sizes them from the model; a number is used as given.
BUCKET_KEYS = ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
               "stage3_max_live_parameters", "stage3_max_reuse_distance")
# DeepSpeed's own default for the bucket sizes: "auto" never goes above it.
DEEPSPEED_DEFAULT_BUCKET = 500_000_000


def _check_auto_or(path, name: str, value, kind: str):
    """A config value that is "auto" or of ``kind`` ("count" or "bool"); one error line otherwise."""
    if value == "auto":
        return
    if kind == "bool":
        if not isinstance(value, bool):
            raise UsageError(f"DeepSpeed config {path}: {name} must be true, false or \"auto\", not {value!r}")
        return
    if isinstance(value, str):
        raise UsageError(f"DeepSpeed config {path}: {name} must be a number or \"auto\", not {value!r}")
    count = check_value(f"DeepSpeed config {path}: {name}", value, positive_float)
    if count != int(count):
        raise UsageError(f"DeepSpeed config {path}: {name} must be a whole number of elements, not {value!r}")


def load_ds_config(path: str | os.PathLike, global_batch_size: int | None = None) -> dict:
    """Read a DeepSpeed JSON config and check what this chapter relies on.

    Every problem is one :class:`UsageError` line that names the file. ``global_batch_size``
    (``--global-batch-size``) overrides ``train_batch_size``; the per-rank micro-batch is left for
    DeepSpeed to derive (train_batch_size / (world size x gradient_accumulation_steps)).
    """
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise UsageError(f"DeepSpeed config {path} does not exist") from None
    except OSError as exc:
        raise UsageError(f"DeepSpeed config {path} is unreadable ({exc.strerror})") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"DeepSpeed config {path} is not valid JSON: {exc.msg} at line {exc.lineno} "
                         f"column {exc.colno}") from None
    if not isinstance(config, dict):
        raise UsageError(f"DeepSpeed config {path} must be a JSON object, not {type(config).__name__}")
    zero = config.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise UsageError(f"DeepSpeed config {path}: zero_optimization must be an object")
    stage = zero.get("stage", 0)
    if stage not in STAGES:
        raise UsageError(f"DeepSpeed config {path}: unknown ZeRO stage {stage!r} "
                         f"(zero_optimization.stage must be one of {', '.join(map(str, STAGES))})")
    for key in ("offload_optimizer", "offload_param"):
        device = (zero.get(key) or {}).get("device", "none")
        if device not in ("none", "cpu", "nvme"):
            raise UsageError(f"DeepSpeed config {path}: {key}.device must be none, cpu or nvme, "
                             f"not {device!r}")
        if key == "offload_param" and device != "none" and stage != 3:
            raise UsageError(f"DeepSpeed config {path}: offload_param needs stage 3 (got stage {stage})")
    for key in BUCKET_KEYS:
        if key in zero:
            _check_auto_or(path, f"zero_optimization.{key}", zero[key], "count")
    if "overlap_comm" in zero:
        _check_auto_or(path, "zero_optimization.overlap_comm", zero["overlap_comm"], "bool")
    for key in ("offload_optimizer", "offload_param"):
        if "pin_memory" in (zero.get(key) or {}):
            _check_auto_or(path, f"zero_optimization.{key}.pin_memory", zero[key]["pin_memory"], "bool")
    for key in ("train_batch_size", "gradient_accumulation_steps"):
        if key in config and not (key == "train_batch_size" and global_batch_size is not None):
            check_value(f"DeepSpeed config {path}: {key}", config[key], positive_int)
    if "optimizer" in config:
        raise UsageError(f"DeepSpeed config {path} has an \"optimizer\" section; these scripts pass "
                         "torch.optim.AdamW as the client optimizer (no JIT-compiled optimizer), so "
                         "remove it and use --lr")
    if global_batch_size is not None:
        config["train_batch_size"] = global_batch_size
    config.setdefault("train_batch_size", 32)
    config.pop("train_micro_batch_size_per_gpu", None)
    config.setdefault("gradient_accumulation_steps", 1)
    return config


def resolve_auto(config: dict, device: torch.device, param_count: int, world_size: int) -> dict[str, object]:
    """Replace the config's ``"auto"`` values (in place) with values for this model and device;
    return what was chosen, for the run's record.

    * Bucket sizes (``reduce_bucket_size``, ``allgather_bucket_size``) and ZeRO-3's windows of
      gathered parameters (``stage3_prefetch_bucket_size``, ``stage3_max_live_parameters``,
      ``stage3_max_reuse_distance``) become one rank's share of the model, ceil(Ψ / N) elements,
      capped at DeepSpeed's default of 5e8. ZeRO allocates the gradient bucket in full
      (``contiguous_gradients``: ``torch.empty(reduce_bucket_size)`` every step, twice with
      ``overlap_comm``), so DeepSpeed's 5e8 default costs 2 GB of fp32 per rank whatever the model,
      and a 5e8 prefetch / reuse window keeps every layer of ZeRO-3 gathered (the whole model
      resident). Sized to Ψ / N, the buffers never outgrow the 1/N share that ZeRO keeps per rank,
      and a backward still needs only about N reduce calls. At stages 1-3 a size the config leaves
      out is sized the same way.
    * ``overlap_comm`` becomes true on CUDA at stages 2-3 (the reduction runs on a side stream while
      backward goes on) and false on CPU, where there is no second stream to overlap with and the
      extra buffer buys nothing.
    * ``offload_*.pin_memory`` becomes true on CUDA (page-locked host buffers: faster, asynchronous
      GPU<->CPU copies) and false on CPU, where nothing is copied to a device.
    """
    zero = config.get("zero_optimization", {})
    stage = zero.get("stage", 0)
    cuda = device.type == "cuda"
    share = min(math.ceil(param_count / world_size), DEEPSPEED_DEFAULT_BUCKET)
    chosen: dict[str, object] = {}
    for key in BUCKET_KEYS:
        # A size left out of the config counts as "auto": DeepSpeed's 5e8 default is what this avoids.
        applies = stage >= 1 and (stage == 3 or not key.startswith("stage3_"))
        if zero.get(key, "auto" if applies else None) == "auto":
            zero[key] = chosen[key] = share
    if zero.get("overlap_comm") == "auto":
        zero["overlap_comm"] = chosen["overlap_comm"] = cuda and stage >= 2
    for key in ("offload_optimizer", "offload_param"):
        block = zero.get(key) or {}
        if block.get("pin_memory") == "auto":
            block["pin_memory"] = chosen[f"{key}.pin_memory"] = cuda
    return chosen


def check_batch(config: dict, world_size: int, path: str | os.PathLike) -> int:
    """Per-rank micro-batch size, or a one-line error when the global batch does not split evenly."""
    batch, accumulation = config["train_batch_size"], config["gradient_accumulation_steps"]
    if batch % (world_size * accumulation):
        raise UsageError(f"{path}: train_batch_size {batch} does not divide by {world_size} ranks x "
                         f"{accumulation} accumulation steps; pass --global-batch-size")
    return batch // (world_size * accumulation)


def zero_stage(config: dict) -> int:
    return config.get("zero_optimization", {}).get("stage", 0)


def offload_devices(config: dict) -> dict[str, str]:
    """Where ZeRO-Offload puts the optimizer and the parameters: ``none``, ``cpu`` or ``nvme``."""
    zero = config.get("zero_optimization", {})
    return {key: (zero.get(key) or {}).get("device", "none") for key in ("offload_optimizer", "offload_param")}


def strategy_name(config: dict) -> str:
    """The canonical strategy name of a config: zero0 ... zero3, or zero3_offload."""
    stage = zero_stage(config)
    offloaded = any(device != "none" for device in offload_devices(config).values())
    return f"zero{stage}_offload" if offloaded else f"zero{stage}"


def import_deepspeed(device: torch.device):
    """Import DeepSpeed for ``device`` and keep it from JIT-compiling ops these scripts do not use.

    * ``DS_ACCELERATOR=cpu`` is set for CPU runs (unless already set) *before* the import: DeepSpeed
      picks its accelerator once, at import, and would pick CUDA on a GPU machine run with
      ``--device cpu``.
    * On the CPU accelerator, DeepSpeed's communication backend compiles a shared-memory all-reduce
      op with gcc (about 30 s, and minutes on a busy machine) the first time it wraps the process
      group, even when torch.distributed is already initialised and ``dist_init_required=False``.
      Training never uses it (it serves CPU inference all-reduce), so it is marked unavailable and
      DeepSpeed falls back to plain torch.distributed (gloo).
    """
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # DeepSpeed 0.19.8 calls torch.distributed.all_gather_into_tensor / reduce_scatter_tensor, which
    # torch 2.13 marks deprecated: one FutureWarning per rank and call site, about DeepSpeed's code.
    warnings.filterwarnings("ignore", category=FutureWarning, message=r"`torch\.distributed\."
                            r"(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated")
    import deepspeed
    import deepspeed.ops
    from deepspeed.utils import logger as ds_logger

    if deepspeed.get_accelerator().device_name() == "cpu":
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    ds_logger.setLevel(logging.WARNING)  # DeepSpeed logs its whole config at INFO on every rank
    return deepspeed


def release_engine(engine) -> None:
    """Tear an engine down so that the garbage collector can free it and its device memory.

    ``engine.destroy()`` removes DeepSpeed's hooks and buffers, but DeepSpeed 0.19.8's ZeRO-3 leaves
    two module-level references behind, and through the module's hooks each keeps the engine, its
    optimizer and all their GPU memory alive for the rest of the process (found by following
    ``gc.get_referrers`` from an engine that outlived ``gc.collect()``):

    * the top module pushed onto ``FWD_MODULE_STACK`` (``deepspeed/runtime/zero/parameter_offload.py``)
      when the engine is built, never popped;
    * ``PartitionedParameterCoordinator.__params_to_release``, a method under
      ``functools.lru_cache``: the cache lives on the class and keys on the coordinator and the
      submodules, from the first step with a complete trace on.

    Both are released here. The engine itself is still part of a reference cycle (engine ->
    optimizer -> step hooks -> engine), so the caller drops its references and collects
    (:func:`clean_slate`) before measuring the next configuration.
    """
    module = engine.module
    engine.destroy()
    from deepspeed.runtime.zero import parameter_offload, partitioned_param_coordinator

    stack = getattr(parameter_offload, "FWD_MODULE_STACK", None)
    if isinstance(stack, list):
        stack[:] = [m for m in stack if m is not module]
    coordinator = getattr(partitioned_param_coordinator, "PartitionedParameterCoordinator", None)
    # The lru_cache sits under DeepSpeed's NVTX decorator (a plain closure): look inside it.
    wrapped = getattr(coordinator, "_PartitionedParameterCoordinator__params_to_release", None)
    inner = [_cell_value(cell) for cell in getattr(wrapped, "__closure__", None) or ()]
    for candidate in (wrapped, *inner):
        if hasattr(candidate, "cache_clear"):
            candidate.cache_clear()  # a cache only: live engines recompute their entries on demand


def clean_slate(device: torch.device, previous_engine, log) -> None:
    """Open the next configuration's peak-memory window on a clean slate: collect what the previous
    engine left (a weak reference to it, or None), empty the CUDA cache, reset the peak
    (``fresh_memory_peak``), and, on GPU, warn if that engine is still alive: its memory would then
    count in the next configuration's peak."""
    fresh_memory_peak(device)
    # On CPU the peak is MemTracker's, which counts only the tensors of this configuration's step; a
    # ZeRO-3 engine that was memory-tracked stays referenced (through DeepSpeed's backward hooks),
    # which only its RSS would show. On GPU max_memory_allocated counts everything alive.
    if device.type == "cuda" and previous_engine is not None and previous_engine() is not None:
        log.warning("the previous engine is still referenced after garbage collection: its memory "
                    "counts in this configuration's peak")


def _cell_value(cell):
    try:
        return cell.cell_contents
    except ValueError:  # an empty closure cell
        return None


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    return (t.untyped_storage().data_ptr(), t.storage_offset())


def _bytes(tensors, seen: set) -> int:
    total = 0
    for t in tensors:
        if t is None or t.numel() == 0 or _storage_key(t) in seen:
            continue
        seen.add(_storage_key(t))
        total += t.numel() * t.element_size()
    return total


class ZeroHarness(Harness):
    """The shared harness, counting the model state a DeepSpeed engine holds on this rank.

    The numbers are taken right after the inner (client) optimizer's step, the moment when ZeRO
    holds everything at once:

    * ``params``: the working weights the model computes with: every full parameter at stages
      0-2, only this rank's partition (``param.ds_tensor``) at stage 3;
    * ``grads``: gradients alive at the optimizer step: the fp32 gradient partition DeepSpeed hands
      the optimizer (stages 1-3) or the full ``.grad`` tensors (stage 0), plus any full ``.grad``
      still attached to the model;
    * ``optimizer``: the fp32 master copy of this rank's partition (stages 1-3 keep one even in fp32
      training) plus AdamW's ``exp_avg`` and ``exp_avg_sq``.

    Flat partitions are padded to divide by the world size: the padding is counted, as it is held.
    """

    def attach(self, engine, client_optimizer: torch.optim.Optimizer) -> None:
        self._engine = engine
        self._client_optimizer = client_optimizer
        self._snapshot: dict[str, int] = {}
        self._counting = False
        client_optimizer.register_step_post_hook(lambda opt, args, kwargs: self._take_snapshot(opt))

    @contextmanager
    def step(self, samples: float = 0, tokens: float = 0) -> Iterator[None]:
        """The shared step, telling the optimizer hook whether this step may be counted: walking
        every parameter and optimizer state is only done on the untimed (warm-up and
        communication-counting) steps, never inside a timed one."""
        self._counting = self._steps < self.warmup_steps + self.comm_steps
        try:
            with super().step(samples=samples, tokens=tokens):
                yield
        finally:
            self._counting = False

    def _take_snapshot(self, optimizer: torch.optim.Optimizer) -> None:
        if not self._counting:
            return
        module = self._engine.module
        weights = [getattr(p, "ds_tensor", p) for p in module.parameters()]  # stage 3: the partition
        seen: set = set()
        params = _bytes(weights, seen)
        inner = [p for group in optimizer.param_groups for p in group["params"]]
        grads = _bytes([p.grad for p in inner] + [p.grad for p in module.parameters()], set())
        states = [v for state in optimizer.state.values() for v in state.values()
                  if isinstance(v, torch.Tensor) and v.dim() > 0]
        optimizer_bytes = _bytes(inner, seen) + _bytes(states, seen)  # inner params not seen = master copy
        snapshot = {"params": params, "grads": grads, "optimizer": optimizer_bytes}
        if sum(snapshot.values()) >= sum(self._snapshot.values()):
            self._snapshot = snapshot

    def state_bytes(self) -> dict[str, int]:
        return dict(getattr(self, "_snapshot", {}) or {"params": 0, "grads": 0, "optimizer": 0})

    def memory_externals(self) -> list:
        """What the engine holds outside the module's parameters, for the memory tracker: the client
        optimizer (its state; its parameters are ZeRO's fp32 partitions, which the tracker files
        under temporaries, "Other") and, at stage 3, each parameter's partition (``ds_tensor``)."""
        inner = [p for group in self._client_optimizer.param_groups for p in group["params"]]
        partitions = [p.ds_tensor for p in self._engine.module.parameters() if hasattr(p, "ds_tensor")]
        return [self._client_optimizer, *inner, *partitions]


def engine_settings(engine) -> dict[str, object]:
    """The buffer and overlap settings as the engine parsed them (what it actually runs with)."""
    settings = {"reduce_bucket_size": engine.zero_reduce_bucket_size(),
                "allgather_bucket_size": engine.zero_allgather_bucket_size(),
                "overlap_comm": engine.zero_overlap_comm()}
    if engine.zero_optimization_stage() == 3:
        settings.update(stage3_prefetch_bucket_size=engine.zero_prefetch_bucket_size(),
                        stage3_max_live_parameters=engine.zero_max_live_parameters(),
                        stage3_max_reuse_distance=engine.zero_max_reuse_distance())
    for key, offload in (("offload_optimizer", engine.zero_offload_optimizer()),
                         ("offload_param", engine.zero_offload_param())):
        if offload is not None and str(getattr(offload.device, "value", offload.device)) != "none":
            settings[f"{key}.pin_memory"] = bool(offload.pin_memory)
    return settings


def config_precision(config: dict) -> str:
    """What the engine trains in, as the config says: ``bf16`` or ``fp16`` when that section is
    enabled, else ``fp32`` (the record's ``precision``; the harness observes the matmuls' dtype for
    MFU by itself)."""
    for name in ("bf16", "fp16"):
        if (config.get(name) or {}).get("enabled"):
            return name
    return "fp32"


def zero_harness(ctx, engine, client_optimizer: torch.optim.Optimizer, ds_config: dict,
                 config_path: str | os.PathLike, *, param_count: int, warmup_steps: int,
                 lr: float) -> ZeroHarness:
    """The harness for one engine, attached, with the record config every ZeRO run of the chapter
    shares (global batch, precision, stage, offload devices, config file, lr, the bucket/overlap/
    pinning settings the engine runs with). The model's configuration goes into the record's
    ``model`` field by itself (the engine's module is the small GPT). ``param_count`` is counted
    before ``deepspeed.initialize``: a ZeRO-3 parameter's ``numel()`` is 0 afterwards."""
    harness = ZeroHarness(ctx, strategy_name(ds_config), model=engine.module, warmup_steps=warmup_steps,
                          param_count=param_count,
                          # GPU peaks are exact (max_memory_allocated); tracking a ZeRO-3 engine keeps it
                          # referenced after the run, which that peak would count in the next engine's
                          track_memory=ctx.device.type != "cuda",
                          config={"global_batch_size": ds_config["train_batch_size"],
                                  "precision": config_precision(ds_config),
                                  "zero_stage": zero_stage(ds_config),
                                  "offload": offload_devices(ds_config),
                                  "deepspeed_config": Path(config_path).name, "lr": lr,
                                  "engine_settings": engine_settings(engine)})
    harness.attach(engine, client_optimizer)
    return harness
