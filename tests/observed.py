"""What the lesson tests share to observe a chapter script: launching it under tests/workers/observe.py
(unchanged, or as a mutant), reading what each rank's model was fed, and the one sample digest.

    jobs = observe_jobs(tmp_path_factory, SCRIPT, "TinyGPT", {"correct": None, "bug": (OLD, NEW)},
                        lambda folder: [...flags...], nproc=2)
    folder, done = job(jobs, "bug")
    seen_calls(folder, rank)   # every forward of the observed class on that rank, in order
"""
from __future__ import annotations

import functools
import json
import statistics
from pathlib import Path
from typing import Callable

from launch import WORKERS, job, run_jobs, torchrun
from workers.observe import digest_rows  # noqa: F401  (the recorder's digest: the tests compare with it)

# the messages of check_tokens_per_s's and check_mfu's decisive assertions (a control matches them)
TOKENS_PER_STEP = "the recorded tokens per step are not the global batch's"
MFU_MISMATCH = "the recorded MFU is not the formula's"


def observe(script: Path, class_name: str, folder: Path, args: list, nproc: int,
            mutation: tuple[str, str] | None = None, outputs: bool = False, options: tuple[str, ...] = ()):
    """One launch of ``script args`` (or its mutant) on ``nproc`` ranks, its observations under
    ``folder/seen``; ``options`` are observe.py's further options (``--inputs``, ``--param NAME``)."""
    head = [str(folder / "seen"), str(script), *(["--outputs"] if outputs else []), *options,
            *(["--mutate", *mutation] if mutation else [])]
    return torchrun(WORKERS / "observe.py", class_name, *head, "--", *map(str, args), nproc=nproc,
                    tmp_path=folder, timeout=240)


def observe_jobs(tmp_path_factory, script: Path, class_name: str, mutations: dict[str, tuple[str, str] | None],
                 args: Callable[[Path], list], nproc: int | dict[str, int], outputs: bool = False,
                 options: tuple[str, ...] = ()) -> dict:
    """Every variant of ``mutations`` (name -> (old, new), or None for the script as it is) launched
    two at a time (launch.run_jobs); ``args`` gives the flags for a variant's folder, ``nproc`` its
    world size (one for all, or per name)."""
    def launch(name: str, folder: Path):
        ranks = nproc[name] if isinstance(nproc, dict) else nproc
        return observe(script, class_name, folder, args(folder), ranks, mutations[name], outputs, options)

    return run_jobs({name: functools.partial(launch, name) for name in mutations}, tmp_path_factory)


def pinned(runs: dict, check: Callable, *bugs: str, match: str, output: bool = False,
           correct: str = "correct") -> None:
    """A lesson test's shape: ``check(folder)`` (``check(folder, stdout)`` with ``output``) holds on the
    ``correct`` run of ``runs`` and fails on each mutant in ``bugs``, its negative controls. ``match``
    (a regular expression, searched in the failure's message) names the check's own assertion each
    mutant must fail: required, since any other AssertionError (a precondition) would prove nothing.
    A mutant launch that failed re-raises here, outside the expected failure: a crash is not a caught
    bug."""
    import pytest

    def args(name: str) -> tuple:
        folder, done = job(runs, name)
        return (folder, done.stdout) if output else (folder,)

    check(*args(correct))
    for bug in bugs:
        mutant = args(bug)
        with pytest.raises(AssertionError, match=match):
            check(*mutant)


def rate_check(tokens_per_step: int, cfg=None) -> Callable[[Path], None]:
    """A ``pinned`` check of a run's record (``folder/r.jsonl``): tokens/s from the step times, and
    MFU from the formula when ``cfg`` is given (see :func:`check_tokens_per_s`, :func:`check_mfu`)."""
    from distkit.harness import read_records

    def check(folder: Path) -> None:
        (record,) = read_records(folder / "r.jsonl")
        check_tokens_per_s(record, tokens_per_step)
        if cfg is not None:
            check_mfu(record, cfg, tokens_per_step)
    return check


def seen_calls(folder: Path, rank: int) -> list[dict]:
    """Every forward call rank ``rank``'s observed module made, in order (observe.py's lines)."""
    return [json.loads(line) for line in (folder / "seen" / f"rank{rank}.jsonl").read_text().splitlines()]


def slowest_median(metrics: dict) -> float:
    """A run's step time from its recorded step times: the slowest rank's median (a step ends when its
    slowest rank does), recomputed here, not read from the record."""
    return max(statistics.median(times) for times in metrics["step_times_s_per_rank"])


def check_tokens_per_s(record: dict, tokens_per_step: int) -> None:
    """The record's tokens/s is ``tokens_per_step`` (the global batch's tokens, computed by the test
    from the flags) over the slowest rank's median step, and samples/s likewise."""
    import pytest

    metrics = record["metrics"]
    step_s = slowest_median(metrics)
    assert metrics["tokens_per_step"] == tokens_per_step, \
        f"{TOKENS_PER_STEP}: recorded {metrics['tokens_per_step']}, the global batch has {tokens_per_step}"
    assert metrics["tokens_per_s"] == pytest.approx(tokens_per_step / step_s, rel=1e-12)
    assert metrics["samples_per_s"] == pytest.approx(metrics["samples_per_step"] / step_s, rel=1e-12)


def check_mfu(record: dict, cfg, tokens_per_step: int) -> None:
    """MFU = tokens/s per device x model FLOPs per token / the measured peak, with the FLOPs counted
    here from the built model: 6 x every parameter that multiplies (not the embedding tables) + the
    attention term 12 L d s (PaLM's appendix B)."""
    import pytest

    from distkit.models import build_model

    multiplying = sum(p.numel() for name, p in build_model(cfg).named_parameters() if "_emb." not in name)
    flops = 6 * multiplying + 12 * cfg.n_layer * cfg.n_embd * cfg.seq_len
    metrics = record["metrics"]
    per_device = tokens_per_step / slowest_median(metrics) / record["world_size"]
    assert metrics["model_flops_per_token"] == flops
    assert metrics["mfu"] == pytest.approx(per_device * flops / metrics["peak_flops_per_s"], rel=1e-9), \
        f"{MFU_MISMATCH}: recorded {metrics['mfu']}, recomputed {per_device * flops / metrics['peak_flops_per_s']}"


def rank_rows(cfg, step: int, batch: int, rank: int, world_size: int):
    """(inputs, targets) rank ``rank`` trains on at ``step``: its contiguous share of the token task's
    global batch ``step`` of ``batch`` sequences (seed 0, the scripts' default)."""
    from distkit.models import TokenTask, rank_slice

    inputs, targets = TokenTask(cfg, seed=0).global_batch(step, batch)
    return rank_slice(inputs, rank, world_size), rank_slice(targets, rank, world_size)


def cross_entropy(call: dict, targets) -> float:
    """The token cross-entropy of one observed forward's logits (``--outputs``), in float64."""
    import torch
    import torch.nn.functional as F

    logits = torch.tensor(call["outputs"], dtype=torch.float64)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten()).item()
