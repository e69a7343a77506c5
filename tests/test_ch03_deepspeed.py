"""Chapter 03 (DeepSpeed ZeRO): every README command runs (with small flags appended), and what it
produces is checked against single-process training.

Tolerance: ZeRO stages 0-3 and ZeRO-3 + CPU offload must end within ``WEIGHT_TOL`` = 5e-5 (absolute,
per weight) of single-process AdamW on the same global batches after a few steps at lr 3e-3. The
distributed runs sum gradients in another order (per-rank means, then all-reduce / reduce-scatter),
so fp32 rounding differs by about 1e-7 relative per step and Adam's normalisation can magnify it
for near-zero gradients; observed differences are 1e-6 to 1e-5, a weight moves up to 3e-3 per step.

What this comparison cannot see: AdamW's update is nearly scale-invariant (m / sqrt(v)), so gradients
N times too large (summed over the ranks instead of averaged, or accumulated micro-batch losses not
divided by the accumulation steps) train almost the same weights and would pass. The same comparison
with plain SGD, where such a bug multiplies every update by N (2 ranks: differences of 6.6e-2 against
1.2e-7 for correct ZeRO 0-3), is in ``test_ch03_negative.py``, which proves that this tolerance fails
for those bugs.

Every job runs with ``TORCH_EXTENSIONS_DIR`` in the test's temp dir, and the tests assert that it
stays empty: no DeepSpeed op was JIT-compiled (a fresh CI machine would spend 30-60 s per op).

The GPU versions of these checks are in ``test_ch03_gpu.py``.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch

from distkit.checkpoint import load_model_state, safe_load
from distkit.harness import read_records
from distkit.models import TinyGPT, TokenTask, gpt_config, lm_loss
from launch import REPO, assert_one_line_error, command_argv, free_port, job_env, readme_commands, run

CHAPTER = REPO / "03-deepspeed"
sys.path.insert(0, str(CHAPTER))  # ds_common, as the chapter scripts import it
import ds_common  # noqa: E402
README = CHAPTER / "README.md"
WEIGHT_TOL = 5e-5
LR = 3e-3
SMALL = ["--model-size", "tiny", "--global-batch-size", "16"]
EVAL_STEP, EVAL_BATCH = 10_000, 32  # as in 03-deepspeed/ds_common.py


def readme_command(*needles: str) -> str:
    """The one README command that contains every needle."""
    found = [c for c in readme_commands(README) if all(n in c for n in needles)]
    assert len(found) == 1, f"expected one README command with {needles}, found {found}"
    return found[0]


def run_readme(command: str, extra: list, tmp_path: Path, timeout: float = 400):
    """Run a README command as the reader would, with ``extra`` flags appended (the last value of a
    repeated flag wins). torchrun gets --standalone and the deepspeed launcher a free port, so tests
    running side by side never share a rendezvous port."""
    env = job_env(tmp_path, TORCH_EXTENSIONS_DIR=str(tmp_path / "torch_extensions"))
    result = run([*command_argv(command), *map(str, extra)], timeout=timeout, env=env)
    built = list((tmp_path / "torch_extensions").glob("*"))
    assert not built, f"DeepSpeed JIT-compiled ops {built}: a fresh CI machine would build them"
    return result


def reference_weights(steps: int, batch: int, lr: float = LR, seed: int = 0) -> dict[str, torch.Tensor]:
    """Single-process AdamW on the same global batches the distributed jobs trained on."""
    cfg = gpt_config("tiny")
    task = TokenTask(cfg, seed=seed)
    torch.manual_seed(seed)
    model = TinyGPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    for step in range(steps):
        inputs, targets = task.global_batch(step, batch)
        optimizer.zero_grad()
        lm_loss(model(inputs), targets).backward()
        optimizer.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def load_script(name: str):
    """A chapter script as a module (its functions, without running main)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"ch03_{Path(name).stem}", CHAPTER / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_every_readme_command_is_run_by_a_test():
    commands = readme_commands(README)
    covered = [("torchrun", "deepspeed_train.py"), ("deepspeed --num_gpus", "deepspeed_train.py"),
               ("deepspeed_inference.py",), ("zero_offload.py",), ("zero_memory.py",)]
    for command in commands:
        assert any(all(n in command for n in needles) for needles in covered), f"untested: {command}"
    for needles in covered:
        readme_command(*needles)


def test_zero_stages_match_single_process_and_the_memory_formulas(tmp_path):
    """One job runs ZeRO 0, 1, 2, 3 and 3 + offload: same weights as one process; bytes per rank
    as derived for fp32 AdamW."""
    out, params, results = tmp_path / "out", tmp_path / "params", tmp_path / "results.jsonl"
    record_file = tmp_path / "zero_memory.jsonl"
    output = run_readme(readme_command("zero_memory.py"),
                        [*SMALL, "--steps", 4, "--lr", LR, "--record", record_file, "--params-dir", params,
                         "--results", results], tmp_path).stdout
    assert "still referenced" not in output  # every engine was freed before the next config ran

    reference = reference_weights(steps=4, batch=16)
    strategies = ["zero0", "zero1", "zero2", "zero3", "zero3_offload"]
    for strategy in strategies:
        diff = max_diff(safe_load(params / f"{strategy}.pt"), reference)
        assert diff < WEIGHT_TOL, f"{strategy}: max |w - w_single| = {diff:.2e}"

    records = read_records(results)
    assert [r["strategy"] for r in records] == strategies
    psi, n = sum(p.numel() for p in reference.values()), 4
    assert psi % n == 0  # no padding of the flat partitions for this model: the bytes are exact
    # fp32: weights 4 B, gradients 4 B; optimizer = AdamW m + v (8 B) plus, at stages 1-3, the fp32
    # master partition DeepSpeed keeps even in fp32 (K = 12 as in the ZeRO paper).
    expected = {
        "zero0": {"params": 4 * psi, "grads": 4 * psi, "optimizer": 8 * psi},
        # Known gap to the paper's stage 1 (full gradients, 4Ψ in fp32): DeepSpeed's stage 1 reduces
        # gradients bucket by bucket during backward and keeps only its partition, like stage 2.
        "zero1": {"params": 4 * psi, "grads": 4 * psi // n, "optimizer": 12 * psi // n},
        "zero2": {"params": 4 * psi, "grads": 4 * psi // n, "optimizer": 12 * psi // n},
        "zero3": {"params": 4 * psi // n, "grads": 4 * psi // n, "optimizer": 12 * psi // n},
        "zero3_offload": {"params": 4 * psi // n, "grads": 4 * psi // n, "optimizer": 12 * psi // n},
    }
    for record in records:
        assert record["param_count"] == psi
        for rank, measured in enumerate(record["metrics"]["model_state_bytes_per_rank"]):
            for key, value in expected[record["strategy"]].items():
                assert abs(measured[key] - value) <= 0.05 * value, (record["strategy"], rank, key, measured)

    # "auto" buckets as the engines parsed them: one rank's share of the model, not DeepSpeed's 5e8
    # (2 GB of fp32 per rank); no overlap and no pinned memory on CPU.
    share = math.ceil(psi / n)
    for record in records:
        settings = record["config"]["engine_settings"]
        if record["strategy"] != "zero0":
            assert settings["reduce_bucket_size"] == share, (record["strategy"], settings)
            assert settings["allgather_bucket_size"] == share, (record["strategy"], settings)
        assert settings["overlap_comm"] is False, (record["strategy"], settings)
        if record["config"]["zero_stage"] == 3:
            assert (settings["stage3_prefetch_bucket_size"], settings["stage3_max_live_parameters"],
                    settings["stage3_max_reuse_distance"]) == (share, share, share), settings
    assert records[-1]["config"]["engine_settings"]["offload_optimizer.pin_memory"] is False

    # The run's record (provenance + table) renders the README section: tables and plot.
    [record] = [json.loads(line) for line in record_file.read_text().splitlines()]
    assert record["name"] == "zero_memory" and record["machine"]["device_name"] and record["torch"]
    assert record["command"].startswith("torchrun --nproc_per_node=4 03-deepspeed/zero_memory.py")
    table = record["table"]
    assert [row["strategy"] for row in table["rows"]] == strategies
    assert all(row["peak_memory_kind"] == "cpu_peak_rss" and row["peak_memory_bytes_max"] > 0
               for row in table["rows"])
    zero_memory = load_script("zero_memory.py")
    out.mkdir()
    section = zero_memory.render_record(record_file, out)
    assert (out / "zero_memory.png").stat().st_size > 10_000
    assert "| zero3_offload |" in section and ", gloo, torch" in section  # caption: where it ran


def test_train_checkpoint_resume_consolidate_and_generate(tmp_path):
    """ZeRO-3 via torchrun: 6 steps with a checkpoint at step 3; then the deepspeed launcher resumes
    from step 3 and must end with the same weights; the consolidated fp32 state dict loads into the
    plain model, matches single-process training and reproduces the engine's eval loss; the
    inference script generates from it."""
    checkpoints, results = tmp_path / "ckpt", tmp_path / "results.jsonl"
    straight, resumed = tmp_path / "straight_fp32.pt", tmp_path / "resumed_fp32.pt"
    common = [*SMALL, "--lr", LR, "--checkpoint-dir", checkpoints, "--results", results]
    run_readme(readme_command("torchrun", "deepspeed_train.py"),
               [*common, "--steps", 6, "--save-every", 3, "--fp32-out", straight], tmp_path)
    assert (checkpoints / "step3").is_dir() and (checkpoints / "latest").read_text().strip() == "step6"

    out = run_readme(readme_command("deepspeed --num_gpus", "deepspeed_train.py"),
                     [*common, "--steps", 6, "--resume", "step3", "--fp32-out", resumed], tmp_path).stdout
    assert "resumed from" in out and "at step 3" in out

    first, second = safe_load(straight), safe_load(resumed)
    assert first["strategy"] == "zero3"
    assert max_diff(first["model"], second["model"]) == 0.0  # resumed = uninterrupted, bit for bit
    diff = max_diff(first["model"], reference_weights(steps=6, batch=16))
    assert diff < WEIGHT_TOL, f"ZeRO-3 training vs single process: {diff:.2e}"

    cfg = gpt_config("tiny")
    model = TinyGPT(cfg)
    load_model_state(model, first["model"], str(straight))
    inputs, targets = TokenTask(cfg).global_batch(EVAL_STEP, EVAL_BATCH)
    with torch.no_grad():
        plain_loss = lm_loss(model(inputs), targets).item()
    assert abs(plain_loss - first["eval_loss"]) < 1e-5, (plain_loss, first["eval_loss"])

    records = read_records(results)
    assert [r["resumed_from"] for r in records] == [0, 3]
    assert all(r["strategy"] == "zero3" and r["config"]["precision"] == "fp32" for r in records)

    out = run_readme(readme_command("deepspeed_inference.py"),
                     ["--checkpoint", straight, "--new-tokens", 8, "--prompts", 2], tmp_path).stdout
    assert f"eval loss {plain_loss:.4f}" in out
    assert "valid transitions in generated tokens:" in out


def test_offload_trains_the_same_model_and_reports_placement(tmp_path):
    results = tmp_path / "results.jsonl"
    out = run_readme(readme_command("zero_offload.py"), [*SMALL, "--steps", 4, "--results", results],
                     tmp_path).stdout
    base, offload = read_records(results)
    assert (base["strategy"], offload["strategy"]) == ("zero3", "zero3_offload")
    assert offload["config"]["offload"] == {"offload_optimizer": "cpu", "offload_param": "cpu"}
    assert abs(base["final_loss"] - offload["final_loss"]) < 1e-5
    assert base["metrics"]["model_state_bytes_per_rank"] == offload["metrics"]["model_state_bytes_per_rank"]
    assert out.count("-> host (offloaded)") == 4 and out.count("-> accelerator") == 4
    psi = base["param_count"]
    assert f"model state kept off the accelerator: {20 * psi // 4:,} B per rank" in out
    # The first engine (a reference cycle) was collected before the second config ran.
    assert "still referenced" not in out
    assert offload["config"]["engine_settings"]["offload_param.pin_memory"] is False


def test_bad_configs_fail_with_one_line_naming_the_file(tmp_path):
    script = CHAPTER / "deepspeed_train.py"
    broken = tmp_path / "broken.json"
    broken.write_text('{"train_batch_size": 32,\n "zero_optimization": {"stage": 2,}}\n')
    stage7 = tmp_path / "stage7.json"
    stage7.write_text(json.dumps({"zero_optimization": {"stage": 7}}))
    for path, message in ((broken, "is not valid JSON"), (stage7, "unknown ZeRO stage 7")):
        result = run([sys.executable, str(script), "--deepspeed_config", str(path)],
                     env=job_env(tmp_path), check=False, timeout=120)
        assert_one_line_error(result, message)
        assert str(path) in [line for line in result.stdout.splitlines() if line.startswith("error:")][0]


def test_numeric_flags_are_checked_where_they_are_defined(tmp_path):
    """A zero, negative or non-finite number is argparse's one line, before any process group or
    DeepSpeed import (DeepSpeed's own AssertionError for a batch of 0 is never reached)."""
    cases = [
        ("deepspeed_train.py", ["--global-batch-size", "0"], "argument --global-batch-size: must be a positive integer, got 0"),
        ("deepspeed_train.py", ["--global-batch-size", "-8"], "argument --global-batch-size: must be a positive integer, got -8"),
        ("deepspeed_train.py", ["--steps", "0"], "argument --steps: must be a positive integer"),
        ("deepspeed_train.py", ["--lr", "nan"], "argument --lr: must be a positive number"),
        ("deepspeed_train.py", ["--weight-decay", "-0.1"], "argument --weight-decay: must be a number >= 0"),
        ("deepspeed_train.py", ["--save-every", "-1"], "argument --save-every: must be an integer >= 0"),
        ("zero_offload.py", ["--warmup-steps", "-1"], "argument --warmup-steps: must be an integer >= 0"),
        ("zero_memory.py", ["--global-batch-size", "0"], "argument --global-batch-size: must be a positive integer"),
        ("deepspeed_inference.py", ["--new-tokens", "0"], "argument --new-tokens: must be a positive integer"),
        ("deepspeed_inference.py", ["--prompts", "-1"], "argument --prompts: must be a positive integer"),
    ]
    for script, flags, message in cases:
        result = run([sys.executable, str(CHAPTER / script), *flags], env=job_env(tmp_path), check=False,
                     timeout=120)
        assert result.returncode == 2, (script, flags, result.stdout[-2000:])
        assert_one_line_error(result, message)


def test_config_values_are_checked_with_one_line(tmp_path):
    """Sizes and switches in a config file: "auto" or a value of the right kind, else one line."""
    cases = [({"train_batch_size": 0}, "train_batch_size: must be a positive integer, got 0"),
             ({"zero_optimization": {"stage": 2, "reduce_bucket_size": -5}},
              "zero_optimization.reduce_bucket_size: must be a positive number"),
             ({"zero_optimization": {"stage": 2, "overlap_comm": "yes"}},
              "zero_optimization.overlap_comm must be true, false or \"auto\"")]
    for number, (config, message) in enumerate(cases):
        path = tmp_path / f"bad{number}.json"
        path.write_text(json.dumps(config))
        result = run([sys.executable, str(CHAPTER / "deepspeed_train.py"), "--deepspeed_config", str(path)],
                     env=job_env(tmp_path), check=False, timeout=120)
        assert_one_line_error(result, message)


def test_auto_values_follow_the_model_and_the_device():
    """resolve_auto is pure: buckets ceil(Ψ/N) capped at DeepSpeed's 5e8, missing sizes count as
    auto at stages 1-3, explicit numbers kept; overlap and pinning on for CUDA only."""
    def config(**zero):
        return {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": "auto"},
                                      "overlap_comm": "auto", **zero}}

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    on_gpu = config(reduce_bucket_size="auto", allgather_bucket_size=1000)
    chosen = ds_common.resolve_auto(on_gpu, cuda, param_count=1001, world_size=4)
    zero = on_gpu["zero_optimization"]
    assert zero["reduce_bucket_size"] == 251 and zero["allgather_bucket_size"] == 1000
    assert zero["stage3_prefetch_bucket_size"] == zero["stage3_max_reuse_distance"] == 251  # missing = auto
    assert zero["overlap_comm"] is True and zero["offload_optimizer"]["pin_memory"] is True
    assert chosen["overlap_comm"] is True and "allgather_bucket_size" not in chosen

    on_cpu = config()
    ds_common.resolve_auto(on_cpu, cpu, param_count=7_000_000_000, world_size=8)
    zero = on_cpu["zero_optimization"]
    assert zero["reduce_bucket_size"] == ds_common.DEEPSPEED_DEFAULT_BUCKET  # 875M/rank: capped at 5e8
    assert zero["overlap_comm"] is False and zero["offload_optimizer"]["pin_memory"] is False

    stage1 = {"zero_optimization": {"stage": 1}}
    ds_common.resolve_auto(stage1, cuda, param_count=100, world_size=2)
    assert stage1["zero_optimization"] == {"stage": 1, "reduce_bucket_size": 50, "allgather_bucket_size": 50}
    stage0 = {"zero_optimization": {"stage": 0}}
    assert ds_common.resolve_auto(stage0, cuda, param_count=100, world_size=2) == {}

    for shipped in sorted((CHAPTER / "configs").glob("*.json")):  # no 5e8 left in a shipped config
        zero = json.loads(shipped.read_text()).get("zero_optimization", {})
        assert all(zero.get(key, "auto") == "auto" for key in ds_common.BUCKET_KEYS), shipped


def test_model_state_is_counted_on_untimed_steps_only(monkeypatch):
    """The optimizer hook walks every parameter and state tensor only on warm-up and
    communication-counting steps, never inside a timed step."""
    from types import SimpleNamespace

    from distkit.runtime import DistContext

    walks = []
    counting_bytes = ds_common._bytes
    monkeypatch.setattr(ds_common, "_bytes", lambda *a: walks.append(1) or counting_bytes(*a))
    ctx = DistContext(rank=0, local_rank=0, world_size=1, local_world_size=1, backend="gloo",
                      device=torch.device("cpu"), timeout_s=60)
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters())
    harness = ds_common.ZeroHarness(ctx, "test", model=model, warmup_steps=1, comm_steps=1)
    harness.attach(SimpleNamespace(module=model), optimizer)
    walks_after = []
    for _ in range(5):
        with harness.step(samples=4):
            model(torch.randn(4, 8)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        walks_after.append(len(walks))
    assert walks_after[0] > 0 and walks_after[1] > walks_after[0]  # untimed steps counted
    assert walks_after[1] == walks_after[2] == walks_after[3] == walks_after[4]  # timed: untouched
    assert harness.state_bytes() == {"params": 8 * 9 * 4, "grads": 8 * 9 * 4, "optimizer": 2 * 8 * 9 * 4}
    assert harness.local_metrics()["timed_steps"] == 3


def test_kernel_inject_without_a_policy_is_one_line(tmp_path):
    """TinyGPT has no DeepSpeed injection policy: one line saying so, not DeepSpeed's
    ``AssertionError: No default policy found!``; prompts longer than the task's sequences too."""
    cfg = gpt_config("tiny")
    checkpoint = tmp_path / "tiny_fp32.pt"
    torch.save({"model": TinyGPT(cfg).state_dict(), "gpt_config": cfg.to_dict(), "strategy": "zero3",
                "steps": 0, "eval_loss": 4.2, "seed": 0}, checkpoint)
    script = CHAPTER / "deepspeed_inference.py"
    for flags, message in ((["--kernel-inject"], "--kernel-inject: DeepSpeed"),
                           (["--prompt-len", "99"], "--prompt-len 99: the task has")):
        result = run([sys.executable, str(script), "--checkpoint", str(checkpoint), *flags],
                     env=job_env(tmp_path), check=False, timeout=180)
        assert_one_line_error(result, message)
        assert "No default policy found" not in result.stdout


def test_deepspeed_launcher_ranks_without_gpus_are_one_line(tmp_path):
    """The deepspeed launcher tells ranks their node size in LOCAL_SIZE (not LOCAL_WORLD_SIZE):
    asking for CUDA for 2 local ranks on a machine with none is one line naming both counts."""
    argv = [sys.executable, "-m", "deepspeed.launcher.runner", f"--master_port={free_port()}", "--num_gpus=2",
            str(CHAPTER / "deepspeed_train.py"), "--device", "cuda", "--model-size", "tiny"]
    result = run(argv, env=job_env(tmp_path), check=False, timeout=180)
    assert_one_line_error(result, "--device cuda: 2 local ranks need 2 GPUs but this machine has 0")
