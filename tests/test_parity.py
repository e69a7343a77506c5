"""Loss-curve parity, the short version: benchmarks/README.md's ``python benchmarks/parity.py`` with
``--steps 20``, as the reader's play runs it (tests/spine.py; the full run is recorded, not run here).

* ``test_every_strategy_follows_one_process_and_the_control_leaves_the_band``: DDP, FSDP (full,
  grad-op, hybrid), ZeRO-1/2/3, TP+SP, PP (1F1B), FSDP x TP and CP each recorded a loss at every step,
  and saved weights every ``EVERY`` steps whose held-out loss is, within ``BAND`` (argued below from
  fp32's spacing and the steps) of one process's, on the same text; the negative control (FSDP with
  rank 1's shard never updated) is outside it on both, and the run says so and exits 0.
* ``test_one_process_is_plain_training``: the reference itself is one plain process: its per-step
  losses, and its held-out losses after steps 10 and 20, are what this test computes by training the
  tiny Llama with AdamW on the same text batches in its own loop and evaluating it on the held-out
  windows. Negative controls: the same loop with the batches of the synthetic task does not give the
  losses, and the final weights' held-out loss is not the step-10 one (a script saving its final
  weights at every interval, or none, would fail).
* ``test_the_two_rank_data_parallel_rows_are_one_run``: DDP, FSDP full/grad-op and ZeRO-1/2 on 2 ranks
  record the same losses bit for bit (benchmarks/README.md says why), here and in the committed
  record; the 4-rank HSDP row differs from them.
"""
from __future__ import annotations

import json

import pytest
import torch

from benchmarks_common import PARITY_EVERY, PARITY_STEPS
from distkit.models import build_model, lm_loss, model_config
from distkit.text import TextTask
from launch import REPO, load_script
from spine import play_chapter

STEPS, EVERY = PARITY_STEPS, PARITY_EVERY
PARITY = load_script(REPO / "benchmarks" / "parity.py")
# This test's own band, argued from the dtype and the steps (not the script's 0.02 nats, which is a
# judgment for its 1000-step run): correct strategies start from the same weights and differ only in
# the order fp32 sums; each step can add a few ulp of the loss to their gap (AdamW enlarges it where a
# gradient is near zero), so allow 10 ulp per step of the largest loss (the first, ln 256 = 5.5 nats:
# an fp32 ulp of 4.8e-7 from 4 to 8), 20 steps: about 1e-4 nats. Observed: 1 ulp (4.8e-7). A wrong
# update (the control) moves the loss by tenths of a nat within the first steps, 1000x the band.
ULP_AT_LOSS = torch.finfo(torch.float32).eps * 4  # the spacing of fp32 numbers in [4, 8)
BAND = 10 * STEPS * ULP_AT_LOSS


@pytest.fixture(scope="module")
def parity(reader):
    """``python benchmarks/parity.py`` as the reader's play ran it (tests/spine.py), for STEPS steps with
    held-out losses every EVERY (benchmarks_common.PLAY), its records where the README's command
    writes them."""
    played = play_chapter("benchmarks", reader)
    assert played.ok("benchmarks/parity.py")["command"] == "python benchmarks/parity.py"
    rows = [json.loads(line) for line in (reader.clone / "runs" / "parity.jsonl").read_text().splitlines()]
    return played.completed("benchmarks/parity.py"), {row["strategy"]: row for row in rows}


def test_every_strategy_follows_one_process_and_the_control_leaves_the_band(parity):
    """Every strategy within BAND of one process at every step and every save, the control far outside
    it; the runner's own verdict (its 0.02-nat band) agrees with both."""
    CONTROL, STRATEGIES = PARITY.CONTROL, PARITY.STRATEGIES
    done, rows = parity
    assert set(rows) == {*STRATEGIES, CONTROL[0]}
    reference = rows["one_process"]["losses"]
    assert len(reference) == STEPS and 4 <= max(reference) < 8  # the ulp BAND is argued from
    held_reference = rows["one_process"]["held_out"]
    for name, row in rows.items():
        gap = max(abs(a - b) for a, b in zip(row["losses"], reference))  # recomputed, not read
        assert len(row["losses"]) == STEPS and [k for k, _ in row["held_out"]] == [EVERY, STEPS]
        held_gap = max(abs(a[1] - b[1]) for a, b in zip(row["held_out"], held_reference))
        if name == CONTROL[0]:
            assert gap > 1000 * BAND and held_gap > 1000 * BAND and not row["within_tolerance"], (name, gap, held_gap)
        else:
            assert gap <= BAND and held_gap <= BAND and row["within_tolerance"], (name, gap, held_gap)
    assert "the control left the band" in done.stdout


# On 2 ranks these do the same arithmetic: averaging two gradients is one addition, whatever is sharded
ONE_RUN = ("ddp", "fsdp_full_shard", "fsdp_shard_grad_op", "zero1", "zero2")


def test_the_two_rank_data_parallel_rows_are_one_run(parity):
    """benchmarks/README.md says DDP, FSDP full/grad-op and ZeRO-1/2 on 2 ranks record the same loss at
    every step, bit for bit: in this run and in the committed 1000-step record. Control: the 4-rank
    HSDP row, which regroups the sum, differs from them."""
    _, rows = parity
    committed = {r["strategy"]: r for r in map(json.loads, (REPO / "benchmarks" / "records" / "parity.jsonl")
                                                 .read_text().splitlines())}
    for losses_of in (rows, committed):
        assert len({tuple(losses_of[name]["losses"]) for name in ONE_RUN}) == 1
        assert losses_of["fsdp_hybrid_shard"]["losses"] != losses_of["ddp"]["losses"]


def reference_losses(task, held_out: dict | None = None) -> list[float]:
    """The parity model (the tiny Llama) trained in this process: same seed, same AdamW, the task's
    global batches. ``held_out``, if given, gets {step: held-out loss} every EVERY steps."""
    cfg = model_config(PARITY.ARCH, "tiny", vocab_size=256)
    torch.manual_seed(PARITY.SEED)  # as the scripts do before building the model
    model = build_model(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=PARITY.LR)
    windows = TextTask(cfg, seed=PARITY.SEED).held_out(PARITY.HELD_OUT_WINDOWS)
    losses = []
    for step in range(STEPS):
        if held_out is not None and step and step % EVERY == 0:
            with torch.no_grad():
                held_out[step] = lm_loss(model(windows[0]), windows[1]).item()
        inputs, targets = task.global_batch(step, PARITY.GLOBAL_BATCH)
        optimizer.zero_grad()
        loss = lm_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    if held_out is not None:
        with torch.no_grad():
            held_out[STEPS] = lm_loss(model(windows[0]), windows[1]).item()
    return losses


def test_one_process_is_plain_training(parity):
    from distkit.models import TokenTask

    _, rows = parity
    cfg = model_config(PARITY.ARCH, "tiny", vocab_size=256)
    recorded = rows["one_process"]["losses"]
    held_out = {}
    assert max(abs(a - b) for a, b in zip(reference_losses(TextTask(cfg, seed=0), held_out), recorded)) <= 1e-5
    assert [[k, pytest.approx(v, abs=1e-5)] for k, v in held_out.items()] == rows["one_process"]["held_out"]
    assert abs(held_out[EVERY] - held_out[STEPS]) > 1e-2  # the step-10 weights are not the final ones
    synthetic = reference_losses(TokenTask(cfg, seed=0))
    assert max(abs(a - b) for a, b in zip(synthetic, recorded)) > 0.1
    # every correct run ends with weights whose held-out loss is one process's
    held = rows["one_process"]["held_out_loss"]
    assert all(abs(r["held_out_loss"] - held) <= 1e-4 for name, r in rows.items() if r["within_tolerance"])


def test_save_every_names_and_steps():
    """``--save-every N`` (distkit.flags): saves after every N-th step but the last, which the final
    save writes; the file is --save's with the step before its suffix. Controls: N=0 saves nothing
    between, and N larger than the run too."""
    from types import SimpleNamespace

    from distkit.flags import saved_at, saves_after

    def steps(every, total):
        return [s + 1 for s in range(total) if saves_after(SimpleNamespace(save_every=every, steps=total), s)]

    assert steps(10, 20) == [10] and steps(100, 1000) == list(range(100, 1000, 100)) and steps(3, 10) == [3, 6, 9]
    assert steps(0, 20) == [] and steps(50, 20) == []
    assert PARITY.held_out_steps(20, 10) == [10, 20] and PARITY.held_out_steps(1000, 100)[-2:] == [900, 1000]
    assert [saved_at(p, 100) for p in ("runs/m.pt", "runs/a.b/m", None)] == \
        ["runs/m.step100.pt", "runs/a.b/m.step100", None]
