"""What the chapter-02 scripts share that is not the FSDP lesson: checking the model flags.

The FSDP parts (the device mesh, ``fully_shard``, state dicts) stay written out in each script.
"""
from __future__ import annotations

from distkit.models import GPTConfig, gpt_config_from_args

MODEL_FLAGS = {"n_layer": "--n-layer", "n_embd": "--n-embd", "n_head": "--n-head",
               "seq_len": "--seq-len", "vocab_size": "--vocab-size"}


def model_config_or_error(parser, args) -> GPTConfig:
    """The GPT shape the model flags describe; a flag that cannot describe a model is one
    ``error:`` line from ``parser`` (exit 2) before any process group exists.

    ``distkit.models.add_gpt_args`` declares the overrides as plain ``int`` flags, so ``--n-head 0``
    would otherwise reach ``n_embd % n_head`` as a ZeroDivisionError traceback.
    """
    for field, flag in MODEL_FLAGS.items():
        value = getattr(args, field)
        if value is not None and value < 1:
            parser.error(f"argument {flag}: must be a positive integer, got {value}")
    cfg = gpt_config_from_args(args)
    if cfg.n_embd % cfg.n_head:
        parser.error(f"the width {cfg.n_embd} must be divisible by the head count {cfg.n_head}")
    return cfg
