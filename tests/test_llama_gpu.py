"""The Llama (``--arch llama``) lessons on GPUs with NCCL (``pytest -m gpu``; deselected, and every test
skips saying why, on a machine without GPUs). Written to the CPU suite's standard; NOT YET RUN ON A
GPU, so no figure here is a measured one.

One GPU cannot host several NCCL ranks, so each command runs at world size 1 on one GPU; the README's
own 4-rank launches run where ``require_gpus(4)`` finds four GPUs (one per rank), read as they would
run there: the mesh, the shards and the batch slices are those of 4 ranks.

* ``02-fsdp/fsdp_hf_checkpoint.py``: a Hugging Face folder (written here with ``save_pretrained``)
  through FSDP2 on the GPU(s): ``--steps 0`` exports it back bit for bit (no arithmetic touches the
  weights: broadcast, shard, gather and save are copies), and ``from_pretrained`` loads the export;
  4 training steps equal one CPU process (FP32_ATOL) and the export's logits are the trained model's.
* ``02-fsdp/fsdp_lora.py``: the test worker (the script's own functions) on NCCL: every adapter
  element gets a gradient on every rank at the second step, the frozen base stays the seed's bit for
  bit and gets no gradient; the README command's record splits base and adapter bytes as the CPU
  suite's formula says, on CUDA.
* ``05-advanced/activation_checkpointing.py --ac none full selective --compile off on`` (the README
  command): six records of NCCL on CUDA with ``cuda_max_allocated`` peaks; full AC's peak is below
  no AC's, eager and compiled, with activations made large enough (sequence 128, batch 32) to stand
  out of the model state and library workspaces; AC and compile do not change the losses.
* ``--arch llama`` through ``ddp_training.py`` (ch01), every ``fsdp_transformer.py`` strategy (ch02)
  and ``tensor_parallel.py`` (ch05): records of device cuda, finite losses, and the trained weights
  equal to the CPU single-process reference within GPU tolerances: the CPU suites' own for the AdamW
  runs (ch01 5e-5, ch02 FP32_ATOL 2e-4: GPU kernels add in another order than the CPU, which those
  bounds already allow for between ranks; TF32 is off for fp32 matmuls by default) and ch05's GPU
  tolerance (1e-4) for the SGD tensor-parallel run.
* The real shape: ``llama-3.2-1b`` builds on the meta device with the published 1,235,814,400
  parameters (tied embeddings counted once), and built on one GPU it runs a forward and backward.
"""
from __future__ import annotations

import math
import re

import pytest
import torch

import ch01_common as ch01
import ch02_common as ch02
import ch05_common as ch05
from distkit.harness import read_records
from distkit.models import build_model, import_transformers, model_config
from launch import WORKERS, command_argv, job_env, require_gpus, run, torchrun
from test_ch02_hf import FLAGS as HF_FLAGS
from test_ch02_hf import read_folder, write_hf_folder

pytestmark = pytest.mark.gpu

LLAMA = ("--arch", "llama")
NCCL = ("--backend", "nccl")
TP_TOLERANCE = 1e-4  # ch05's GPU tolerance (tests/test_ch05_gpu.py), SGD lr 0.5, 3 steps
LORA_TOLERANCE = 1e-4  # 10x the CPU suite's ADAPTER_ATOL: AdamW on GPU kernels vs the CPU reference
AC_FLAGS = ("--arch", "llama", "--model-size", "tiny", "--seq-len", "128", "--global-batch-size", "32",
            "--steps", "4")
RANKS = [pytest.param(1, id="1gpu"), pytest.param(4, id="4gpus")]


def on_gpus(command: str, tmp_path, *extra, nproc: int, timeout: float = 600):
    """A README command with ``nproc`` ranks on NCCL, ``extra`` flags after it (argparse keeps the
    last value of a repeated flag)."""
    require_gpus(nproc, "one GPU per NCCL rank")
    argv = [*command_argv(command, nproc), *NCCL, *map(str, extra)]
    return run(argv, timeout=timeout, env=job_env(tmp_path, gpu=True))


def assert_cuda_record(record: dict, world: int) -> None:
    """A record of an NCCL job on CUDA: the GPU allocator's peak, at least the state the rank holds."""
    assert (record["backend"], record["device"], record["world_size"]) == ("nccl", "cuda", world)
    metrics = record["metrics"]
    assert metrics["peak_memory_kind"] == "cuda_max_allocated"
    for peak, state in zip(metrics["peak_memory_bytes_per_rank"], metrics["model_state_bytes_per_rank"],
                           strict=True):
        assert sum(state.values()) <= peak < 2**32, (record["strategy"], peak, state)


def finite(values) -> bool:
    return all(math.isfinite(v) for v in values)


# ------------------------------------------------------------------ HF checkpoint round trip

@pytest.mark.parametrize("nproc", RANKS)
def test_hf_checkpoint_round_trip_on_gpus(nproc, tmp_path):
    """``--steps 0``: the export is the input bit for bit, and ``from_pretrained`` loads it (same
    tensors); 4 steps: the export equals single-process CPU training (FP32_ATOL) and its logits under
    ``from_pretrained`` (on the CPU) equal the FSDP model's on the GPU (1e-4: CPU vs GPU kernels)."""
    from test_ch02_hf import reference

    require_gpus(nproc, "one GPU per NCCL rank")
    write_hf_folder(tmp_path / "hf_in")
    command = ch02.command(ch02.HF_CHECKPOINT)
    for steps in (0, 4):
        out = tmp_path / f"steps{steps}"
        on_gpus(command, tmp_path, *HF_FLAGS, "--steps", steps, "--hf-in", tmp_path / "hf_in",
                "--hf-out", out / "hf", "--checkpoint-dir", out / "ckpt", "--results", out / "records.jsonl",
                "--dump-logits", out / "logits.pt", nproc=nproc)
    given, exported = read_folder(tmp_path / "hf_in"), read_folder(tmp_path / "steps0" / "hf")
    assert set(given) == set(exported) and all(torch.equal(given[k], exported[k]) for k in given)
    transformers = import_transformers()
    loaded = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "steps0" / "hf")).state_dict()
    assert all(torch.equal(loaded[k], given[k]) for k in given)

    trained = read_folder(tmp_path / "steps4" / "hf")
    assert ch02.max_diff(trained, reference(tmp_path / "hf_in", 4)) <= ch02.FP32_ATOL
    (record,) = read_records(tmp_path / "steps4" / "records.jsonl")
    assert_cuda_record(record, nproc)
    dumped = torch.load(tmp_path / "steps4" / "logits.pt", weights_only=True)
    model = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "steps4" / "hf")).eval()
    with torch.no_grad():
        logits = model(input_ids=dumped["inputs"]).logits
    assert (logits - dumped["logits"].cpu()).abs().max().item() <= 1e-4


# ------------------------------------------------------------------ LoRA

@pytest.mark.parametrize("nproc", RANKS)
def test_lora_adapters_get_gradients_and_the_base_stays_frozen_on_gpus(nproc, tmp_path):
    """The CPU suite's checks (tests/test_ch02_lora.py) on NCCL: the worker trains with the script's
    own functions, and the README command's record measures the base/adapter split on CUDA."""
    from test_ch02_lora import BATCH, CFG, LR, STEPS, TARGETS, R, is_adapter, lora_model
    from workers.reference import train_one_process

    require_gpus(nproc, "one GPU per NCCL rank")
    torchrun(WORKERS / "ch02_lora.py", "--out", tmp_path / "worker.pt", "--steps", STEPS, *NCCL, nproc=nproc,
             env=job_env(tmp_path, gpu=True), timeout=600)
    correct = torch.load(tmp_path / "worker.pt", weights_only=True)["correct"]
    assert len(correct["grads"]) == nproc
    for rank, (_, second) in enumerate(correct["grads"]):
        assert len(second) == 2 * CFG.n_layer * len(TARGETS)
        for name, (nonzero, numel) in second.items():
            assert numel > 0 and nonzero == numel, (rank, name, nonzero, numel)
        assert correct["base_grads"][rank] == [], rank
    model = lora_model()
    initial, final = train_one_process(
        model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR), STEPS, BATCH)
    state = correct["state"]
    for name in initial:
        if is_adapter(name):
            assert (state[name] - final[name]).abs().max().item() <= LORA_TOLERANCE, name
        else:  # built on the CPU from the seed, moved to the GPU, never updated: bit for bit
            assert torch.equal(state[name], initial[name]), name

    results = tmp_path / "records.jsonl"
    result = on_gpus(ch02.command(ch02.LORA), tmp_path, "--steps", STEPS, "--global-batch-size", BATCH,
                     "--log-every", 1, "--results", results, "--save", tmp_path / "adapters.pt", nproc=nproc)
    (record,) = read_records(results)
    assert_cuda_record(record, nproc)
    adapter = record["config"]["trainable_params"]
    assert adapter == sum(t.numel() for k, t in initial.items() if is_adapter(k))
    base = record["param_count"] - adapter
    for split in record["lora_state_bytes_per_rank"]:  # tiny dims divide by 1 and 4: no padding
        assert split == {"base_params": 4 * base // nproc, "base_grads": 0, "base_optimizer": 0,
                         "adapter_params": 4 * adapter // nproc, "adapter_grads": 4 * adapter // nproc,
                         "adapter_optimizer": 8 * adapter // nproc}
    assert R == record["config"]["lora_r"] and finite(loss for _, loss in record["losses"])
    line = next(l for l in result.stdout.splitlines() if "max |logits difference|" in l)
    assert float(line.rsplit(" ", 1)[1]) <= 1e-4, line  # a fresh model on the same GPU vs the sharded one


# ------------------------------------------------------------------ activation checkpointing + compile

@pytest.mark.parametrize("nproc", RANKS)
@pytest.mark.compiles
def test_activation_checkpointing_and_compile_on_gpus(nproc, tmp_path):
    """Six configurations (none/full/selective x eager/compiled) of the Llama under DDP on NCCL: peaks
    are the CUDA allocator's; full AC keeps less than no AC (eager and compiled); selective keeps no
    more than none; recomputation and compilation leave the losses as they were (eager: 1e-5, the
    same kernels; compiled: 1e-3 relative, fused kernels round differently)."""
    results = tmp_path / "records.jsonl"
    on_gpus(ch05.find_command(ch05.README, *ch05.LOOKUPS["activation_checkpointing"][0]), tmp_path,
            *AC_FLAGS, "--results", results, nproc=nproc, timeout=900)  # three compilations
    records = {(r["config"]["ac"], r["config"]["compile"]): r for r in read_records(results)}
    assert set(records) == {(ac, c) for ac in ("none", "full", "selective") for c in (False, True)}
    for record in records.values():
        assert_cuda_record(record, nproc)
        assert record["model"]["arch"] == "llama" and finite(record["losses"])
    peak = {key: r["metrics"]["peak_memory_bytes_per_rank"][0] for key, r in records.items()}
    for compiled in (False, True):
        assert peak[("full", compiled)] < peak[("none", compiled)], peak
        assert peak[("selective", compiled)] <= peak[("none", compiled)], peak
    reference = records[("none", False)]["losses"]
    for (ac, compiled), record in records.items():
        tolerance = dict(rel=1e-3) if compiled else dict(abs=1e-5)
        assert record["losses"] == pytest.approx(reference, **tolerance), (ac, compiled)


# ------------------------------------------------------------------ the strategies, on the Llama

@pytest.mark.parametrize("nproc", RANKS)
def test_ddp_training_trains_the_llama_on_gpus(nproc, tmp_path):
    """ch01's README command (2 micro-batches, AdamW, clipping, schedule) with --arch llama: the
    weights equal one CPU process within ch01.TOLERANCE (5e-5)."""
    require_gpus(nproc, "one GPU per NCCL rank")
    argv = [f"--nproc_per_node={nproc}" if a.startswith("--nproc_per_node=") else a
            for a in ch01.readme_argv("--config")]
    run([*argv, *ch01.training_flags(tmp_path), *LLAMA, *NCCL], env=job_env(tmp_path, gpu=True), timeout=600)
    record = read_records(tmp_path / "results.jsonl")[-1]
    assert_cuda_record(record, nproc)
    assert record["model"]["arch"] == "llama" and finite(record["loss_history"])
    trained = {k: v.cpu() for k, v in ch01.final_params(tmp_path).items()}
    assert ch01.max_diff(trained, ch01.single_process_params("llama")) < ch01.TOLERANCE


@pytest.mark.parametrize("nproc", RANKS)
def test_every_fsdp_strategy_trains_the_llama_on_gpus(nproc, tmp_path):
    """ch02's README sweep (FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD, DDP; HSDP 1 x 1 on one
    GPU, 2 x 2 on four) with --arch llama: every strategy within FP32_ATOL of one CPU process."""
    shard = ("--hsdp-shard-size", 1) if nproc == 1 else ()
    result = on_gpus(ch02.command(ch02.SWEEP), tmp_path, *ch02.TINY, *LLAMA, *shard, "--steps", ch02.STEPS,
                     "--log-every", 1, "--results", tmp_path / "records.jsonl",
                     "--save", tmp_path / "params" / "{strategy}.pt", nproc=nproc)
    _, reference = ch02.reference_state(ch02.STEPS, arch="llama")
    for strategy in ch02.STRATEGIES:
        trained = torch.load(tmp_path / "params" / f"{strategy}.pt", weights_only=True)
        assert all(t.device.type == "cpu" for t in trained.values())  # gathered with cpu_offload
        assert ch02.max_diff(trained, reference) <= ch02.FP32_ATOL, strategy
    losses = [float(x) for x in re.findall(r"step\s+\d+ \| loss ([\d.]+)", result.stdout)]
    assert len(losses) == len(ch02.STRATEGIES) * ch02.STEPS and finite(losses), result.stdout[-3000:]
    records = read_records(tmp_path / "records.jsonl")
    assert [r["strategy"] for r in records] == [ch02.RECORD[s] for s in ch02.STRATEGIES]
    for record in records:
        assert_cuda_record(record, nproc)
        assert record["model"]["arch"] == "llama" and 0 < record["metrics"]["mfu"] < 1


@pytest.mark.parametrize("nproc", RANKS)
def test_tensor_parallel_trains_the_llama_on_gpus(nproc, tmp_path):
    """ch05's README Llama command (TP + sequence parallel; SGD lr 0.5, 3 steps): weights and the
    loss of every step within TP_TOLERANCE of one CPU process."""
    require_gpus(nproc, "one GPU per NCCL rank")
    _, script, args = ch05.readme_command(*ch05.LOOKUPS["tp_llama_sp"][0])
    results = tmp_path / "records.jsonl"
    torchrun(ch05.REPO / script, *args, *ch05.QUICK, "--global-batch-size", 16, "--results", results,
             "--save", tmp_path / "{strategy}.pt", *NCCL, nproc=nproc, tmp_path=tmp_path,
             env=job_env(tmp_path, gpu=True), timeout=600)
    expected, losses = ch05.reference(16, arch="llama")
    (record,) = read_records(results)
    assert_cuda_record(record, nproc)
    assert record["model"]["arch"] == "llama" and finite(record["losses"])
    assert record["losses"] == pytest.approx(losses, abs=TP_TOLERANCE)
    state = torch.load(tmp_path / f"{record['strategy']}.pt", weights_only=True, map_location="cpu")["model"]
    assert set(state) == set(expected)
    for name, value in expected.items():
        assert (state[name] - value).abs().max().item() < TP_TOLERANCE, name


# ------------------------------------------------------------------ the real shape

@pytest.mark.cuda_in_pytest
def test_llama_3_2_1b_counts_on_meta_and_steps_on_one_gpu():
    """The published Llama-3.2-1B shape: 1,235,814,400 parameters on the meta device (no memory;
    the tied LM head is the embedding, counted once); built on one GPU (fp32, ~5 GB of weights and as
    much again of gradients) it runs a forward and backward on a short sequence: finite loss, and
    every parameter, the shared embedding included, has a finite gradient."""
    cfg = model_config("llama", "llama-3.2-1b")
    with torch.device("meta"):
        model = build_model(cfg)
    assert sum(p.numel() for p in model.parameters()) == 1_235_814_400
    assert model.lm_head.weight is model.model.embed_tokens.weight
    require_gpus(1, "the 1B model's forward and backward on a GPU")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = build_model(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (1, 16), device="cuda")
    logits = model(tokens)
    assert logits.shape == (1, 16, cfg.vocab_size)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    assert math.isfinite(loss.item())
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
