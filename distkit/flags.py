"""Range-checked argparse types, so a bad number is rejected where its flag is defined.

``parser.add_argument("--steps", type=positive_int)`` turns ``--steps 0`` into argparse's own
one-line ``error: argument --steps: must be a positive integer, got 0`` (printed once, by rank 0,
through :class:`distkit.ArgumentParser`) before any process group exists. Values that come from a
config file instead of the command line go through :func:`check_value` with the same types.
"""
from __future__ import annotations

import argparse
import math
from typing import Any, Callable

from .errors import UsageError


def _number(kind: Callable[[str], Any], text: str, what: str, in_range: Callable[[Any], bool]):
    """Parse ``text`` as ``kind`` and check ``in_range``; argparse's one-line error otherwise."""
    try:
        value = kind(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
    if not in_range(value):
        shown = format(value, "g") if isinstance(value, float) else value
        raise argparse.ArgumentTypeError(f"must be {what}, got {shown}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1 (steps, batch sizes, ranks, intervals)."""
    return _number(int, text, "a positive integer", lambda v: v >= 1)


def non_negative_int(text: str) -> int:
    """An integer >= 0 (warm-up steps, "0 = off" intervals)."""
    return _number(int, text, "an integer >= 0", lambda v: v >= 0)


def positive_float(text: str) -> float:
    """A finite number > 0 (learning rates, timeouts, sizes in MiB)."""
    return _number(float, text, "a positive number", lambda v: v > 0)


def non_negative_float(text: str) -> float:
    """A finite number >= 0 (weight decay, clipping where 0 means off)."""
    return _number(float, text, "a number >= 0", lambda v: v >= 0)


def check_value(name: str, value: Any, kind: Callable[[str], Any]) -> Any:
    """Apply one of the types above to a value that did not come from the command line (a config
    file); raises :class:`distkit.UsageError` naming the key."""
    if isinstance(value, bool):  # YAML's true/false is an int subclass in Python: never a count
        raise UsageError(f"{name}: must be a number, got {value!r}")
    try:
        return kind(str(value))
    except argparse.ArgumentTypeError as exc:
        raise UsageError(f"{name}: {exc}") from None


# ------------------------------------------------------------------------------------------------
# One name and one meaning per concept, for every script
# ------------------------------------------------------------------------------------------------
_UNSET = object()


def add_training_args(parser: argparse.ArgumentParser, *, steps: int | None = 20,
                      global_batch_size: int | None = 16, lr: float | None = 1e-3,
                      warmup_steps: int | None = 2, results: str | None = "runs/results.jsonl",
                      grad_accum_steps: int | None = None, zero_steps_allowed: bool = False,
                      helps: dict[str, str] | None = None) -> argparse._ArgumentGroup:
    """The training flags every chapter script shares, with this script's defaults.

    ``--steps`` (optimizer steps), ``--global-batch-size`` (sequences or samples per optimizer step
    across all ranks), ``--lr`` (peak learning rate), ``--warmup-steps`` (untimed harness steps
    before timing starts; *not* a learning-rate warm-up), ``--results`` (the JSON-lines file harness
    records are appended to) and, where a script accumulates, ``--grad-accum-steps`` (micro-batches
    whose gradients are summed per optimizer step). Pass ``None`` for a flag the script does not
    take. ``zero_steps_allowed`` accepts ``--steps 0`` (a script where 0 steps means something, like
    saving the initial model). ``helps`` replaces a flag's help text where the script gives it a sharper meaning (keyed
    by destination, e.g. ``{"steps": "train until this global step"}``; the default is appended).
    Returns the argument group, so a script can add its own training flags beside these.
    """
    group = parser.add_argument_group("training")
    if steps is not None:
        group.add_argument("--steps", type=non_negative_int if zero_steps_allowed else positive_int, default=steps,
                           help=f"optimizer steps (default: {steps})")
    if global_batch_size is not None:
        group.add_argument("--global-batch-size", type=positive_int, default=global_batch_size,
                           help="samples per optimizer step across all ranks "
                                f"(default: {global_batch_size})")
    if grad_accum_steps is not None:
        group.add_argument("--grad-accum-steps", type=positive_int, default=grad_accum_steps,
                           help="micro-batches whose gradients are summed per optimizer step "
                                f"(default: {grad_accum_steps})")
    if lr is not None:
        group.add_argument("--lr", type=positive_float, default=lr,
                           help=f"peak learning rate (default: {lr:g})")
    if warmup_steps is not None:
        group.add_argument("--warmup-steps", type=non_negative_int, default=warmup_steps,
                           help="untimed steps before the harness starts timing "
                                f"(default: {warmup_steps})")
    if results is not None:
        group.add_argument("--results", default=results, metavar="FILE",
                           help=f"harness records (JSON lines) are appended here (default: {results})")
    _sharpen_help(group, helps)
    return group


def add_bucket_arg(parser: argparse.ArgumentParser | argparse._ArgumentGroup, default: float | list[float],
                   sweep: bool = False, help_extra: str = "") -> None:
    """``--bucket-cap-mb``: the size of DDP's gradient buckets in MiB (DDP's own ``bucket_cap_mb``).

    ``sweep=True`` takes several values (a script that measures each); 0 means one collective per
    gradient tensor where the script allows it.
    """
    shown = " ".join(f"{v:g}" for v in default) if sweep else f"{default:g}"
    parser.add_argument("--bucket-cap-mb", type=non_negative_float, nargs="+" if sweep else None,
                        default=default, metavar="MB",
                        help=f"gradient bucket size in MiB{help_extra} (default: {shown})")


# The optimizers a script with --optimizer can train with. SGD's update is proportional to the
# gradient, so an equivalence test run with it also sees gradient-scale mistakes (a sum instead of a
# mean, a forgotten 1/k) that AdamW's normalised update hides.
# name -> the torch.optim class it builds
OPTIMIZER_CLASSES = {"adamw": "AdamW", "sgd": "SGD"}
OPTIMIZERS = tuple(OPTIMIZER_CLASSES)


def add_optimizer_arg(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--optimizer adamw|sgd``, one definition for every script that offers the choice."""
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw",
                        help="adamw (default), or plain sgd, whose update is proportional to the gradient, "
                             "so an equivalence test also sees gradient-scale mistakes AdamW normalises away")


def make_optimizer(name: str, params, lr: float, weight_decay: float | None = None):
    """The optimizer ``name`` (``--optimizer``) over ``params`` at learning rate ``lr``, torch's defaults
    otherwise, except its implementation, chosen here for both devices. ``weight_decay`` is AdamW's
    (decoupled) decay; plain SGD ignores it and stays plain, its update the gradient times lr.

    ``foreach`` (one multi-tensor kernel per update op) is what torch picks on CUDA, and on CPU it
    saves a dispatch per tensor, which DTensor parameters make costly. But a foreach op over a list
    that mixes DTensors with plain tensors fails ("got mixed torch.Tensor and DTensor"), and torch's
    CUDA default does not check for that: a tensor-parallel model whose norms stay plain tensors
    would crash at its first step on a GPU. A mixed list therefore takes the per-tensor loop, a
    uniform one the foreach kernels."""
    import torch
    from torch.distributed.tensor import DTensor

    params = list(params)
    kinds = {isinstance(p, DTensor) for p in params}
    options = {"weight_decay": weight_decay} if name == "adamw" and weight_decay is not None else {}
    return getattr(torch.optim, OPTIMIZER_CLASSES[name])(params, lr=lr, foreach=len(kinds) == 1, **options)


def add_checkpoint_args(parser: argparse.ArgumentParser, *, save: str | None | object = _UNSET,
                        checkpoint_dir: str | None | object = _UNSET,
                        resume: str | None | object = _UNSET, save_every: bool = False,
                        helps: dict[str, str] | None = None) -> argparse._ArgumentGroup:
    """Checkpoint flags with one meaning each, in every script that has them:

    * ``--save PATH``: rank 0 writes the trained model (full, unsharded weights) to this file at the
      end; ``{placeholders}`` in it are filled by the script (``{strategy}``, ``{mode}`` ...);
      ``none`` skips it.
    * ``--checkpoint-dir DIR``: where resumable training checkpoints (model, optimizer, step, RNG)
      are written and looked for.
    * ``--resume WHAT``: what to start from: ``none``, ``latest`` (the newest complete checkpoint in
      ``--checkpoint-dir``) or the path of one checkpoint.
    * ``--save-every N`` (``save_every=True``): also save every N steps during training: ``--save``'s
      weights as ``FILE.stepN.pt`` (:func:`saved_at`) and, where the script has them, a checkpoint in
      ``--checkpoint-dir``. The script calls :func:`saves_after` after each step.

    Pass a default to add a flag (``None`` is a valid default), leave it out to not add the flag.
    ``helps`` sharpens a flag's help text for this script, as in :func:`add_training_args`.
    """
    group = parser.add_argument_group("checkpoints")
    if save is not _UNSET:
        group.add_argument("--save", default=save, metavar="PATH",
                           help="rank 0 writes the trained model's full weights here at the end; "
                                f"'none' skips it (default: {save})")
    if checkpoint_dir is not _UNSET:
        group.add_argument("--checkpoint-dir", default=checkpoint_dir, metavar="DIR",
                           help=f"resumable training checkpoints are written here (default: {checkpoint_dir})")
    if resume is not _UNSET:
        group.add_argument("--resume", default=resume, metavar="WHAT",
                           help="start from: none, latest (the newest complete checkpoint in "
                                f"--checkpoint-dir) or PATH of one checkpoint (default: {resume})")
    if save_every:
        group.add_argument("--save-every", type=non_negative_int, default=0, metavar="N",
                           help="also save every N steps: --save's weights as FILE.stepN.pt (default: 0, "
                                "only at the end)")
    _sharpen_help(group, helps)
    return group


def _sharpen_help(group: argparse._ArgumentGroup, helps: dict[str, str] | None) -> None:
    """Replace the help of the group's flags named in ``helps`` (keyed by destination), keeping the default."""
    for action in group._group_actions:
        if helps and action.dest in helps:
            action.help = f"{helps[action.dest]} (default: {action.default})"


def set_flag_default(parser: argparse.ArgumentParser, dest: str, value: Any, help: str) -> None:
    """Give a shared flag this script's own default, and say so in ``--help``.

    ``parser.set_defaults`` changes the value only: the shared help text would still name the shared
    default (``--arch ... (default: gpt)`` in a script that needs llama).
    """
    for action in parser._actions:
        if action.dest == dest:
            action.default = value
            action.help = f"{help} (default: {value})"
            return
    raise ValueError(f"the parser has no flag with destination {dest!r}")


def save_path(value: str | None, **fields: Any) -> str | None:
    """The file ``--save`` names with its ``{placeholders}`` filled, or None for ``none``/unset."""
    if value in (None, "", "none"):
        return None
    try:
        return value.format(**fields)
    except (KeyError, IndexError, ValueError) as exc:
            raise UsageError(f"--save {value!r}: unknown placeholder {exc} "
                         f"(known: {', '.join('{' + k + '}' for k in fields) or 'none'})") from None


def require_steps(parser: argparse.ArgumentParser, args, *, timed: bool, why: str) -> None:
    """One error line when ``--steps`` does not reach what the script reports: the harness's
    instrumented step, which counts bytes and memory, follows the ``--warmup-steps`` (at least
    warm-up + 1 steps), and its timed steps follow that one (``timed``: at least warm-up + 2).
    ``why`` names what the script would report without them."""
    need = args.warmup_steps + (2 if timed else 1)
    if args.steps < need:
        kind = "a timed step" if timed else "the instrumented step"
        parser.error(f"--steps {args.steps} is too few for {why}: it needs {kind}, at least --warmup-steps "
                     f"{args.warmup_steps} + {need - args.warmup_steps} = {need} steps")


def saves_after(args, step: int) -> bool:
    """Whether the weights are saved after optimizer step ``step`` (0-based) as well as at the end:
    every ``--save-every`` steps, the last step left to the final save."""
    every = getattr(args, "save_every", 0)
    return bool(every) and (step + 1) % every == 0 and step + 1 < args.steps


def saved_at(path: str | None, steps_done: int) -> str | None:
    """Where ``--save-every`` puts the weights after ``steps_done`` steps: ``model.pt`` ->
    ``model.step250.pt`` (None stays None: nothing is saved)."""
    if path is None:
        return None
    dot = path.rfind(".")
    stem, suffix = (path[:dot], path[dot:]) if dot > path.rfind("/") else (path, "")
    return f"{stem}.step{steps_done}{suffix}"


def check_global_batch(global_batch_size: int, world_size: int) -> None:
    """One error line when ``--global-batch-size`` does not split evenly over the ranks (each rank
    trains on its equal slice of the global batch)."""
    if global_batch_size % world_size:
        raise UsageError(f"--global-batch-size {global_batch_size} is not divisible by {world_size} ranks")
