"""Chapter 03: load the consolidated model that deepspeed_train.py wrote and generate tokens with
``deepspeed.init_inference``.

``deepspeed_train.py`` ends by stitching the ZeRO shards into one fp32 state dict (``zero_to_fp32``,
``--save``).
That file is a plain PyTorch checkpoint (with the model's config): it loads into the small GPT or the
Llama without DeepSpeed. Here DeepSpeed's inference engine wraps the model: on a GPU it can cast to
fp16 and, for architectures it has kernel policies for (GPT-2, BERT, LLaMA ... from Hugging Face),
swap in fused kernels (``replace_with_kernel_inject``). The small GPT has no such policy, so
``--kernel-inject`` stops with
one line saying so (DeepSpeed itself would end in ``AssertionError: No default policy found!`` or
leave the model untouched); without it, the engine runs the plain module, in fp32 on CPU.

The synthetic task is a Markov chain (each token has two possible successors), so the output is
checkable: the script reports the share of generated transitions that are valid.

    python 03-deepspeed/deepspeed_inference.py --load checkpoints/ch03/zero3_fp32.pt
"""
from __future__ import annotations

import torch

from distkit import ArgumentParser, UsageError, add_runtime_args, distributed, run_main
from distkit.checkpoint import load_model_state, safe_load
from distkit.deepspeed import EVAL_BATCH, EVAL_STEP, import_deepspeed
from distkit.flags import positive_int
from distkit.logs import setup_logging
from distkit.models import TokenTask, build_model, config_from_dict, lm_loss


def parse_args():
    parser = ArgumentParser(
        description="Generate tokens from a consolidated fp32 checkpoint with deepspeed.init_inference.",
        epilog="example: python 03-deepspeed/deepspeed_inference.py --load checkpoints/ch03/zero3_fp32.pt")
    parser.add_argument("--load", default="checkpoints/ch03/zero3_fp32.pt", metavar="PATH",
                        help="the consolidated weights to read: the file deepspeed_train.py --save wrote "
                             "(default: checkpoints/ch03/zero3_fp32.pt)")
    parser.add_argument("--new-tokens", type=positive_int, default=24,
                        help="tokens to generate per prompt (default: 24)")
    parser.add_argument("--prompts", type=positive_int, default=4, help="prompts (held-out sequences) (default: 4)")
    parser.add_argument("--prompt-len", type=positive_int, default=8, help="prompt tokens per sequence (default: 8)")
    parser.add_argument("--kernel-inject", action="store_true",
                        help="ask DeepSpeed for fused inference kernels (CUDA only). They replace "
                             "layers DeepSpeed has a policy for (Hugging Face BERT, GPT-2, OPT, LLaMA "
                             "...); the small GPT has none, so the script stops with one line saying so")
    add_runtime_args(parser)
    return parser.parse_args()


def kernel_injection_layers(deepspeed, model: torch.nn.Module) -> list[str]:
    """Names of the model's layer classes that DeepSpeed can replace with fused inference kernels.

    Found the way ``init_inference(replace_with_kernel_inject=True)`` finds them
    (``deepspeed.module_inject.replace_module``): each policy in ``replace_policies`` is instantiated
    once, which sets its ``_orig_layer_class`` when its library (e.g. ``transformers``) imports, and
    a layer is replaced only when its class is exactly one of those. With no class known at all,
    DeepSpeed stops with ``AssertionError: No default policy found!``; with classes known but none
    in the model, it silently leaves the model as it is.
    """
    from deepspeed.module_inject.replace_policy import replace_policies

    known: set[type] = set()
    for policy in replace_policies:
        try:
            policy(None)
        except Exception:  # noqa: BLE001 - a policy whose library is broken matches nothing
            continue
        layer_class = getattr(policy, "_orig_layer_class", None)
        if isinstance(layer_class, (list, tuple)):
            known.update(layer_class)
        elif layer_class is not None:
            known.add(layer_class)
    return sorted({type(m).__name__ for m in model.modules() if type(m) in known})


@torch.no_grad()
def generate(engine, prompt: torch.Tensor, new_tokens: int, seq_len: int, seed: int) -> torch.Tensor:
    """Sample ``new_tokens`` tokens after ``prompt``, looking at most ``seq_len`` tokens back."""
    generator = torch.Generator(device=prompt.device).manual_seed(seed)
    tokens = prompt
    for _ in range(new_tokens):
        logits = engine(tokens[:, -seq_len:])[:, -1].float()
        next_token = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
        tokens = torch.cat([tokens, next_token], dim=1)
    return tokens


def main():
    args = parse_args()
    with distributed(args) as ctx:
        log = setup_logging(ctx.rank)
        checkpoint = safe_load(args.load)
        if not isinstance(checkpoint, dict) or "model" not in checkpoint or "model_config" not in checkpoint:
            raise UsageError(f"--load {args.load} is not a consolidated checkpoint from "
                             "deepspeed_train.py --save (no 'model' / 'model_config')")
        cfg = config_from_dict(checkpoint["model_config"])
        model = build_model(cfg)
        load_model_state(model, checkpoint["model"], args.load)  # plain PyTorch: no DeepSpeed needed
        model.eval()
        task = TokenTask(cfg, seed=checkpoint.get("seed", 0))
        sequences, length = task.tokens.shape
        if args.prompts > sequences or args.prompt_len > length:
            raise UsageError(f"--prompts {args.prompts} / --prompt-len {args.prompt_len}: the task has "
                             f"{sequences} sequences of {length} tokens")

        deepspeed = import_deepspeed(ctx.device)
        if args.kernel_inject:
            if not kernel_injection_layers(deepspeed, model):
                raise UsageError(f"--kernel-inject: DeepSpeed {deepspeed.__version__} has no kernel-injection "
                                 f"policy for any layer of {type(model).__name__} (its policies replace "
                                 "Hugging Face BERT, GPT-2, GPT-Neo/J/NeoX, OPT, BLOOM, LLaMA ... layers); "
                                 "run without --kernel-inject")
            if ctx.device.type != "cuda":
                raise UsageError("--kernel-inject needs CUDA GPUs: DeepSpeed's fused inference kernels "
                                 "are GPU kernels")
        dtype = torch.float16 if ctx.device.type == "cuda" else torch.float32
        engine = deepspeed.init_inference(model, dtype=dtype, replace_with_kernel_inject=args.kernel_inject,
                                          tensor_parallel={"tp_size": 1})
        device = next(engine.module.parameters()).device

        eval_inputs, eval_targets = task.global_batch(EVAL_STEP, EVAL_BATCH)
        with torch.no_grad():
            eval_loss = lm_loss(engine(eval_inputs.to(device)).float(), eval_targets.to(device)).item()
        log.info(f"loaded {args.load} ({checkpoint['strategy']}, {checkpoint['steps']} steps) into "
                 f"{type(model).__name__} | inference engine on {device} in {dtype} | eval loss {eval_loss:.4f} "
                 f"(training run measured {checkpoint['eval_loss']:.4f})")

        # Valid transitions of the Markov chain, read off the task's own sequences.
        valid = set(zip(task.tokens[:, :-1].flatten().tolist(), task.tokens[:, 1:].flatten().tolist()))
        prompts = task.tokens[:args.prompts, :args.prompt_len].to(device)
        out = generate(engine, prompts, args.new_tokens, cfg.seq_len, args.seed).cpu()
        new = out[:, args.prompt_len - 1:]
        pairs = list(zip(new[:, :-1].flatten().tolist(), new[:, 1:].flatten().tolist()))
        ok = sum(pair in valid for pair in pairs)
        for row in out.tolist()[:3]:
            log.info(f"prompt {row[:args.prompt_len]} -> {row[args.prompt_len:]}")
        log.info(f"valid transitions in generated tokens: {ok}/{len(pairs)} ({ok / len(pairs):.0%}); "
                 "an untrained model scores about 2/vocab")


if __name__ == "__main__":
    run_main(main)
