"""Does it fit, which strategy, how fast: the planner's answer for a model on a cluster.

    python benchmarks/plan.py --model llama-3.1-8b --seq-len 8192 --global-batch 128 --gpus 8 --gpu h100
    python benchmarks/plan.py --model llama-3.2-1b --gpus 4 --gpu l4 --activation-checkpointing full --json

Every strategy gets memory per GPU in five parts, whether it fits, a step time and tokens/s per
GPU; the last lines name the fastest configuration that fits and why each other one lost. The
numbers come from ``distkit.planner`` (its docstring says how), whose every byte count is
``distkit.theory``'s, the formulas the chapters measure against. GPU figures are datasheet peaks
and stated link assumptions (``--help`` lists the overrides); ``--gpu cpu --calibrate FILE`` uses
this machine's measured records instead.
"""
from __future__ import annotations

import json
import math
import os
import sys

from distkit import ArgumentParser, UsageError, planner, run_main
from distkit.flags import positive_float, positive_int
from distkit.models import MODEL_PRESETS, dense_config, is_moe, model_config, with_experts
from distkit.paths import check_outputs
from distkit.planner.published_check import COMPILE_SPEEDUP, FLOAT8_SPEEDUPS

MODELS = {f"{arch}-{size}" if not size.startswith(arch) else size: (arch, size)
          for arch, presets in MODEL_PRESETS.items() for size in presets}


def parse_args(argv=None):
    """The planner's flags, then the checks that refuse an input in one line before anything is planned.
    Long because it is one flag list: each flag is a few lines of help a reader sees in --help."""
    parser = ArgumentParser(
        description="Plan a training job: per strategy the memory per GPU (parameters, gradients, optimizer "
                    "state, activations, temporaries), whether it fits, the predicted step time and tokens/s "
                    "per GPU, and the fastest configuration that fits.",
        epilog=f"limits: the planner plans {planner.limits_text()}; outside them it says so in one line and exits "
               "2. example: python benchmarks/plan.py --model llama-3.1-8b --seq-len 8192 --global-batch 128 "
               "--gpus 64 --gpu h100 --activation-checkpointing full")
    model = parser.add_argument_group("model")
    model.add_argument("--model", choices=sorted(MODELS), default="llama-3.1-8b",
                       help="a named shape of distkit.models (default: llama-3.1-8b)")
    model.add_argument("--hf-config", metavar="PATH",
                       help="instead of --model: a Hugging Face config.json (read offline with json; model_type "
                            f"{', '.join(planner.HF_MODEL_TYPES)}; mixtral's experts become --experts/--top-k)")
    model.add_argument("--seq-len", type=positive_int,
                       help=f"sequence length, at least {planner.MIN_SEQ_LEN} (default: the preset's; with "
                            f"--hf-config {planner.HF_DEFAULT_SEQ_LEN})")
    model.add_argument("--n-layer", type=positive_int, help="override: transformer blocks")
    model.add_argument("--hidden", type=positive_int, help="override: model width (n_embd)")
    model.add_argument("--heads", type=positive_int, help="override: attention heads")
    model.add_argument("--kv-heads", type=positive_int, help="override: key/value heads (Llama)")
    model.add_argument("--intermediate-size", type=positive_int, help="override: MLP width (Llama)")
    model.add_argument("--vocab-size", type=positive_int, help="override: vocabulary")
    model.add_argument("--params", type=positive_float,
                       help="parameters wanted (e.g. 7e9): the shape keeps its width and gets as many blocks "
                            "as come closest (with --experts: all experts counted)")
    model.add_argument("--experts", type=positive_int,
                       help="turn every block's MLP into this many experts of its shape with top-k routing (a "
                            "mixture of experts: parameters grow, FLOPs per token count the active experts); "
                            "makes the ep strategy possible")
    model.add_argument("--top-k", type=positive_int,
                       help="experts each token goes to (with --experts; default: 2)")
    job = parser.add_argument_group("job")
    job.add_argument("--global-batch", type=positive_int, default=None,
                     help=f"sequences per optimizer step, at most {planner.MAX_SEQUENCES:,} (default: 1M tokens' "
                          "worth, rounded up to split over the GPUs (over --layout's batch ranks) when it has "
                          "a sequence per GPU)")
    job.add_argument("--global-batch-tokens", type=positive_int, help="tokens per optimizer step instead")
    job.add_argument("--micro-batch", type=positive_int, default=1, help="sequences per GPU per forward (default: 1)")
    job.add_argument("--precision", choices=planner.PRECISIONS, default="bf16",
                     help="bf16 mixed precision (fp32 master weights) or fp32 (default: bf16)")
    job.add_argument("--optimizer", choices=planner.OPTIMIZERS, default="adamw", help="(default: adamw)")
    job.add_argument("--activation-checkpointing", choices=planner.AC_MODES, default="none",
                     help="what each block keeps for backward: selective keeps every matmul's output, "
                          "titan-op (torchtitan's selective op) every other one (default: none)")
    job.add_argument("--attention", choices=planner.ATTENTION, default="flash",
                     help="the attention kernel the activations assume: flash keeps no s x s matrix; eager keeps "
                          "its softmax probabilities (Korthikanti's 5as/h term at dropout 0) (default: flash)")
    job.add_argument("--offload", action="store_true",
                     help="allow CPU offload of the optimizer state (ZeRO-3 offload) to be recommended")
    job.add_argument("--compile", action="store_true",
                     help=f"the job compiles its blocks with torch.compile: compute x{COMPILE_SPEEDUP:.3f}, and its "
                          "saved activations outside full AC by the factor fitted on the same runs (torchtitan's "
                          "H100 Table 1; --published prints both)")
    job.add_argument("--float8", nargs="?", const="tensorwise", choices=planner.FLOAT8_RECIPES, metavar="RECIPE",
                     help="the job runs Float8 linear layers, RECIPE tensorwise (the default; Table 1's "
                          f"x{FLOAT8_SPEEDUPS['tensorwise']:.3f} on a compiled step) or rowwise "
                          f"(x{FLOAT8_SPEEDUPS['rowwise']:.3f}, torchtitan's January 2025 rowwise runs): compute "
                          "outside attention sped up to match, its saved activations by the factor fitted on "
                          "Table 1 (either recipe)")
    job.add_argument("--compile-loss", action="store_true",
                     help="the loss (fp32 cast, log-softmax, NLL) runs compiled, as torchtitan's does with "
                          "compile since 2025: its working set is the logits and their gradient")
    job.add_argument("--async-tp", action="store_true",
                     help="TP's all-gathers and reduce-scatters run micro-pipelined with their matmuls (torch's Async "
                          "TP, torchtitan's enable_async_tensor_parallel); needs --compile, and a layout with tp > 1 "
                          "and SP (the search applies it to its N-D layouts with both)")
    job.add_argument("--lora-rank", type=positive_int, default=16, help="rank of the LoRA row's adapters (default: 16)")
    hw = parser.add_argument_group("cluster")
    hw.add_argument("--gpus", type=positive_int, default=8,
                    help=f"GPUs in the job, 1 to {planner.MAX_GPUS} (default: 8)")
    hw.add_argument("--gpus-per-node", type=positive_int, help="(default: the GPU type's usual node, 8; L4: 4)")
    hw.add_argument("--gpu", choices=[*planner.GPUS, "cpu"], default="h100",
                    help="GPU type from the table in distkit/planner/inputs.py, or cpu (needs --calibrate) "
                         "(default: h100)")
    hw.add_argument("--gpu-memory-gib", type=positive_float, help="override: memory per GPU")
    hw.add_argument("--peak-tflops", type=positive_float, help="override: peak dense TFLOP/s in --precision")
    hw.add_argument("--efficiency", type=positive_float,
                    help=f"achievable fraction of the peak (default: {planner.FITTED_EFFICIENCY}, fitted on "
                         "torchtitan's published H100 runs: --published)")
    hw.add_argument("--usable-memory", type=positive_float,
                    help="fraction of GPU memory the caching allocator may reserve (default: 0.9)")
    hw.add_argument("--intra-bw-gbps", type=positive_float, help="override: bus GB/s inside a node")
    hw.add_argument("--intra-latency-us", type=positive_float,
                    help="override: latency per collective step inside a node")
    hw.add_argument("--inter-bw-gbps", type=positive_float,
                    help="override: GB/s of one GPU's network port between nodes (a ring across nodes "
                         "uses all of a node's ports in its group)")
    hw.add_argument("--inter-latency-us", type=positive_float, help="override: latency per step between nodes")
    hw.add_argument("--bandwidth-records", metavar="FILE",
                    help="alpha-beta per collective from 04-nccl-operations/bandwidth_test.py records of your machine")
    hw.add_argument("--calibrate", metavar="FILE",
                    help="with --gpu cpu: a benchmark results file (with bandwidth sweeps) of this machine")
    out = parser.add_argument_group("output")
    out.add_argument("--strategies", nargs="+", choices=[str(s) for s in planner.SEARCHED],
                     help="(default: all; nd: the best N-D layout of the search)")
    out.add_argument("--layout", metavar="AXIS=N,...",
                     help="instead of the search: plan this one N-D layout, e.g. dp_shard=32,tp=8 or "
                          "dp_replicate=2,tp=8,pp=4,schedule=interleaved_1f1b,microbatches=16 (axes: "
                          f"{', '.join(planner.AXES)}; sp=on|off or tp_sp=N; loss_parallel=on|off; schedule "
                          f"{'/'.join(planner.SCHEDULES)}; dp_shard left out takes the GPUs left)")
    out.add_argument("--json", action="store_true", help="print JSON instead of the table")
    out.add_argument("--plot", metavar="FILE", help="also draw memory per GPU and throughput per strategy (PNG)")
    out.add_argument("--decision-matrix", action="store_true",
                     help="instead of planning: the top README's decision guide, each row planned (H100 80GB, 8 per "
                          "node, bf16 AdamW, full AC, 1M-token steps; the other flags are not used)")
    out.add_argument("--published", action="store_true",
                     help="instead of planning: the planner against torchtitan's published GPU runs (each with its "
                          "own layout), its efficiency fitted on the H100 rows only, the A100 rows predicted")
    out.add_argument("--validate", metavar="RESULTS",
                     help="instead of planning: predicted vs measured for every cell of a benchmark results file "
                          "(distributed_benchmarks.py --bandwidth), the time calibrated on the other "
                          "architecture's cells")
    out.add_argument("--only-misses", action="store_true",
                     help="with --validate: list only the cells whose error leaves the bounds "
                          f"({planner.validation_bounds_text().replace('%', '%%')}), then the summary")
    args = parser.parse_args(argv)
    if args.only_misses and not args.validate:
        parser.error("--only-misses needs --validate RESULTS")
    if args.usable_memory is not None and args.usable_memory > 1:
        parser.error(f"argument --usable-memory: must be at most 1, got {args.usable_memory:g}")
    if args.efficiency is not None and args.efficiency > 1:
        parser.error(f"argument --efficiency: must be at most 1, got {args.efficiency:g}")
    if args.layout and args.strategies:
        parser.error("--layout pins one layout; --strategies chooses among the searched ones: give one of them")
    if args.gpu == "cpu" and not args.calibrate:
        parser.error("--gpu cpu needs --calibrate FILE (a results file of this machine with bandwidth sweeps)")
    return args


def build_model(args):
    """The model the flags describe: a named shape or a config.json, with the overrides applied."""
    overrides = {key: value for key, value in (
        ("seq_len", args.seq_len), ("n_layer", args.n_layer), ("n_embd", args.hidden), ("n_head", args.heads),
        ("vocab_size", args.vocab_size), ("n_kv_head", args.kv_heads),
        ("intermediate_size", args.intermediate_size)) if value}
    if args.hf_config:
        base = planner.read_hf_config(args.hf_config)
        arch, size = "llama", None
        if is_moe(base) and not args.experts:  # the config's own experts, unless --experts replaces them
            args.experts, args.top_k = base.num_experts, args.top_k or base.top_k
        base = dense_config(base)
    else:
        arch, size = MODELS[args.model]
        base = None
    if arch != "llama" and (args.kv_heads or args.intermediate_size):
        raise UsageError("--kv-heads and --intermediate-size describe a Llama; pick a llama --model")
    if base is None:
        cfg = model_config(arch, size, **overrides)
    else:
        cfg = planner.with_overrides(base, **overrides)
    if args.top_k and not args.experts:
        raise UsageError("--top-k routes tokens to experts: give --experts N too")
    if args.experts:
        cfg = with_experts(cfg, args.experts, args.top_k or 2)
    if args.params:
        cfg = planner.with_params(cfg, args.params)
    if args.hf_config and planner.uncounted_note(args.hf_config, cfg):
        print(planner.uncounted_note(args.hf_config, cfg), file=sys.stderr)
    return cfg


def build_plan(args, dims=None) -> planner.Plan:
    """The job; ``dims``: the --layout pinned, whose batch ranks a batch derived from tokens splits over."""
    cfg = build_model(args)
    if args.global_batch and args.global_batch_tokens:
        raise UsageError("give --global-batch (sequences) or --global-batch-tokens, not both")
    tokens = args.global_batch_tokens or (None if args.global_batch else 2 ** 20)
    batch = args.global_batch or max(1, round(tokens / cfg.seq_len))
    planner.check_job(cfg.seq_len, args.gpus, batch, tokens)
    # A batch derived from tokens is the planner's choice: one that splits over the ranks that take
    # sequences of their own (every GPU unless a layout is pinned; the GPUs of a TP, PP or CP group
    # share theirs), said. Only one with a sequence per such rank is rounded up: rounding a smaller
    # one would plan a step several times the one asked for. The layouts say whether it splits.
    ranks = dims.batch_ranks if dims else args.gpus
    if not args.global_batch and batch % ranks and batch > ranks:
        rounded = math.ceil(batch / ranks) * ranks
        over = f"{ranks} batch ranks of --layout" if dims else f"{ranks} GPUs"
        print(f"global batch {rounded} sequences: {tokens:,} tokens of {cfg.seq_len} make {batch}, rounded up "
              f"to split over {over} (--global-batch picks another)", file=sys.stderr)
        batch = rounded
    elif not args.global_batch and batch < ranks:
        print(f"global batch {batch} sequences: {tokens:,} tokens of {cfg.seq_len}, fewer than the {ranks} "
              f"{'batch ranks of --layout' if dims else 'GPUs'}, kept: layouts whose dp_replicate x dp_shard "
              "splits it run it", file=sys.stderr)
    return planner.Plan(cfg, global_batch=batch, micro_batch=args.micro_batch, precision=args.precision,
                        optimizer=args.optimizer, ac=args.activation_checkpointing, offload=args.offload,
                        lora_rank=args.lora_rank, attention=args.attention, compile=args.compile,
                        float8=bool(args.float8), float8_recipe=args.float8 or "tensorwise",
                        compiled_loss=args.compile_loss, async_tp=args.async_tp)


def build_cluster(args) -> planner.Cluster:
    if args.gpu == "cpu":
        base = planner.cpu_cluster(planner.read_matrix(args.calibrate), args.gpus)
        return planner.override_cluster(base, gpus_per_node=args.gpus_per_node)
    cl = planner.cluster(args.gpu, args.gpus, args.gpus_per_node)
    collectives = None
    if args.bandwidth_records:
        collectives = planner.fit_collectives(planner.read_matrix(args.bandwidth_records))
    return planner.override_cluster(
        cl, memory_gib=args.gpu_memory_gib, peak_tflops=args.peak_tflops, precision=args.precision,
        efficiency=args.efficiency, usable_memory=args.usable_memory, intra_bw_gbps=args.intra_bw_gbps,
        intra_latency_us=args.intra_latency_us, inter_bw_gbps=args.inter_bw_gbps,
        inter_latency_us=args.inter_latency_us, collectives=collectives)


def check_batch_ranks(plan: planner.Plan, cluster: planner.Cluster) -> None:
    """One line when the batch is smaller than the batch ranks (dp_replicate x dp_shard) of every
    layout: no layout can run it. A batch smaller than the GPUs alone is no reason: the GPUs of a TP,
    PP or CP group share their sequences, and the heads, blocks and sequence length bound how many
    GPUs those groups take."""
    if plan.global_batch >= cluster.gpus:
        return
    fewest = planner.fewest_batch_ranks(plan, cluster)
    if plan.global_batch < fewest:
        cfg = plan.model
        raise UsageError(
            f"the global batch {plan.global_batch} is fewer than the {fewest} batch ranks (dp_replicate x "
            f"dp_shard) of every layout on {cluster.gpus} GPUs: TP, PP and CP groups share their sequences, but "
            f"{cfg.n_head} heads, {cfg.n_layer} blocks and {cfg.seq_len} tokens let them take {cluster.gpus // fewest} "
            f"GPUs at most; give --global-batch {fewest} or more (or --global-batch-tokens "
            f"{fewest * cfg.seq_len:,}), or fewer GPUs")


def main(argv=None) -> None:
    args = parse_args(argv)
    check_outputs(None, args, files=["plot"])  # before the plan is printed, not after
    if args.decision_matrix:
        print(planner.decision_matrix())
        return
    if args.published:
        print(planner.published_table())
        return
    if args.validate:
        rows = planner.validate(planner.read_matrix(args.validate))
        if not rows:
            raise UsageError(f"{args.validate} holds no training cell with a model to validate")
        print(json.dumps(rows, indent=1) if args.json else planner.validation_table(rows, args.only_misses))
        return
    dims = planner.parse_layout(args.layout, args.gpus) if args.layout else None
    plan, cluster = build_plan(args, dims), build_cluster(args)
    if args.layout:  # one pinned layout, refused in one line before anything is planned
        problem = planner.check_dims(plan, cluster, dims) or planner.async_tp_problem(plan, dims)
        if problem:
            raise UsageError(f"--layout {args.layout}: {problem}")
        estimates = [planner.with_overhead(planner.estimate_dims(plan, cluster, dims), cluster, planner.ND)]
    else:
        check_batch_ranks(plan, cluster)
        estimates = planner.estimate_all(plan, cluster, args.strategies)
    rec = planner.recommend(estimates, cluster, allow_offload=args.offload)
    if args.json:
        print(json.dumps(planner.report_json(plan, cluster, estimates, rec), indent=1, default=_finite))
    else:
        print(planner.format_report(plan, cluster, estimates, rec))
    if args.plot:
        os.makedirs(os.path.dirname(os.path.abspath(args.plot)), exist_ok=True)  # as the other scripts do
        planner.plot_estimates(estimates, cluster, args.plot, title=planner.describe(plan, cluster))
        if not args.json:
            print(f"plot: {args.plot}")
    if rec.best is None:  # the report said why for each strategy; the exit code says it to a script
        sys.exit(1)


def _finite(value):
    return None if isinstance(value, float) and not math.isfinite(value) else value


if __name__ == "__main__":
    run_main(main)
