"""Loss-curve parity: every strategy trains the same model, from the same initial weights, on the same
global batches of real text, and must follow one process's loss curve.

Each strategy is its chapter's own script, launched with the same model and training flags (the tiny
Llama, ``--arch llama --model-size tiny``, ``--data text``: Python's reference documentation as bytes, AdamW at
one learning rate, one global batch): only the flags that pick the strategy differ. The runner reads
the loss every script recorded at every step, and computes the held-out loss itself, in this process,
on the text's held-out split, from the weights each run saved every ``--held-out-every`` steps
(``--save-every``) and at the end. One negative control runs beside
them: FSDP with rank 1's shard never updated (its ``optimizer.step()`` skipped), which must leave
the band.

The Llama (Hugging Face's ``LlamaForCausalLM`` from a config: RMSNorm, RoPE, grouped-query attention,
SwiGLU) is the model readers train; every strategy here trains it, context parallelism's ring included.

    python benchmarks/parity.py                  # 1000 steps x 1024 tokens per strategy (~20 min, 2 cores)
    python benchmarks/parity.py --steps 20       # the short version the test suite runs

The tolerance (``TOLERANCE``) and why it is what it is: see ``benchmarks/README.md`` (Loss-curve
parity). ``python benchmarks/parity.py --plot DIR`` draws the committed record's curves.
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from distkit import ArgumentParser, UsageError, run_main
from distkit.checkpoint import safe_load
from distkit.flags import positive_int, saved_at
from distkit.logs import progress
from distkit.models import build_model, lm_loss, model_config
from distkit.paths import check_outputs
from distkit.provenance import provenance
from distkit.text import TextTask, corpus_info

REPO = Path(__file__).resolve().parents[1]
FSDP, DS, CH05 = "02-fsdp/fsdp_transformer.py", "03-deepspeed/deepspeed_train.py", "05-advanced"
# name -> (script, the flags that pick the strategy, ranks). {scratch}: the run's temporary folder.
STRATEGIES: dict[str, tuple[str, list[str], int]] = {
    "one_process": (FSDP, ["--sharding", "ddp"], 1),
    "ddp": (FSDP, ["--sharding", "ddp"], 2),
    "fsdp_full_shard": (FSDP, ["--sharding", "full_shard"], 2),
    "fsdp_shard_grad_op": (FSDP, ["--sharding", "shard_grad_op"], 2),
    "fsdp_hybrid_shard": (FSDP, ["--sharding", "hybrid_shard", "--hsdp-shard-size", "2"], 4),
    **{zero: (DS, ["--deepspeed_config", f"03-deepspeed/configs/{zero}_config.json",
                   "--checkpoint-dir", "{scratch}/ds"], 2) for zero in ("zero1", "zero2", "zero3")},
    "tp_sp": (f"{CH05}/tensor_parallel.py", ["--sequence-parallel"], 2),
    "pp_1f1b": (f"{CH05}/pipeline_parallel.py", ["--schedule", "1f1b", "--microbatches", "4"], 2),
    "fsdp_tp_2d": (f"{CH05}/hybrid_parallelism.py", ["--mode", "2d", "--tp", "2"], 4),
    "cp": (f"{CH05}/context_parallel.py", ["--layout", "zigzag"], 2),
}
# The negative control: FSDP whose rank 1 never applies its shard's update (as if that shard's
# gradient were dropped); it trains half the model.
CONTROL = ("fsdp_shard_dropped", "fsdp_full_shard",
           ("optimizer.step()  # each rank updates only its own shard",
            "optimizer.step() if ctx.rank == 0 else None  # rank 1's shard dropped"))
GLOBAL_BATCH, LR, SEED = 32, 3e-3, 0
ARCH = "llama"
HELD_OUT_WINDOWS = 256
# Largest |loss - one process's loss| allowed at any step (nats); benchmarks/README.md says why.
TOLERANCE = 0.02

def launcher() -> list[str]:
    """torchrun, as this interpreter's module; the test suite names its single-node fork launcher
    (tests/fork_launcher.py, same flags) in DISTKIT_TORCHRUN."""
    return [*(shlex.split(os.environ.get("DISTKIT_TORCHRUN", "")) or [sys.executable, "-m", "torch.distributed.run"]),
            "--standalone"]


def parse_args(argv=None):
    parser = ArgumentParser(description="Train the same tiny Llama on the same text under every strategy and "
                                        "compare each loss curve with one process's.")
    parser.add_argument("--steps", type=positive_int, default=1000,
                        help=f"optimizer steps per strategy, {GLOBAL_BATCH} x 32 tokens each (default: 1000, "
                             "about 1 M tokens)")
    parser.add_argument("--strategies", nargs="+", choices=[*STRATEGIES, CONTROL[0]], metavar="NAME",
                        default=[*STRATEGIES, CONTROL[0]],
                        help=f"which to run: {', '.join([*STRATEGIES, CONTROL[0]])} (default: all)")
    parser.add_argument("--held-out-every", type=positive_int, default=100, metavar="N",
                        help="each run saves its weights every N steps; the held-out loss is computed from "
                             "each save and the final weights (default: 100)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where every run trains (default: cpu, fp32 on gloo; cuda needs 4 GPUs)")
    parser.add_argument("--results", default="runs/parity.jsonl", metavar="FILE",
                        help="one JSON line per strategy (default: runs/parity.jsonl)")
    parser.add_argument("--plot", default=None, metavar="DIR",
                        help="draw the curves of --results into DIR/parity.png instead of training")
    args = parser.parse_args(argv)
    if "one_process" not in args.strategies and not args.plot:
        parser.error("--strategies must include one_process: every curve is compared with it")
    return args


def command(name: str, steps: int, scratch: Path, device: str = "cpu", every: int = 100) -> list[str]:
    """The launch of one strategy: its script (or the control's mutant) with the shared flags."""
    base, mutation = (CONTROL[1], CONTROL[2]) if name == CONTROL[0] else (name, None)
    script, flags, ranks = STRATEGIES[base]
    shared = ["--arch", ARCH, "--model-size", "tiny", "--data", "text", "--steps", str(steps), "--global-batch-size",
              str(GLOBAL_BATCH), "--lr", str(LR), "--warmup-steps", "1", "--seed", str(SEED),
              "--results", str(scratch / "r.jsonl"), "--save", str(scratch / "model.pt"), "--save-every", str(every),
              "--device", device]
    if script == FSDP:
        shared += ["--log-every", "1"]
    if script.startswith(CH05):
        shared += ["--optimizer", "adamw"]
    flags = [f.replace("{scratch}", str(scratch)) for f in flags]
    head = [*launcher(), f"--nproc_per_node={ranks}"]
    if mutation:  # distkit/mutation.py runs the script's source with the one piece replaced
        return [*head, str(REPO / "distkit" / "mutation.py"), str(REPO / script), *mutation, "--", *flags, *shared]
    return [*head, str(REPO / script), *flags, *shared]


def step_losses(record: dict) -> list[float]:
    """The job's loss at every step, as the script recorded it (fsdp_transformer.py: (step, loss))."""
    losses = record["losses"]
    return [loss for _, loss in losses] if losses and isinstance(losses[0], list) else list(losses)


def held_out_loss(path: Path, cfg) -> float:
    """The saved weights' mean token cross-entropy on the held-out windows, computed here."""
    saved = safe_load(path)
    state = saved.get("model", saved) if isinstance(saved, dict) else saved
    model = build_model(cfg)
    model.load_state_dict(state)
    model.eval()
    inputs, targets = TextTask(cfg, seed=SEED).held_out(HELD_OUT_WINDOWS)
    with torch.no_grad():
        return lm_loss(model(inputs), targets).item()


def held_out_steps(steps: int, every: int) -> list[int]:
    """The steps after which the held-out loss is computed: every ``every`` steps, and the last."""
    return [*range(every, steps, every), steps]


def run_one(name: str, steps: int, cfg, device: str, every: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="parity_") as tmp:
        scratch = Path(tmp)
        argv = command(name, steps, scratch, device, every)
        env = dict(os.environ, DISTKIT_NO_PROGRESS="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        started = time.perf_counter()
        done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            tail = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()][-5:]
            raise UsageError(f"{name} failed: " + " | ".join(tail))
        (record,) = [json.loads(line) for line in (scratch / "r.jsonl").read_text().splitlines()]
        launch = shlex.join(argv).replace(str(scratch), "{scratch}").replace(str(REPO) + "/", "")
        held_out = [[k, held_out_loss(saved_at(str(scratch / "model.pt"), k) if k < steps else scratch / "model.pt",
                                      cfg)] for k in held_out_steps(steps, every)]
        return {"strategy": name, "launch": launch,
                "world_size": record["world_size"], "losses": step_losses(record),
                "held_out": held_out, "held_out_loss": held_out[-1][1],
                "wall_s": round(time.perf_counter() - started, 1)}


def compare(rows: list[dict]) -> list[dict]:
    """Each row's largest |loss - one process's loss| over the steps, the same for the held-out loss at
    each save, and whether both are within TOLERANCE."""
    one = next(r for r in rows if r["strategy"] == "one_process")
    for row in rows:
        gaps = [abs(a - b) for a, b in zip(row["losses"], one["losses"])]
        assert len(row["losses"]) == len(one["losses"]), row["strategy"]
        assert [k for k, _ in row["held_out"]] == [k for k, _ in one["held_out"]], row["strategy"]
        row["max_gap"] = max(gaps)
        row["held_out_gap"] = max(abs(a[1] - b[1]) for a, b in zip(row["held_out"], one["held_out"]))
        row["within_tolerance"] = max(row["max_gap"], row["held_out_gap"]) <= TOLERANCE
    return rows


def main(argv=None):
    args = parse_args(argv)
    if args.plot:
        return draw(read_rows(args.results), Path(args.plot))
    check_outputs(None, args, files=["results"])
    cfg = model_config(ARCH, "tiny", vocab_size=256)
    info = {**provenance(shlex.join(["python", "benchmarks/parity.py", *(argv or sys.argv[1:])]), device=args.device),
            "data": corpus_info(), "steps": args.steps, "global_batch_size": GLOBAL_BATCH, "lr": LR,
            "tokens_per_step": GLOBAL_BATCH * cfg.seq_len, "tolerance": TOLERANCE, "model": cfg.to_dict(),
            "held_out_every": args.held_out_every}
    print(f"{len(args.strategies)} runs of {args.steps} steps x {GLOBAL_BATCH * cfg.seq_len} tokens of "
          f"{info['data']['name']} (Python {info['data']['python']}, {info['data']['bytes']:,} bytes)")
    rows = [run_one(name, args.steps, cfg, args.device, args.held_out_every)
            for name in progress(args.strategies, 0, desc="parity")]
    rows = compare(rows)
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    with open(args.results, "w") as f:
        for row in rows:
            f.write(json.dumps({**info, **row}) + "\n")
    print(table(rows))
    wrong = [r["strategy"] for r in rows if r["within_tolerance"] != (r["strategy"] != CONTROL[0])]
    if wrong:
        raise UsageError(f"parity broken: {', '.join(wrong)} (a strategy outside the band, or the control inside)")
    print(f"every strategy within {TOLERANCE} nats of one process at every step; the control left the band")


def read_rows(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def table(rows: list[dict]) -> str:
    lines = ["| strategy | ranks | final train loss | final held-out loss | max gap to one process: train "
             "(every step) | held-out (every save) | within band |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['strategy']} | {r['world_size']} | {r['losses'][-1]:.4f} | {r['held_out_loss']:.4f} | "
                     f"{r['max_gap']:.2e} | {r['held_out_gap']:.2e} | {'yes' if r['within_tolerance'] else '**no**'} |")
    return "\n".join(lines)


def model_name(model: dict) -> str:
    """What a record's ``model`` field trained, in words (the Llama's has key/value heads)."""
    return "tiny Llama" if "n_kv_head" in model else "tiny GPT"


def readme_figures(out_dir: Path) -> str:
    """benchmarks/README.md's parity plot and table, from the committed run (records/parity.jsonl)."""
    from distkit.records import machine_label

    rows = read_rows(Path(__file__).resolve().parent / "records" / "parity.jsonl")
    draw(rows, Path(out_dir) / "figures")
    r, data = rows[0], rows[0]["data"]
    tokens = r["steps"] * r["tokens_per_step"]
    return (table(rows) + "\n\n![Loss-curve parity: every strategy's train loss against tokens, and its distance "
            "to one process's](figures/parity.png)\n\n"
            f"<sub>The {model_name(r['model'])} (vocabulary {r['model']['vocab_size']}) trained "
            f"{r['steps']} steps x {r['tokens_per_step']} tokens "
            f"({tokens:,} tokens) of {data['name']} from Python {data['python']} ({data['bytes']:,} bytes, sha1 "
            f"{data['sha1']}), AdamW lr {r['lr']:g}; held-out loss over {HELD_OUT_WINDOWS} windows of the last 10%, "
            f"computed from the weights each run saved every {r['held_out_every']} steps (the dots); band "
            f"{r['tolerance']} nats. Measured on "
            f"{machine_label(r['machine'], 'gloo')}, torch {r['torch']}, {r['date']} "
            "([records/parity.jsonl](records/parity.jsonl)).</sub>\n")


def readme_summary(out_dir: Path) -> str:
    """The top README's view of the same record: the plot benchmarks/README.md draws, and the gaps."""
    rows = read_rows(Path(__file__).resolve().parent / "records" / "parity.jsonl")
    r = rows[0]
    worst = max((x for x in rows if x["strategy"] not in ("one_process", CONTROL[0])), key=lambda x: x["max_gap"])
    held = max((x for x in rows if x["strategy"] not in ("one_process", CONTROL[0])), key=lambda x: x["held_out_gap"])
    control = next(x for x in rows if x["strategy"] == CONTROL[0])
    return ("![Loss-curve parity of every strategy](benchmarks/figures/parity.png)\n\n"
            f"<sub>{len(rows) - 2} strategies and one process, {r['steps'] * r['tokens_per_step']:,} tokens of real "
            f"text each: the largest gap to one process's loss at any step is {worst['max_gap']:.1e} nats "
            f"({worst['strategy']}), and to its held-out loss every {r['held_out_every']} steps "
            f"{held['held_out_gap']:.1e} ({held['strategy']}); the negative control's are {control['max_gap']:.2f} and "
            f"{control['held_out_gap']:.2f}. Band {r['tolerance']} nats; "
            "table, method and record in [benchmarks/README.md](benchmarks/README.md#loss-curve-parity-the-same-"
            "model-under-every-strategy).</sub>\n")


def draw(rows: list[dict], out_dir: Path) -> Path:
    """Loss vs tokens for every strategy on one axis, the gap to one process on a second (log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    tokens = rows[0]["tokens_per_step"]
    one = next(r for r in rows if r["strategy"] == "one_process")
    reference = one["losses"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for r in rows:
        x = [(i + 1) * tokens for i in range(len(r["losses"]))]
        style = {"linestyle": "--", "color": "black"} if r["strategy"] == CONTROL[0] else {}
        line, = top.plot(x, r["losses"], label=r["strategy"], linewidth=1, **style)
        top.plot([k * tokens for k, _ in r["held_out"]], [v for _, v in r["held_out"]], "o", markersize=3,
                 color=line.get_color())
        if r["strategy"] != "one_process":
            bottom.plot(x, [max(abs(a - b), 1e-9) for a, b in zip(r["losses"], reference)], linewidth=1, **style)
            bottom.plot([k * tokens for k, _ in r["held_out"]],
                        [max(abs(a[1] - b[1]), 1e-9) for a, b in zip(r["held_out"], one["held_out"])], "o",
                        markersize=3, color=line.get_color())
    bottom.axhline(rows[0]["tolerance"], color="red", linewidth=1, label="tolerance")
    top.set_ylabel("train loss; dots: held-out (nats)")
    bottom.set(yscale="log", xlabel="tokens", ylabel="|loss - one process| (dots: held-out)")
    top.legend(fontsize=7, ncol=3)
    bottom.legend(fontsize=7)
    machine = rows[0]["machine"]
    fig.suptitle(f"Loss-curve parity on {rows[0]['data']['name']} ({machine.get('device_name', '?')}, "
                 f"torch {rows[0]['torch']}, {rows[0]['date']})", fontsize=9)
    path = out_dir / "parity.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


if __name__ == "__main__":
    run_main(main)
