"""The tiny Llama (Hugging Face ``LlamaForCausalLM`` built from a config, ``--arch llama``) trains to
the same weights as one process under the chapters' data-parallel strategies, as the small GPT does.

The same jobs and tolerances as the GPT's tests, on the other architecture:

* chapter 01, ``ddp_training.py`` (its README command, 4 ranks, 2 micro-batches per step, AdamW with
  clipping and the warm-up/cosine schedule): every weight within ``ch01_common.TOLERANCE`` (5e-5) of
  one process taking the whole global batch. What it is for: a rank that trains on the wrong slice, a
  lost micro-batch or a missed all-reduce moves AdamW's weights by ~lr = 3e-3 per step.
* chapter 03, ``zero_memory.py`` (its README command: ZeRO 0, 1, 2, 3 and 3 + CPU offload one after
  another in one 4-rank DeepSpeed job, AdamW): within ``ch03_common.WEIGHT_TOL`` (5e-5), and the
  per-rank model state equals the ZeRO formula for the Llama's parameter count.
* chapter 02, ``fsdp_transformer.py`` (its README sweep command: FULL_SHARD, SHARD_GRAD_OP, NO_SHARD,
  HYBRID_SHARD and DDP in one 4-rank job, AdamW): within ``ch02_common.FP32_ATOL`` (2e-4), and the
  bytes the harness counted equal distkit.theory's prediction for the Llama's shapes (GQA's narrower
  k/v projections included); the records carry the Llama's config, tokens/s per device and MFU.
* Tied embeddings (``--tie-embeddings on``: Llama-3.2-1B's ``lm_head`` IS the embedding matrix):
  ``fsdp_transformer.py --sharding full_shard ddp`` (FSDP2 FULL_SHARD and torch DDP, one 4-rank job,
  AdamW) within ``ch02_common.FP32_ATOL`` (2e-4) of one process training the tied model, the tie
  intact in both saved state dicts, the bytes as distkit.theory predicts them (the shared matrix
  counted once). What it is for: a strategy that breaks the tie (the embedding and the LM head
  sharded, or replicated, as two parameters that each see only their own share of the gradient, then
  drift apart). Negative control, in this process: the same model with the tie broken (``lm_head``
  given its own copy of the matrix at the start) lands 2.4e-2 from the tied reference after the same
  4 steps (measured; 120x FP32_ATOL), while the correct runs land at 2.5e-5 (FULL_SHARD) and 2.6e-5
  (DDP). The Hugging Face round trip of a tied model is in test_ch02_hf.py.
* Negative controls, because AdamW and clipping hide a gradient of the wrong scale: the shared
  negative-controls worker (tests/workers/negative_controls.py, plain SGD, 2 ranks) with
  ``--arch llama`` trains DDP and FSDP FULL_SHARD correctly (within the tolerance) and broken
  (gradients summed instead of averaged; a rank's gradient shard dropped), and the broken variants
  must land at least ``WIDE`` (100) x the tolerance away.

The five jobs run once, two at a time, in a module fixture.
"""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import ch01_common as ch01
import ch02_common as ch02
import ch03_common as ch03
from distkit import compare, theory
from distkit.checkpoint import safe_load
from distkit.harness import read_records
from distkit.models import build_model, model_config
from launch import WORKERS, command_argv, job_env, readme_command, run, torchrun
from workers.reference import train_one_process

LLAMA = ["--arch", "llama"]
TIED = ["--tie-embeddings", "on"]
TIED_STRATEGIES = ["full_shard", "ddp"]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict:
    names = ("ddp", "fsdp", "zero", "negative", "tied")
    folders = {name: tmp_path_factory.mktemp(f"llama_{name}") for name in names}

    def ddp():
        folder = folders["ddp"]
        run([*ch01.readme_argv("--config"), *ch01.training_flags(folder), *LLAMA], env=job_env(folder),
            timeout=900)
        return folder

    def fsdp():
        folder = folders["fsdp"]
        ch02.run_readme(ch02.SWEEP, folder, *ch02.TINY, "--steps", ch02.STEPS, *LLAMA,
                        "--results", folder / "records.jsonl", "--save", folder / "params" / "{strategy}.pt",
                        timeout=900)
        return folder

    def zero():
        folder = folders["zero"]
        argv = command_argv(readme_command(ch03.README, "zero_memory.py"))
        run([*argv, *ch03.SMALL, "--steps", "4", "--lr", str(ch03.LR), *LLAMA, "--record", str(folder / "zero.jsonl"),
             "--save", str(folder / "params" / "{strategy}.pt"), "--results", str(folder / "results.jsonl")],
            env=job_env(folder), timeout=900)
        return folder

    def negative():
        folder = folders["negative"]
        torchrun(WORKERS / "negative_controls.py", *LLAMA, "--cases", "ch01_ddp", "ch02_full_shard",
                 "--out", folder / "diffs.json", nproc=2, tmp_path=folder, timeout=900)
        return json.loads((folder / "diffs.json").read_text())

    def tied():
        folder = folders["tied"]
        ch02.run_readme(ch02.SWEEP, folder, *ch02.TINY, "--steps", ch02.STEPS, *LLAMA, *TIED,
                        "--sharding", *TIED_STRATEGIES, "--results", folder / "records.jsonl",
                        "--save", folder / "params" / "{strategy}.pt", timeout=900)
        return folder

    def attempt(job):
        try:
            return job()
        except AssertionError as exc:  # a failed job fails the tests that use it, not the others
            return exc

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(attempt, [ddp, fsdp, zero, negative, tied]))
    return dict(zip(names, results))


def _job(jobs, name):
    if isinstance(jobs[name], BaseException):
        raise jobs[name]
    return jobs[name]


def test_ddp_training_trains_the_llama_like_one_process(jobs):
    folder = _job(jobs, "ddp")
    reference = ch01.single_process_params("llama")
    trained = ch01.final_params(folder)
    assert "model.layers.0.self_attn.q_proj.weight" in trained  # Hugging Face's names, through DDP
    assert ch01.max_diff(trained, reference) < ch01.TOLERANCE
    record = read_records(folder / "results.jsonl")[-1]
    assert record["model"] == {"arch": "llama", **model_config("llama", "tiny").to_dict()}
    assert record["param_count"] == sum(t.numel() for t in reference.values())


def test_every_fsdp_strategy_trains_the_llama_like_one_process(jobs):
    folder = _job(jobs, "fsdp")
    initial, reference = ch02.reference_state(ch02.STEPS, arch="llama")
    assert ch02.max_diff(initial, reference) > 50 * ch02.FP32_ATOL  # training moved the weights
    for strategy in ch02.STRATEGIES:
        trained = torch.load(folder / "params" / f"{strategy}.pt", weights_only=True)
        assert ch02.max_diff(trained, reference) <= ch02.FP32_ATOL, strategy


def test_fsdp_bytes_of_the_llama_are_the_predicted_ones(jobs):
    """FSDP2 pads each parameter's dim 0 to a multiple of the shard group; the Llama's k/v projections
    are half as wide as q (4 of 8 heads), so its units differ from the GPT's: the prediction is made
    from its own shapes (distkit.theory) and must still be exact, and MFU is reported."""
    folder = _job(jobs, "fsdp")
    cfg = model_config("llama", "tiny", vocab_size=65)
    for record in read_records(folder / "records.jsonl"):
        assert record["model"]["arch"] == "llama" and record["model"]["vocab_size"] == 65
        compared = compare.compare_record(record)
        for row in compared["state"] + compared["comm"]:  # every rank, every collective
            assert row["measured"] == row["predicted"], (record["strategy"], row)
        metrics = record["metrics"]
        assert metrics["model_flops_per_token"] == theory.training_flops_per_token(cfg)
        assert metrics["tokens_per_s_per_device"] == pytest.approx(metrics["tokens_per_s"] / 4)
        assert 0 < metrics["mfu"] < 1


def test_every_zero_stage_trains_the_llama_like_one_process_with_the_formulas_state(jobs):
    folder = _job(jobs, "zero")
    reference = ch03.reference_weights(steps=4, batch=16, arch="llama")
    records = read_records(folder / "results.jsonl")
    assert [r["strategy"] for r in records] == ch03.STRATEGIES
    psi, n = sum(t.numel() for t in reference.values()), 4
    for record in records:
        diff = ch03.max_diff(safe_load(folder / "params" / f"{record['strategy']}.pt"), reference)
        assert diff < ch03.WEIGHT_TOL, f"{record['strategy']}: max |w - w_single| = {diff:.2e}"
        assert record["model"]["arch"] == "llama" and record["param_count"] == psi
        expected = ch03.expected_state(record["config"]["zero_stage"], psi, n)
        for measured in record["metrics"]["model_state_bytes_per_rank"]:
            for key, value in expected.items():
                assert abs(measured[key] - value) <= 0.05 * value, (record["strategy"], key, measured)


def test_summed_or_dropped_gradients_of_the_llama_fail_the_tolerance(jobs):
    diffs = _job(jobs, "negative")
    for case, correct, broken in [("ch01_ddp", ["correct"], ["summed"]),
                                  ("ch02_full_shard", ["correct"], ["summed", "dropped_shard"])]:
        assert diffs[case]["moved"] > ch01.WIDE * ch01.TOLERANCE, case  # the comparison is not empty
        for variant in correct:
            assert diffs[case][variant] < ch01.TOLERANCE, (case, variant, diffs[case])
        for variant in broken:
            assert diffs[case][variant] > ch01.WIDE * ch01.TOLERANCE, (case, variant, diffs[case])


def tied_reference(untie: bool = False) -> tuple[dict, dict]:
    """One process, AdamW, the tiny Llama with tied embeddings (vocab 65, seed 0, as the job):
    (initial, final) state dicts. ``untie``: the negative control, the LM head given its own copy of
    the embedding matrix before training (a tie broken by a strategy)."""
    cfg = model_config("llama", "tiny", vocab_size=65, tie_embeddings=True)
    torch.manual_seed(0)
    model = build_model(cfg)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    if untie:
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    return train_one_process(model, torch.optim.AdamW(model.parameters(), lr=ch02.LR), ch02.STEPS, 8)


def test_tied_embeddings_train_like_one_process_under_ddp_and_full_shard(jobs):
    """Bug caught (FP32_ATOL, module docstring): the tie broken by a strategy. Negative control: the
    untied reference misses the tied one by far more than the tolerance."""
    folder = _job(jobs, "tied")
    initial, reference = tied_reference()
    assert torch.equal(reference["lm_head.weight"], reference["model.embed_tokens.weight"])
    assert ch02.max_diff(initial, reference) > 50 * ch02.FP32_ATOL  # training moved the weights
    for strategy in TIED_STRATEGIES:
        trained = torch.load(folder / "params" / f"{strategy}.pt", weights_only=True)
        # the tie survived sharding: one matrix, under both names, bit for bit
        assert torch.equal(trained["lm_head.weight"], trained["model.embed_tokens.weight"]), strategy
        assert ch02.max_diff(trained, reference) <= ch02.FP32_ATOL, strategy
    _, untied = tied_reference(untie=True)
    assert not torch.equal(untied["lm_head.weight"], untied["model.embed_tokens.weight"])
    assert ch02.max_diff(untied, reference) > 50 * ch02.FP32_ATOL  # the negative control fails

    unique = sum(t.numel() for name, t in initial.items() if name != "lm_head.weight")
    records = read_records(folder / "records.jsonl")
    assert [r["strategy"] for r in records] == ["fsdp_full_shard", "ddp"]
    for record in records:
        assert record["model"]["tie_embeddings"] is True and record["param_count"] == unique
        compared = compare.compare_record(record)
        for row in compared["state"] + compared["comm"]:  # the shared matrix counted once
            assert row["measured"] == row["predicted"], (record["strategy"], row)
