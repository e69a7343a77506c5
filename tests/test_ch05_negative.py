"""Negative controls for chapter 05's equivalence tests (test_ch05_advanced.py): the same comparison
with single-process SGD training (ch05_common: TOLERANCE 1e-5, lr 0.5, 3 steps), run on deliberately broken
variants, must fail it by a wide factor.

One 4-rank launch of the worker; each strategy is built from the chapter script's own functions
(tensor_parallel.apply_tensor_parallel, the hybrid layout of hybrid_parallelism.py on a 2 x 2 mesh,
pipeline_parallel.make_stage_module with GPipe) and compared with a reference trainer in the worker.
Bugs: accumulation without the 1/k loss scaling and with one of k=2 micro-batches skipped (the
DDP + no_sync loop of gradient_accumulation.py); rank 1's gradient shard dropped (TP, TP+SP, 2-D,
HSDP); one of 4 pipeline micro-batches' loss lost.

Measured on 2-core CPU, gloo (max |distributed - single|; training moves weights by up to 7.1e-2,
4.7e-2 for the 4-layer pipeline model): every correct variant 6e-8 to 1.2e-7; the bugs 3.6e-2 (2-D
dropped shard) to 8.3e-2. TOLERANCE sits ~100x above the correct runs and ~3,600x below the
smallest bug.

Gradients summed over the data-parallel ranks instead of averaged are made in the scripts themselves
(the last test): hybrid_parallelism.py's 2-D and HSDP layouts, gradient_accumulation.py on 4 ranks
and on 2.

The accumulation cases above use the worker's own copy of the no_sync loop. The last test mutates
gradient_accumulation.py itself (tests/workers/ch05_mutant.py deletes its ``/ k``) and runs the
README command exactly as test_ch05_advanced's equivalence test does: the weights it saves must miss
the reference by far more than TOLERANCE. With SGD, no 1/k makes every step k = 4 times too large:
measured 1.6e-1 on 2-core CPU, gloo (both sync modes), 16,000x the tolerance.
"""
import json

import pytest
import torch

from ch05_common import LOOKUPS, PLAY, QUICK, TOLERANCE, readme_command, reference
from launch import REPO, WORKERS, job, run_jobs, torchrun
from test_ch05_advanced import assert_matches

WIDE = 100  # a bug must exceed the tolerance by at least this factor
CASES = {"accumulation": ("accumulated", ["unscaled_loss", "skipped_micro_batch"]),
         "ch05_tp": ("correct", ["dropped_shard"]),
         "ch05_tp_sp": ("correct", ["dropped_shard"]),
         "ch05_2d": ("correct", ["dropped_shard"]),
         "ch05_hsdp": ("correct", ["dropped_shard"]),
         "ch05_pp": ("correct", ["skipped_micro_batch"])}


def test_broken_variants_of_every_strategy_fail_the_tolerance(tmp_path):
    out = tmp_path / "diffs.json"
    result = torchrun(WORKERS / "negative_controls.py", "--cases", *CASES, "--out", out, nproc=4,
                      tmp_path=tmp_path, timeout=400)
    print(result.stdout[-2500:])  # the measured differences, shown with -s
    diffs = json.loads(out.read_text())
    for case, (correct, bugs) in CASES.items():
        assert diffs[case]["moved"] > WIDE * TOLERANCE, case
        assert diffs[case][correct] < TOLERANCE, (case, diffs[case])
        for bug in bugs:
            assert diffs[case][bug] > WIDE * TOLERANCE, (case, bug, diffs[case])


def test_accumulation_without_1_over_k_fails_the_equivalence_test(tmp_path):
    """The bug the equivalence test must catch, made in the script itself: ``loss / k`` -> ``loss``."""
    k = 4
    nproc, script, args = readme_command("gradient_accumulation.py")
    torchrun(WORKERS / "ch05_mutant.py", REPO / script, "lm_loss(model(x), y) / k", "lm_loss(model(x), y)",
             "--", *args, *QUICK, "--grad-accum-steps", k, "--micro-batch-size", 2,
             "--results", tmp_path / "r.jsonl", "--save", tmp_path / "{sync}.pt",
             nproc=nproc, tmp_path=tmp_path, timeout=400)
    expected, _ = reference(2 * k * nproc)  # the same reference as the equivalence test
    for sync in ("no_sync", "every_micro_batch"):
        state = torch.load(tmp_path / f"{sync}.pt", weights_only=True)["model"]
        diff = max((state[n] - expected[n]).abs().max().item() for n in expected)
        print(f"{sync} without 1/k: max |distributed - single| = {diff:.2e}")
        assert diff > WIDE * TOLERANCE, (sync, diff)


# The Llama's bugs, made in the scripts themselves and run as test_ch05_advanced's Llama tests run
# them (the README command, QUICK flags, --arch llama). Measured on 2-core CPU, gloo (max |distributed
# - single|): the correct runs 6e-8 to 1.2e-7; o_proj unreduced 4.0e-2 (4,000x TOLERANCE), a stage
# skipping a layer 8.6e-2 (8,600x).
LLAMA_MUTANTS = {
    # tensor_parallel.py's plan (distkit/tp_plans.py's, taken by the script's one tp_plan line; run
    # with --arch llama): the attention's row-parallel output o_proj asks for Partial() output, so
    # each rank goes on with its own partial sum: Megatron's "g" all-reduce forgotten.
    "o_proj_unreduced": (("tensor_parallel.py",), "--sequence-parallel",
                         "block_plan, model_plan = tp_plan(model.cfg.arch, sequence_parallel)",
                         "block_plan, model_plan = tp_plan(model.cfg.arch, sequence_parallel); "
                         "block_plan['self_attn.o_proj'] = __import__('torch').distributed.tensor.parallel."
                         "RowwiseParallel(output_layouts=__import__('torch').distributed.tensor.Partial())",
                         ("--global-batch-size", 16), {}),
    # pipeline_parallel.py's LlamaStage runs all but the first of its layers (their weights stay in
    # the stage and its checkpoint, untrained: the key set still matches).
    "stage_skips_a_layer": (("pipeline_parallel.py", "nproc_per_node=4"), None,
                            "for layer in self.model.layers.values():",
                            "for layer in list(self.model.layers.values())[1:]:",
                            ("--n-layer", 8, "--global-batch-size", 16, "--schedule", "1f1b", "--microbatches", 4),
                            {"n_layer": 8}),
}


def test_llama_bugs_fail_the_equivalence_tests(tmp_path):
    """A TP plan that leaves o_proj's partial sums unreduced, and a pipeline stage that drops a layer,
    both on the tiny Llama (tests/workers/ch05_mutant.py runs the mutated script): the saved weights
    must miss the single-process reference by far more than TOLERANCE, with the key set intact (so
    it is the tolerance, not a missing weight, that fails them)."""
    for name, (needles, without, old, new, flags, overrides) in LLAMA_MUTANTS.items():
        nproc, script, args = readme_command(*needles, without=without)
        save = tmp_path / f"{name}.pt"
        torchrun(WORKERS / "ch05_mutant.py", REPO / script, old, new, "--", *args, *QUICK, "--arch", "llama",
                 *flags, "--results", tmp_path / "r.jsonl", "--save", save,
                 nproc=nproc, tmp_path=tmp_path, timeout=400)
        expected, _ = reference(16, arch="llama", **overrides)
        state = torch.load(save, weights_only=True)["model"]
        assert set(state) == set(expected), name
        diff = max((state[n] - expected[n]).abs().max().item() for n in expected)
        print(f"{name}: max |distributed - single| = {diff:.2e}")
        assert diff > WIDE * TOLERANCE, (name, diff)


# Gradients summed over the data-parallel ranks instead of averaged, made in the scripts themselves
# (each rank's loss times the data-parallel size, so the mean the reduction takes becomes the sum),
# run with exactly the flags the reader's play gives the correct commands (ch05_common.PLAY) and
# judged by test_ch05_advanced's own check (assert_matches): hybrid_parallelism.py's 2-D and HSDP
# layouts on the README's 4 ranks, and gradient_accumulation.py's DDP on 4 and on 2, beside the
# unmutated script on 2 (the played run is the 4-rank twin), which must pass. Measured on 2-core CPU,
# gloo (max |distributed - single|): 2-D 6.2e-2, HSDP 1.9e-1, accumulation 1.6e-1 on 4 ranks and
# 6.2e-2 on 2: over 6,000x TOLERANCE.
DP_SUM = ("loss = lm_loss(model(inputs), targets)", "loss = lm_loss(model(inputs), targets) * dp_size")
ACCUMULATION_SUM = ("lm_loss(model(x), y) / k", "lm_loss(model(x), y) / k * ctx.world_size")
SUMMED = {  # name: (lookup, the one replacement or None, ranks (None: the README's), the weights file)
    "2d_summed": ("2d", DP_SUM, None, "2d.pt"),
    "hsdp_summed": ("hsdp", DP_SUM, None, "hsdp.pt"),
    "accumulation_summed_4": ("accumulation", ACCUMULATION_SUM, 4, "no_sync.pt"),
    "accumulation_summed_2": ("accumulation", ACCUMULATION_SUM, 2, "no_sync.pt"),
    "accumulation_2": ("accumulation", None, 2, "no_sync.pt"),
}


def launch_summed(folder, name: str):
    lookup, mutation, ranks, _ = SUMMED[name]
    nproc, script, args = readme_command(*LOOKUPS[lookup][0], without=LOOKUPS[lookup][1])
    flags = [flag.replace("{out}", str(folder)) for flag in PLAY[LOOKUPS[lookup]].flags]
    mutant = () if mutation is None else (WORKERS / "ch05_mutant.py",)
    return torchrun(*mutant, REPO / script, *(mutation or ()), *(["--"] if mutation else []), *args, *flags,
                    nproc=ranks or nproc, tmp_path=folder, timeout=400)


def test_gradients_summed_over_the_data_parallel_ranks_fail_the_equivalence_test(tmp_path_factory):
    runs = run_jobs({name: (lambda folder, name=name: launch_summed(folder, name)) for name in SUMMED},
                    tmp_path_factory)
    for name, (lookup, mutation, ranks, weights) in SUMMED.items():
        folder, _ = job(runs, name)
        global_batch = 2 * 4 * ranks if lookup == "accumulation" else 16  # micro 2 x k 4 x ranks, as played
        expected, _ = reference(global_batch)
        if mutation is None:
            assert_matches(folder / weights, expected)
            continue
        state = torch.load(folder / weights, weights_only=True)["model"]
        diff = max((state[n] - expected[n]).abs().max().item() for n in expected)
        print(f"{name}: max |distributed - single| = {diff:.2e}")
        assert diff > WIDE * TOLERANCE, (name, diff)
        with pytest.raises(AssertionError, match=r"max \|distributed - single\| = "):
            assert_matches(folder / weights, expected)
