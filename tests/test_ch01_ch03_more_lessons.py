"""Four more chapter scripts' lessons, observed: what each rank's model was really fed (a global
forward hook, tests/workers/observe.py) and every number the scripts report, recomputed here. Each
test runs its check on the script as it is and on a deliberately broken variant (a mutant: one exact
piece of the script's source replaced), which must fail the same check, with that check's own
message (``observed.pinned``'s ``match``).

ddp_from_scratch.py (DDP by hand, 2 ranks):

* ``test_from_scratch_feeds_each_rank_its_own_rows``: at step s rank r's model sees rows r*B/W ... of
  the token task's global batch s, with autograd on, and nothing else. Mutant: every rank given rank
  0's rows (the hand-made all-reduce then averages two copies of one gradient; the weights still
  agree across ranks).
* ``test_from_scratch_losses_are_the_observed_logits``: each recorded loss (``loss_history``, and
  ``final_loss``) is the job's mean token cross-entropy, recomputed from the logits each rank's
  model returned, and so is each logged ``step k/N | loss`` (4 decimals). Mutant: the all-reduced
  loss not divided by the world size.
* ``test_from_scratch_all_reduces_are_its_buckets``: the record's all-reduces per step (calls and
  bytes, counted on the instrumented step) and the logged ``all-reduce per step`` line are the
  buckets of ``--bucket-cap-mb 0.1`` over the built model's gradients, in parameter order, written
  out here. Mutant: the cap ignored (one bucket for everything).
* ``test_from_scratch_tokens_per_s_and_mfu_are_recomputed``: tokens/s from the step times, MFU from
  the formula. Mutant: the harness told one rank's tokens.

ddp_spawn.py (``mp.spawn``, 2 processes): the script starts its own processes, so it cannot run
under observe.py through torchrun. This file is also its observer: run as
``python tests/test_ch01_ch03_more_lessons.py [script flags]`` with ``$OBSERVE_SPAWN`` set, it runs
the script (or a mutant) as ``__main__``; each spawned process re-imports it as ``__mp_main__``
(multiprocessing's spawn), defines the same script's functions, and installs observe.py's own hook
(``install``) at its model's first forward, once the script's worker has set ``RANK``.

* ``test_spawn_feeds_each_rank_its_own_rows``: at step s spawned rank r's model sees its rows of
  global batch s, with autograd on. Mutant: every rank given rank 0's rows.
* ``test_spawn_logged_losses_are_rank_0s_observed_logits``: each logged ``step k/N | loss on rank 0's
  shard`` (4 decimals) is the token cross-entropy of the logits rank 0's model returned at that step
  against the targets of rank 0's rows, recomputed here. Controls, in-process on the same run: the
  log with each loss replaced by the job's mean over ranks (the all-reduced loss under rank 0's
  label), and rank 1's observed logits taken for rank 0's; each fails the same check.

ddp_benchmark.py (world sizes 1 and 2, tiny model, per-rank batch 1): the driver run with python (the
mutant through distkit/mutation.py), its torchrun jobs through the fork launcher (``$DISTKIT_TORCHRUN``,
as test_ch01_tools.py runs them); the jobs are the unchanged script, the mutation is the driver's:

* ``test_benchmark_table_is_recomputed_from_the_step_times``: every record's tokens/s is its global
  batch (per-rank batch x the largest world size for strong scaling, x its own for weak) x sequence
  length over the slowest rank's median step; each printed row's step time, tokens/s, speedup
  (tokens/s over the smallest world size's, same mode) and efficiency (speedup over the ratio of
  world sizes) is that, recomputed here. Mutant: speedup taken as the ratio of step times (right for
  strong scaling, half the truth for weak scaling on 2 ranks).

zero_offload.py (ZeRO-3, then ZeRO-3 + offload, in one job on 2 ranks):

* ``test_offload_feeds_each_rank_its_own_rows_in_both_configs``: for each config in turn, at step s
  rank r's engine sees its rows of global batch s. Mutant: every rank given rank 0's rows.
* ``test_offload_final_losses_are_the_observed_logits``: each record's ``final_loss`` (and the logged
  ``final loss``) is rank 0's last-step token cross-entropy, recomputed from the logits its model
  returned and the targets of its rows. Mutant: the targets sliced for the next rank (inputs still
  right: the rows test cannot see it, only the recomputed loss can).
* ``test_offload_rates_and_step_times_are_the_recorded_times``: each record's tokens/s and samples/s
  are the global batch over the slowest rank's median step, each logged step time is that median,
  and the logged cost of offload is the ratio of the two. Mutant: the harness told one rank's tokens.
  (The ratio is recomputed here, but no mutant of the ratio alone is run.)

Written out here, not imported from the scripts: which rows a rank gets and the formulas.
zero_offload.py's placement table is pinned row by row in test_ch03_deepspeed.py.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import sys
from pathlib import Path

import pytest
import torch

from distkit.harness import read_records
from distkit.models import model_config
from launch import REPO, job, job_env, launcher_argv, python, run_jobs
from observed import (
    TOKENS_PER_STEP,
    check_tokens_per_s,
    cross_entropy,
    digest_rows,
    observe_jobs,
    pinned,
    rank_rows,
    rate_check,
    seen_calls,
    slowest_median,
)

W, B, STEPS = 2, 8, 2
CFG = model_config("gpt", "tiny")
SPAWN_ENV = "OBSERVE_SPAWN"  # set: this file runs as ddp_spawn.py's observer (see the bottom)

# each check's decisive message: its negative control must fail with it
NOT_ITS_ROWS = "not its own rows of each step's global batch"
LOSS_NOT_MEAN = "the recorded losses are not the job's mean cross-entropy"
NOT_THE_BUCKETS = "the recorded all-reduces are not the buckets'"
NOT_RANK_0S = "the logged loss is not rank 0's"
SPEEDUP = "the printed speedup is not the ratio of tokens/s"
FINAL_LOSS = "the recorded final loss is not rank 0's last cross-entropy"


def rows_of(step: int, rank: int, batch: int = B) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) rank ``rank`` trains on at ``step`` (this file's model and world size)."""
    return rank_rows(CFG, step, batch, rank, W)


def check_rows(calls: list[dict], rank: int, steps: int = STEPS) -> None:
    """One rank's observed forwards are training forwards of its own rows of steps 0 ... steps-1."""
    assert all(call["training"] and call["grad"] for call in calls), f"rank {rank}: not a training forward"
    assert [call["rows"] for call in calls] == [digest_rows(rows_of(step, rank)[0]) for step in range(steps)], \
        f"rank {rank}: {NOT_ITS_ROWS}"


def logged(pattern: str, out: str) -> list[tuple[str, ...]]:
    """Every match of ``pattern`` in rank 0's log lines."""
    return re.findall(r"^\[rank 0\] " + pattern, out, flags=re.MULTILINE)


# ==== ddp_from_scratch.py ==========================================================================

SCRATCH = REPO / "01-ddp-basics" / "ddp_from_scratch.py"
SCRATCH_RUNS = {
    "correct": None,
    "rank0_rows": ("rank_slice(t, ctx.rank, ctx.world_size)", "rank_slice(t, 0, ctx.world_size)"),
    "loss_not_averaged": ("losses.append(loss.item() / ctx.world_size)", "losses.append(loss.item())"),
    "cap_ignored": ("if size >= bucket_bytes or i == len(grads) - 1:", "if i == len(grads) - 1:"),
    "one_ranks_tokens": ("tokens=args.global_batch_size * gpt.seq_len",
                         "tokens=args.global_batch_size // ctx.world_size * gpt.seq_len"),
}
BUCKET_MIB = 0.1  # the tiny model's 37 gradients (0.42 MiB) fill 4 buckets


@pytest.fixture(scope="module")
def scratch_runs(tmp_path_factory):
    return observe_jobs(tmp_path_factory, SCRATCH, "TinyGPT", SCRATCH_RUNS, lambda folder: [
        "--model-size", "tiny", "--global-batch-size", B, "--steps", STEPS, "--warmup-steps", 0,
        "--bucket-cap-mb", BUCKET_MIB, "--log-every", 1, "--save", "none", "--results", folder / "r.jsonl"],
        nproc=W, outputs=True)


def check_scratch_rows(folder: Path) -> None:
    for rank in range(W):
        check_rows(seen_calls(folder, rank), rank)


def check_scratch_losses(folder: Path, out: str) -> None:
    (record,) = read_records(folder / "r.jsonl")
    calls = [seen_calls(folder, rank) for rank in range(W)]
    expected = [sum(cross_entropy(calls[r][step], rows_of(step, r)[1]) for r in range(W)) / W
                for step in range(STEPS)]
    assert record["loss_history"] == pytest.approx(expected, abs=1e-5), \
        f"{LOSS_NOT_MEAN}: recorded {record['loss_history']}, recomputed {expected}"
    assert record["final_loss"] == record["loss_history"][-1]
    printed = {int(step): float(loss) for step, loss in logged(rf"step (\d+)/{STEPS} \| loss ([\d.]+)$", out)}
    assert sorted(printed) == list(range(1, STEPS + 1)), printed
    for step, loss in printed.items():  # 4 decimals: half a unit of the last one, and float32's slack
        assert abs(loss - expected[step - 1]) <= 5e-5 + 1e-5, (step, loss, expected[step - 1])
    (done,) = logged(r"done: loss ([\d.]+) \|", out)
    assert abs(float(done) - expected[-1]) <= 5e-5 + 1e-5


def test_from_scratch_feeds_each_rank_its_own_rows(scratch_runs):
    pinned(scratch_runs, check_scratch_rows, "rank0_rows", match=NOT_ITS_ROWS)


def test_from_scratch_losses_are_the_observed_logits(scratch_runs):
    pinned(scratch_runs, check_scratch_losses, "loss_not_averaged", output=True, match=LOSS_NOT_MEAN)


def bucketed_all_reduces(cap_bytes: int) -> tuple[int, int]:
    """(calls, bytes) of one step's gradient all-reduces as the lesson describes them: every gradient
    in parameter order, a bucket sent once it holds at least ``cap_bytes`` and at the last gradient."""
    from distkit.models import build_model

    sizes = [p.numel() * p.element_size() for p in build_model(CFG).parameters()]
    calls, filled = 0, 0
    for i, size in enumerate(sizes):
        filled += size
        if filled >= cap_bytes or i == len(sizes) - 1:
            calls, filled = calls + 1, 0
    return calls, sum(sizes)


def check_scratch_all_reduces(folder: Path, out: str) -> None:
    """The record's all-reduces per step (counted by the harness on the instrumented step) are the
    buckets' (the loss's all-reduce for the log is outside the step), and so is the logged line."""
    (record,) = read_records(folder / "r.jsonl")
    calls, nbytes = bucketed_all_reduces(int(BUCKET_MIB * 2**20))
    assert calls > 2  # the cap matters: more than one bucket, fewer than one per tensor
    counted = record["metrics"]["comm_per_step"]["all_reduce"]
    assert (counted["calls"], counted["bytes"]) == (calls, nbytes), \
        f"{NOT_THE_BUCKETS}: recorded {counted}, {calls} buckets of {nbytes} bytes"
    (line,) = logged(r"all-reduce per step: (\d+) calls, ([\d.]+) MiB", out)
    assert (int(line[0]), line[1]) == (calls, f"{nbytes / 2**20:.2f}"), line


def test_from_scratch_all_reduces_are_its_buckets(scratch_runs):
    pinned(scratch_runs, check_scratch_all_reduces, "cap_ignored", output=True, match=NOT_THE_BUCKETS)


def test_from_scratch_tokens_per_s_and_mfu_are_recomputed(scratch_runs):
    """tokens/s = the global batch's tokens over the slowest rank's median step; MFU from the formula
    (observed.check_tokens_per_s, check_mfu). Mutant: the harness told one rank's tokens."""
    pinned(scratch_runs, rate_check(B * CFG.seq_len, CFG), "one_ranks_tokens", match=TOKENS_PER_STEP)


# ==== ddp_spawn.py =================================================================================

SPAWN = REPO / "01-ddp-basics" / "ddp_spawn.py"
SPAWN_RUNS = {
    "correct": None,
    "rank0_rows": ("rank_slice(t, ctx.rank, ctx.world_size)", "rank_slice(t, 0, ctx.world_size)"),
}


def spawn_observed(folder: Path, mutation: tuple[str, str] | None):
    """``python ddp_spawn.py --nproc W ...`` (or its mutant) with this file as its observer."""
    # the script's flags travel in the setup: on the fork launcher's command line it would take
    # --nproc for an abbreviation of its own --nproc_per_node
    setup = {"classes": ["TinyGPT"], "out": str(folder / "seen"), "script": str(SPAWN), "mutation": mutation,
             "argv": ["--nproc", str(W), "--model-size", "tiny", "--global-batch-size", str(B), "--steps", str(STEPS)]}
    return python(Path(__file__), timeout=240, env=job_env(folder, **{SPAWN_ENV: json.dumps(setup)}))


@pytest.fixture(scope="module")
def spawn_runs(tmp_path_factory):
    return run_jobs({name: lambda folder, m=mutation: spawn_observed(folder, m)
                     for name, mutation in SPAWN_RUNS.items()}, tmp_path_factory)


def check_spawn_rows(folder: Path, out: str) -> None:
    assert f"spawned {W} processes" in out and "[rank 0] done" in out
    for rank in range(W):
        check_rows(seen_calls(folder, rank), rank)


def test_spawn_feeds_each_rank_its_own_rows(spawn_runs):
    pinned(spawn_runs, check_spawn_rows, "rank0_rows", output=True, match=NOT_ITS_ROWS)


SPAWN_LOSS = re.compile(rf"^(\[rank 0\] step (\d+)/{STEPS} \| loss on rank 0's shard )([\d.]+)$", re.MULTILINE)


def spawn_losses(calls: list[list[dict]]) -> list[list[float]]:
    """[rank][step]: each rank's token cross-entropy of its observed logits against its rows' targets."""
    return [[cross_entropy(calls[r][step], rows_of(step, r)[1]) for step in range(STEPS)] for r in range(W)]


def check_spawn_losses(calls: list[list[dict]], out: str) -> None:
    """Every step's logged loss (the script logs each one at this step count) is rank 0's own."""
    expected = spawn_losses(calls)[0]
    printed = {int(step): float(loss) for _, step, loss in SPAWN_LOSS.findall(out)}
    assert sorted(printed) == list(range(1, STEPS + 1)), printed
    for step, loss in printed.items():  # 4 decimals: half a unit of the last one, and float32's slack
        assert abs(loss - expected[step - 1]) <= 5e-5 + 1e-5, \
            f"step {step}: {NOT_RANK_0S}: logged {loss}, rank 0's {expected[step - 1]}"


def test_spawn_logged_losses_are_rank_0s_observed_logits(spawn_runs):
    folder, done = job(spawn_runs, "correct")
    calls = [seen_calls(folder, rank) for rank in range(W)]
    check_spawn_losses(calls, done.stdout)
    # controls on the same run: the job's mean over ranks logged under rank 0's label; rank 1's logits
    per_rank = spawn_losses(calls)
    mean = SPAWN_LOSS.sub(lambda m: m[1] + f"{sum(r[int(m[2]) - 1] for r in per_rank) / W:.4f}", done.stdout)
    for calls_seen, out in ((calls, mean), (calls[::-1], done.stdout)):
        with pytest.raises(AssertionError, match=NOT_RANK_0S):
            check_spawn_losses(calls_seen, out)


def observe_spawned_script() -> None:
    """Run as ``__main__`` (the script's parent) or ``__mp_main__`` (a spawned rank): define the
    script's functions here, as the script's own module would; the parent also runs its main block,
    and a spawned rank installs observe.py's hook at its model's first forward (the script's worker
    sets ``RANK`` before it builds the model, and observe.py names its file by ``RANK``)."""
    from distkit.mutation import mutated_source
    from workers.observe import install

    setup = json.loads(os.environ[SPAWN_ENV])
    script = Path(setup["script"])
    source = mutated_source(script, *setup["mutation"]) if setup["mutation"] else script.read_text()
    if __name__ == "__mp_main__":
        def first_forward(module, args):
            if "RANK" in os.environ and not installed:
                installed.append(True)
                handle.remove()
                # global forward hooks are read after forward: this call is recorded too
                install(set(setup["classes"]), Path(setup["out"]), outputs=True)
        installed: list = []
        handle = torch.nn.modules.module.register_module_forward_pre_hook(first_forward)
    else:
        sys.argv = [str(script), *setup["argv"]]
    # into this module's namespace: mp.spawn pickles the script's worker as __main__.worker, which
    # a spawned rank finds in its __mp_main__ (this file again, with the same definitions)
    exec(compile(source, str(script), "exec"), globals())  # noqa: S102 (the script itself, as python runs it)


# ==== ddp_benchmark.py =============================================================================

BENCHMARK = REPO / "01-ddp-basics" / "ddp_benchmark.py"
PER_RANK, SIZES = 1, (1, 2)
BENCHMARK_RUNS = {
    "correct": None,
    "speedup_from_step_times": ('speedup = r["metrics"]["tokens_per_s"] / base["metrics"]["tokens_per_s"]',
                                'speedup = base["metrics"]["step_time_s_median"] / r["metrics"]["step_time_s_median"]'),
}
ROW = re.compile(r"^(strong|weak) +(\d+) +(\d+) +([\d.]+) +([\d,]+) +([\d.]+)x +(\d+)%$", re.MULTILINE)


def benchmark(folder: Path, mutation: tuple[str, str] | None):
    """The driver (``python ddp_benchmark.py``, or its mutant through distkit/mutation.py), its jobs
    launched by the fork launcher (``$DISTKIT_TORCHRUN``)."""
    flags = ["--world-sizes", *SIZES, "--model-size", "tiny", "--per-rank-batch", PER_RANK, "--steps", 2,
             "--warmup-steps", 0, "--results", folder / "r.jsonl", "--plot", folder / "p.png"]
    head = [REPO / "distkit" / "mutation.py", BENCHMARK, *mutation, "--"] if mutation else [BENCHMARK]
    return python(*head, *flags, timeout=240,
                  env=job_env(folder, DISTKIT_TORCHRUN=shlex.join(launcher_argv("fork"))))


@pytest.fixture(scope="module")
def benchmark_runs(tmp_path_factory):
    return run_jobs({name: lambda folder, m=mutation: benchmark(folder, m)
                     for name, mutation in BENCHMARK_RUNS.items()}, tmp_path_factory)


def check_benchmark_table(folder: Path, out: str) -> None:
    run_id = re.search(r"\(run (\S+)\)", out).group(1)
    records = [r for r in read_records(folder / "r.jsonl") if r["config"]["run_id"] == run_id]
    by_row = {(r["config"]["scaling"], r["world_size"]): r for r in records}
    assert sorted(by_row) == sorted((mode, n) for mode in ("strong", "weak") for n in SIZES) == sorted(
        (mode, int(n)) for mode, n, *_ in ROW.findall(out)), out[-2000:]
    tokens_per_s = {}
    for (mode, n), record in by_row.items():
        batch = PER_RANK * (max(SIZES) if mode == "strong" else n)
        assert record["config"]["global_batch_size"] == batch
        check_tokens_per_s(record, batch * CFG.seq_len)  # the record's rate is its step times'
        tokens_per_s[mode, n] = batch * CFG.seq_len / slowest_median(record["metrics"])
    for mode, n, batch, step_s, rate, speedup, efficiency in ROW.findall(out):
        n, base = int(n), min(SIZES)
        expected = tokens_per_s[mode, n] / tokens_per_s[mode, base]
        assert int(batch) == by_row[mode, n]["config"]["global_batch_size"]
        # each printed column within half a unit of its last digit (and float slack) of the recomputed value
        assert abs(float(step_s) - slowest_median(by_row[mode, n]["metrics"])) <= 5e-4 + 1e-9, (mode, n, step_s)
        assert abs(float(rate.replace(",", "")) - tokens_per_s[mode, n]) <= 0.5 + 1e-6, (mode, n, rate)
        assert abs(float(speedup) - expected) <= 5e-3 + 1e-9, f"{mode} {n}: {SPEEDUP}: {speedup}x vs {expected}"
        assert abs(float(efficiency) - 100 * expected / (n / base)) <= 0.5 + 1e-9, (mode, n, efficiency)


def test_benchmark_table_is_recomputed_from_the_step_times(benchmark_runs):
    pinned(benchmark_runs, check_benchmark_table, "speedup_from_step_times", output=True, match=SPEEDUP)


# ==== zero_offload.py ==============================================================================

OFFLOAD = REPO / "03-deepspeed" / "zero_offload.py"
CONFIGS = ("zero3", "zero3_offload")  # the order the script trains them in
OFFLOAD_RUNS = {
    "correct": None,
    "rank0_rows": ("inputs = rank_slice(inputs, ctx.rank, ctx.world_size)",
                   "inputs = rank_slice(inputs, 0, ctx.world_size)"),
    "next_ranks_targets": ("targets = rank_slice(targets, ctx.rank, ctx.world_size)",
                           "targets = rank_slice(targets, (ctx.rank + 1) % ctx.world_size, ctx.world_size)"),
    "per_rank_tokens": ("tokens=batch * cfg.seq_len)", "tokens=batch * cfg.seq_len // ctx.world_size)"),
}


@pytest.fixture(scope="module")
def offload_runs(tmp_path_factory):
    return observe_jobs(tmp_path_factory, OFFLOAD, "TinyGPT", OFFLOAD_RUNS, lambda folder: [
        "--model-size", "tiny", "--global-batch-size", B, "--steps", STEPS, "--warmup-steps", 0,
        "--results", folder / "r.jsonl"], nproc=W, outputs=True)


def offload_records(folder: Path) -> list[dict]:
    records = read_records(folder / "r.jsonl")
    assert [r["strategy"] for r in records] == list(CONFIGS)
    return records


def check_offload_rows(folder: Path) -> None:
    for rank in range(W):
        calls = seen_calls(folder, rank)
        assert len(calls) == len(CONFIGS) * STEPS, f"rank {rank}: {len(calls)} forwards"
        for c in range(len(CONFIGS)):
            check_rows(calls[c * STEPS:(c + 1) * STEPS], rank)


def check_offload_losses(folder: Path, out: str) -> None:
    calls = seen_calls(folder, 0)
    printed = dict(logged(r"(\w+): step time [\d.]+ s \| final loss ([\d.]+) \|", out))
    assert sorted(printed) == sorted(CONFIGS), printed
    for c, record in enumerate(offload_records(folder)):
        expected = cross_entropy(calls[(c + 1) * STEPS - 1], rows_of(STEPS - 1, 0)[1])
        assert record["final_loss"] == pytest.approx(expected, abs=1e-5), \
            f"{record['strategy']}: {FINAL_LOSS}: recorded {record['final_loss']}, recomputed {expected}"
        assert abs(float(printed[record["strategy"]]) - expected) <= 5e-5 + 1e-5


def check_offload_rates(folder: Path, out: str) -> None:
    records = offload_records(folder)
    printed = dict(logged(r"(\w+): step time ([\d.]+) s \|", out))
    for record in records:
        check_tokens_per_s(record, B * CFG.seq_len)
        assert record["metrics"]["samples_per_step"] == B
        step_s = slowest_median(record["metrics"])
        assert record["metrics"]["step_time_s_median"] == step_s
        assert abs(float(printed[record["strategy"]]) - step_s) <= 5e-4 + 1e-9
    (cost,) = logged(r".*costs ([\d.]+)x step time$", out)
    ratio = slowest_median(records[1]["metrics"]) / slowest_median(records[0]["metrics"])
    assert abs(float(cost) - ratio) <= 5e-3 + 1e-9, (cost, ratio)


def test_offload_feeds_each_rank_its_own_rows_in_both_configs(offload_runs):
    pinned(offload_runs, check_offload_rows, "rank0_rows", match=NOT_ITS_ROWS)


def test_offload_final_losses_are_the_observed_logits(offload_runs):
    pinned(offload_runs, check_offload_losses, "next_ranks_targets", output=True, match=FINAL_LOSS)
    check_offload_rows(job(offload_runs, "next_ranks_targets")[0])  # the inputs were right all along


def test_offload_rates_and_step_times_are_the_recorded_times(offload_runs):
    pinned(offload_runs, check_offload_rates, "per_rank_tokens", output=True, match=TOKENS_PER_STEP)


if __name__ in ("__main__", "__mp_main__") and SPAWN_ENV in os.environ:
    observe_spawned_script()
