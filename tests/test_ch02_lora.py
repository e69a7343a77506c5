"""Chapter 02, fsdp_lora.py: LoRA adapters trained on a frozen base sharded with FSDP2.

Three launches shared by every test (module fixture), the worker's two at a time here:

* the worker tests/workers/ch02_lora.py on 4 ranks: the script's own functions as they are
  (``correct``) and two mutants of them (negative controls), 4 steps each;
* the same worker on 2 ranks, ``correct`` only;
* the README command on 4 ranks at tiny size (4 steps, global batch 8), as the reader's play ran it
  (tests/spine.py): its harness record and its adapter-only checkpoint.

The expected values come from this file, not from the script: the single-process LoRA reference is
built here with peft directly and trained by tests/workers/reference.py, the frozen base is rebuilt
from the seed, and the byte formulas count the model's own Linear layers.

Tolerance ADAPTER_ATOL = 1e-5 on every adapter element after 4 AdamW steps (lr 1e-2): measured
4.4e-7 on 4 ranks and 5.6e-7 on 2 (summation order), while training moves the adapters by 4.0e-2
and the mutants land 5.1e-2 (the base trained too) and 7.4e-2 (every rank on rank 0's share of the
batch) away. Gradients summed instead of averaged are not among the negative controls: AdamW divides
each gradient by its own running RMS, so a gradient N times too large moves the weights the same
(chapter 02's SGD negative controls catch that bug, in test_ch02_negative.py).
"""
from __future__ import annotations

import warnings

import pytest
import torch

from ch02_common import CHAPTER, LORA, LORA_BATCH, LORA_STEPS, README, check_ok, command, run_all
from distkit.harness import MEMORY_CATEGORIES, read_records
from distkit.models import build_model, import_transformers, model_config
from launch import WORKERS, assert_one_line_error, launcher_argv, load_script, parse_args_result
from spine import play_chapter
from workers.reference import train_one_process

STEPS, BATCH, LR, R, ALPHA, TARGETS = LORA_STEPS, LORA_BATCH, 1e-2, 8, 16, ("q_proj", "v_proj")
ADAPTER_ATOL = 1e-5
MUTANTS = ["base_trained", "same_batch"]
CFG = model_config("llama", "tiny")


def lora_model():
    """A seed-0 tiny Llama with LoRA adapters, built here with peft (not through the script)."""
    import_transformers()
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return get_peft_model(build_model(CFG), LoraConfig(r=R, lora_alpha=ALPHA, target_modules=list(TARGETS),
                                                           lora_dropout=0.0))


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


@pytest.fixture(scope="module")
def reference():
    """Single-process LoRA training on the same global batches: (initial, final, trained model)."""
    model = lora_model()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    initial, final = train_one_process(model, optimizer, STEPS, BATCH)
    return initial, final, model


@pytest.fixture(scope="module")
def launches(tmp_path_factory, reader):
    """The two worker launches here, and the README's command as the reader's play ran it
    (tests/spine.py; ch02_common.PLAY): (the README run's folder, the workers' results, its output)."""
    tmp = tmp_path_factory.mktemp("ch02_lora")
    worker = [*launcher_argv("fork"), "--standalone"]
    jobs = {
        "ranks4": [*worker, "--nproc_per_node=4", WORKERS / "ch02_lora.py", "--out", tmp / "ranks4.pt",
                   "--steps", STEPS, "--variants", "correct", *MUTANTS],
        "ranks2": [*worker, "--nproc_per_node=2", WORKERS / "ch02_lora.py", "--out", tmp / "ranks2.pt",
                   "--steps", STEPS],
    }
    results = run_all(jobs, tmp, parallel=2, timeout=600)
    for result in results.values():
        check_ok(result)
    workers = {n: torch.load(tmp / f"ranks{n}.pt", weights_only=True) for n in (4, 2)}
    readme = play_chapter("02-fsdp", reader).ok(LORA)
    return readme["out"], workers, readme["stdout"]


def test_every_adapter_gets_a_gradient_on_every_rank(launches):
    """Checked at the SECOND step: B starts at zero, so in the first backward dL/dA = B^T (...) = 0
    exactly (and only B gets a gradient); after one update B is non-zero and every element of every
    A and B shard has a gradient, on every rank. The frozen base never gets one."""
    _, workers, _ = launches
    for n, results in workers.items():
        correct = results["correct"]
        assert len(correct["grads"]) == n
        for rank, (first, second) in enumerate(correct["grads"]):
            assert len(second) == 2 * CFG.n_layer * len(TARGETS) and all(map(is_adapter, second))
            for name, (nonzero, numel) in second.items():
                assert numel > 0 and nonzero == numel, (n, rank, name, nonzero, numel)
            for name, (nonzero, numel) in first.items():
                assert nonzero == (numel if ".lora_B." in name else 0), (n, rank, name, nonzero, numel)
            assert correct["base_grads"][rank] == [], (n, rank)


def test_frozen_base_does_not_move(launches, reference):
    """Bit-exact: the base weights after training are the seed's weights (rebuilt here). Negative
    control: the mutant that leaves the base trainable moves it."""
    _, workers, _ = launches
    initial = reference[0]
    base = [k for k in initial if not is_adapter(k)]
    assert len(base) == len(list(build_model(CFG).parameters()))
    for n, results in workers.items():
        state = results["correct"]["state"]
        assert set(state) == set(initial)
        for k in base:
            assert torch.equal(state[k], initial[k]), (n, k)
    moved = workers[4]["base_trained"]["state"]
    assert max((moved[k] - initial[k]).abs().max().item() for k in base) > 1e-3


def test_adapters_match_single_process_lora(launches, reference):
    """Bug caught (ADAPTER_ATOL, module docstring): the base trained along with the adapters, and
    every rank training on the same share of the global batch; both mutants run and fail here."""
    _, workers, _ = launches
    initial, final, _ = reference
    adapters = [k for k in final if is_adapter(k)]
    assert len(adapters) == 2 * CFG.n_layer * len(TARGETS)

    def max_diff(state):
        return max((state[k] - final[k]).abs().max().item() for k in adapters)

    moved = max((final[k] - initial[k]).abs().max().item() for k in adapters)
    assert moved > 1000 * ADAPTER_ATOL  # training really moved the adapters
    for n, results in workers.items():
        assert max_diff(results["correct"]["state"]) <= ADAPTER_ATOL, n
    for mutant in MUTANTS:  # the negative controls
        assert max_diff(workers[4][mutant]["state"]) > 100 * ADAPTER_ATOL, mutant


def test_adapter_checkpoint_is_small_and_reloads(launches, reference):
    """The --save file holds only lora_A/lora_B tensors (a weights_only load), and loaded into a
    fresh base + adapters on one process (peft's set_peft_model_state_dict, here) it gives the
    logits of the single-process-trained model."""
    tmp, _, output = launches
    ckpt = torch.load(tmp / "adapters.pt", weights_only=True)
    keys = set(ckpt["adapters"])
    assert keys and all(".lora_A." in k or ".lora_B." in k for k in keys), keys
    assert len(keys) == 2 * CFG.n_layer * len(TARGETS)
    full_bytes = 4 * sum(p.numel() for p in reference[2].parameters())
    assert (tmp / "adapters.pt").stat().st_size < full_bytes / 4  # 14 KB of weights vs 343 KB

    import_transformers()
    from peft import set_peft_model_state_dict

    fresh = lora_model()
    result = set_peft_model_state_dict(fresh, ckpt["adapters"])
    assert not result.unexpected_keys
    probe = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (fresh(probe) - reference[2](probe)).abs().max().item() <= 1e-4
        assert (lora_model()(probe) - reference[2](probe)).abs().max().item() > 1e-2  # the adapters matter
    # the script's own check: its load_adapters into a fresh model reproduced the sharded model's logits
    line = next(l for l in output.splitlines() if "max |logits difference|" in l)
    assert float(line.rsplit(" ", 1)[1]) <= 1e-5, line


def test_per_rank_bytes_match_the_formula(launches, reference):
    """Every rank's bytes as the script measured them (the record's ``lora_state_bytes_per_rank``):
    the frozen base holds its parameters / N and no gradient or optimizer state; the adapters r (d_in
    + d_out) per adapted matrix / N, the same as gradients, twice that as AdamW moments. Exact (the
    tiny model's dims divide by 4: no padding). The harness's ``model_state_bytes_per_rank`` holds the
    three totals only (what benchmarks/plot.py and distkit.theory sum: a base/adapter split inside it
    was counted twice). The reduce-scatter carries the adapters' gradients only. MemTracker's peak
    holds at least the shards and the AdamW moments, and its categories add up to its total."""
    tmp, _, output = launches
    (record,) = read_records(tmp / "records.jsonl")
    n = record["world_size"]
    model = reference[2]
    total = sum(p.numel() for p in model.parameters())
    linears = [m for name, m in model.named_modules() if name.endswith(TARGETS)]
    assert len(linears) == CFG.n_layer * len(TARGETS)
    adapter = sum(R * (m.in_features + m.out_features) for m in linears)
    base = total - adapter
    assert base == sum(p.numel() for p in build_model(CFG).parameters())
    assert base % n == 0 and adapter % n == 0
    assert record["param_count"] == total and record["config"]["trainable_params"] == adapter
    expected = {"base_params": 4 * base // n, "base_grads": 0, "base_optimizer": 0,
                "adapter_params": 4 * adapter // n, "adapter_grads": 4 * adapter // n,
                "adapter_optimizer": 8 * adapter // n}
    assert record["lora_state_bytes_per_rank"] == [expected] * n
    totals = {"params": 4 * total // n, "grads": 4 * adapter // n, "optimizer": 8 * adapter // n}
    assert record["metrics"]["model_state_bytes_per_rank"] == [totals] * n
    comm = record["metrics"]["comm_per_step"]
    assert comm["reduce_scatter"]["bytes"] == 4 * adapter
    assert record["metrics"]["peak_memory_kind"] == "cpu_mem_tracker"
    for peak in record["metrics"]["peak_memory_by_category_per_rank"]:
        assert sum(peak[k] for k in MEMORY_CATEGORIES) == peak["total"]
        assert peak["params"] >= totals["params"] and peak["optimizer"] >= totals["optimizer"]
    # the printout shows the record's numbers
    assert f"rank-0 adapters: params {4 * adapter // n:,} B, grads {4 * adapter // n:,} B" in output
    rank0_peak = record["metrics"]["peak_memory_by_category_per_rank"][0]["total"]
    assert f"rank-0 peak memory of one step: {rank0_peak:,} B" in output


def test_bad_input_gives_one_error_line():
    script = load_script(CHAPTER / "fsdp_lora.py")
    assert_one_line_error(parse_args_result(script, "--arch", "gpt"), "use --arch llama")
    assert_one_line_error(parse_args_result(script, "--target-modules", "qkv"), "invalid choice")
    assert_one_line_error(parse_args_result(script, "--lora-r", "0"), "must be a positive integer")


def test_readme_command_is_the_one_tested():
    assert command(LORA).startswith("torchrun --nproc_per_node=4 02-fsdp/fsdp_lora.py")
    assert README.read_text().count("<!-- output: records/outputs.jsonl fsdp_lora -->") == 1
