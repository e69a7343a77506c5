"""Chapter 05, activation_checkpointing.py: activation checkpointing (AC) and torch.compile change
memory and time, never the math; and MemTracker's activation bytes per block are the formula's.

Two launches of the README command, 2 ranks each, tiny GPT, 3 plain-SGD steps at lr 0.5 in fp32
(ch05_common.QUICK, with --warmup-steps 2: step 2 is the harness's memory-tracked step), dropout 0:

* DDP, ``--ac none full selective``, eager;
* FSDP2, ``--ac full --compile off on``: AC under FSDP2, and compiled with it.

Every configuration must end with the weights of one process training the same initial weights on
the whole batch (ch05_common.reference) within the chapter's TOLERANCE, 1e-5 absolute. Its negative
controls for these settings are test_ch05_negative.py's (the smallest real bug there, a dropped
shard, misses by 3.6e-2). Observed on 2-core CPU, gloo: 1.2e-7 for every eager run, 6.0e-8 compiled
(compiled blocks fuse and reorder fp32 arithmetic; far inside the tolerance either way).

AC must also replay the forward exactly, dropout included: AC_TOLERANCE = 1e-6 between AC modes.
AC reruns the same kernels on the same inputs, so on CPU they are bit-identical (observed 0.0); a
GPU may pick other kernels for the recomputation, hence not 0. The bug it must catch: a
recomputation that draws different dropout masks (``preserve_rng_state=False``). The dropout tests
train in this process with the script's own wrapper, dropout 0.1: the original stays within
AC_TOLERANCE (0.0 observed), a copy of the script with the RNG state not restored must miss by more than
100 x AC_TOLERANCE (observed 2.5e-2 on 2-core CPU: 25,000x).

torch.compile on CPU generates C++ and builds it with the system compiler: on this 2-core machine
under load (load average ~20) a 2-rank launch compiling three tiny blocks took 6.5 min with a cold
cache (270 s for the first graph alone in one process; 19 s once inductor's cache,
/tmp/torchinductor_<user>, holds it). So the suite compiles one graph (the AC'd tiny block), and
the first run on a fresh machine pays that once.
"""
from __future__ import annotations

import pytest
import torch

from ch05_common import AC_FLAGS, CHAPTER, LOOKUPS, LR, STEPS, TOLERANCE, launch, reference
from distkit.harness import read_records
from distkit.models import TinyGPT, TokenTask, build_model, gpt_config, lm_loss, model_config
from launch import assert_one_line_error, load_script, parse_args_result
from spine import flag_path, play_chapter
from workers.mutation import mutated_source
from workers.reference import train_one_process

SCRIPT = CHAPTER / "activation_checkpointing.py"
LOOKUP = LOOKUPS["activation_checkpointing"]  # the README command every launch here starts from
AC_TOLERANCE, WIDE = 1e-6, 100
BATCH = 8  # global batch: 4 sequences per rank, as activation_bytes_per_layer's micro-batch
FLAGS = AC_FLAGS
assert FLAGS[FLAGS.index("--global-batch-size") + 1] == BATCH


def run(tmp_path, *flags):
    results = tmp_path / "r.jsonl"
    out = launch(tmp_path, *LOOKUP[0], extra=(*FLAGS, *flags, "--results", results,
                                            "--save", tmp_path / "{ac}_{compile}.pt"), nproc=2, timeout=900)
    return out.stdout, read_records(results), tmp_path


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    return run(tmp_path_factory.mktemp("ddp"), "--strategy", "ddp", "--ac", "none", "full", "selective",
               "--compile", "off")


@pytest.fixture(scope="module")
def fsdp_run(reader):
    """The README's command as the reader's play ran it (tests/spine.py, ch05_common.PLAY): FSDP2 on 2
    ranks, full AC, eager and compiled; its records where the README's command writes them."""
    played = play_chapter("05-advanced", reader).ok(LOOKUP)
    return played["stdout"], read_records(flag_path(played, "--results")), played["out"]


def weights(folder, ac, compiled="off"):
    return torch.load(folder / f"{ac}_{compiled}.pt", weights_only=True)["model"]


def max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b), set(a) ^ set(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("which", ["ddp", "fsdp"])
def test_every_configuration_matches_single_process_training(which, request):
    """DDP under each AC mode, FSDP2 with full AC eager and compiled: the single-process weights and
    losses; the AC modes also equal each other within AC_TOLERANCE."""
    out, records, folder = request.getfixturevalue(f"{which}_run")
    expected, losses = reference(BATCH)
    torch.manual_seed(0)  # the script's --seed: its initial weights
    assert max_diff(expected, TinyGPT(gpt_config("tiny")).state_dict()) > WIDE * TOLERANCE  # training moved them
    configs = [(r["config"]["ac"], "on" if r["config"]["compile"] else "off") for r in records]
    assert configs == ([("none", "off"), ("full", "off"), ("selective", "off")] if which == "ddp"
                       else [("full", "off"), ("full", "on")])
    for (ac, compiled), record in zip(configs, records):
        diff = max_diff(weights(folder, ac, compiled), expected)
        print(f"{which} ac {ac} compile {compiled}: max |distributed - single| = {diff:.1e}")  # with -s
        assert diff < TOLERANCE, (ac, compiled)
        assert record["losses"] == pytest.approx(losses, abs=1e-5), (ac, compiled)
    if which == "ddp":
        for ac in ("full", "selective"):
            diff = max_diff(weights(folder, ac), weights(folder, "none"))
            print(f"ddp ac {ac}: max |{ac} - none| = {diff:.1e}")
            assert diff <= AC_TOLERANCE, ac


def test_rng_state_not_preserved_fails_the_tolerance(tmp_path):
    """The negative control: the script's own AC wrapper, with the RNG state not restored before the
    recomputation, trained in one process with dropout 0.1 like the DDP run: the recomputed dropout
    masks differ from forward's, and the weights miss no-AC's by far more than AC_TOLERANCE. The
    unmutated script, trained the same way, stays within it."""
    mutant = tmp_path / "mutant_ac.py"
    mutant.write_text(mutated_source(SCRIPT, "preserve_rng_state=True", "preserve_rng_state=False"))
    cfg = gpt_config("tiny", dropout=0.1)

    def train(module, ac):
        torch.manual_seed(0)
        model = TinyGPT(cfg)
        module.apply_ac_and_compile(model, ac, compiled=False)
        return train_one_process(model, torch.optim.SGD(model.parameters(), lr=LR), STEPS, BATCH)[1]

    script, broken = load_script(SCRIPT), load_script(mutant, "mutant_ac")
    none = train(script, "none")
    assert max_diff(train(script, "full"), none) <= AC_TOLERANCE
    diff = max_diff(train(broken, "full"), none)
    print(f"RNG state not restored: max |full - none| = {diff:.2e}")  # shown with -s
    assert diff > WIDE * AC_TOLERANCE, diff


def test_activation_memory_per_block_is_the_formula(ddp_run, fsdp_run):
    """MemTracker's activation bytes each block adds in forward (eager) against the formula, worked
    out here for the tiny GPT (s 32, b 4 per rank, h 64, a 4 heads; fp32): no AC 64sbh + 4asb + 16sb
    (Korthikanti's 34sbh in fp32 without dropout masks, attention's log-sum-exp for its s x s
    scores, LayerNorm's statistics), full AC 4sbh (the block input), selective 44sbh + 4asb.

    Margin 2%: MemTracker counts every storage and the formula every tensor the kernels save
    (measured equal to the byte on CPU); 2% leaves room for a few extra bytes a GPU kernel may keep
    (an attention kernel's RNG seed and offset), never for one sbh-sized tensor too many or too few
    (1/17 of no AC's bytes, 1/11 of selective's). So full AC saves what the formula says:
    none - full = 60sbh + 4asb + 16sb, within 2%. Compiled runs are not tracked: the record says
    ``cpu_peak_rss`` (MemTracker's dispatch mode would make Dynamo run them eagerly for good)."""
    out, records, _ = ddp_run
    s, b, h, a = 32, BATCH // 2, 64, 4
    expected = {"none": 64 * s * b * h + 4 * a * s * b + 16 * s * b, "full": 4 * s * b * h,
                "selective": 44 * s * b * h + 4 * a * s * b}
    measured = {r["config"]["ac"]: r["activation_bytes_per_layer"] for r in records}
    for ac, record in zip(measured, records):
        assert record["activation_bytes_per_layer_formula"] == expected[ac], ac  # the script's formula
        assert measured[ac] == pytest.approx(expected[ac], rel=0.02), ac
    saved = measured["none"] - measured["full"]
    assert saved == pytest.approx(expected["none"] - expected["full"], rel=0.02)
    peaks = {r["config"]["ac"]: r["metrics"]["peak_memory_by_category_per_rank"][0] for r in records}
    assert {r["metrics"]["peak_memory_kind"] for r in records} == {"cpu_mem_tracker"}
    assert peaks["full"]["activations"] < peaks["selective"]["activations"] < peaks["none"]["activations"]
    for peak, record in zip(peaks.values(), records):  # DDP: every rank holds every fp32 parameter
        assert peak["params"] == 4 * record["param_count"] and peak["optimizer"] == 0  # SGD: no state
    assert "activations per block" in out and "formula" in out
    _, fsdp, _ = fsdp_run
    assert fsdp[0]["activation_bytes_per_layer"] == pytest.approx(expected["full"], rel=0.02)
    compiled = fsdp[1]["metrics"]
    assert fsdp[1]["activation_bytes_per_layer"] is None and compiled["peak_memory_by_category_per_rank"][0] is None
    assert compiled["peak_memory_kind"] == "cpu_peak_rss"


def test_bad_flags_are_one_line():
    script = load_script(SCRIPT)
    for args, expected in [(["--ac", "some"], "argument --ac: invalid choice: 'some'"),
                           (["--warmup-steps", "0"], "--warmup-steps must be >= 1 and --steps >= --warmup-steps + 1"),
                           (["--dropout", "1.5"], "argument --dropout: must be < 1, got 1.5"),
                           (["--ac", "none", "full", "--save", "x.pt"],
                            "--save x.pt names one file for 2 configurations")]:
        result = parse_args_result(script, *args)
        assert result.returncode == 2, result.stdout
        assert_one_line_error(result, expected)


def test_llama_activation_memory_per_block_is_the_formula():
    """The Llama's formula (activation_bytes_per_layer's docstring), worked out here for the tiny Llama
    (s 32, b 4, h 64, a 8 query heads, g 4 key/value heads, MLP width I 128; fp32), per token:
    none 8h + 2h·g/a + 4I + a + 2 floats, full h, selective 5h + 2h·g/a + 2I + a; against the
    script's own MemTracker measurement of one step in this process (no process group needed),
    within the same 2%."""
    script = load_script(SCRIPT)
    cfg = model_config("llama", "tiny")
    s, b, h, a, kv, mlp = 32, 4, 64, 8, 2 * 64 * 4 // 8, 128
    expected = {"none": 4 * s * b * (8 * h + kv + 4 * mlp + a + 2), "full": 4 * s * b * h,
                "selective": 4 * s * b * (5 * h + kv + 2 * mlp + a)}
    inputs, targets = TokenTask(cfg, seed=0).global_batch(0, b)
    for ac, want in expected.items():
        torch.manual_seed(0)
        model = build_model(cfg)
        script.apply_ac_and_compile(model, ac, compiled=False)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        _, added = script.track_memory(model, optimizer, list(model.blocks),
                                       lambda: lm_loss(model(inputs), targets).backward())
        assert len(added) == cfg.n_layer
        assert sum(added) / len(added) == pytest.approx(want, rel=0.02), ac
        assert script.activation_bytes_per_layer(cfg, b, ac) == want, ac
