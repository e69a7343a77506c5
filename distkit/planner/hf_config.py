"""A model to plan from a Hugging Face ``config.json``, read with plain :mod:`json` (offline: no
``transformers``, no download): the Llama-shaped families whose parameters the planner's Llama
config counts, with a mixture of experts for Mixtral."""
from __future__ import annotations

import json
import math
from dataclasses import replace

from .. import theory
from ..errors import UsageError
from ..models import LlamaModelConfig, with_experts

# Every one of these is a Llama as the planner counts it: RMSNorm, grouped-query attention, a SwiGLU
# MLP. What a family adds beyond that is small and said where it is read (UNCOUNTED).
MODEL_TYPES = ("llama", "mistral", "mixtral", "qwen2", "qwen3")


# the planner's field <- the config.json key (read with the Hugging Face defaults where one may be absent)
FIELDS = {"n_layer": "num_hidden_layers", "n_embd": "hidden_size", "n_head": "num_attention_heads",
          "n_kv_head": "num_key_value_heads", "intermediate_size": "intermediate_size", "vocab_size": "vocab_size"}


# A config's max_position_embeddings is how far it can attend (131,072 for Llama 3.1), not a length
# anyone trains a step at; the plan uses the presets' length unless --seq-len says otherwise.
DEFAULT_SEQ_LEN = 2048


def _load(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except OSError as exc:
        raise UsageError(f"--hf-config {path}: cannot read it ({exc.strerror or exc})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"--hf-config {path}: not a JSON config.json ({exc})") from None
    if not isinstance(config, dict):
        raise UsageError(f"--hf-config {path}: not a JSON object (a config.json is one)")
    if config.get("model_type") not in MODEL_TYPES:
        raise UsageError(f"--hf-config {path}: model_type {config.get('model_type')!r} is not one the planner "
                         f"reads ({', '.join(MODEL_TYPES)})")
    return config


def _integer(config: dict, key: str, path: str) -> int:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"--hf-config {path}: {key} must be a positive integer, got {value!r}")
    return value


def uncounted_params(config: dict) -> int:
    """Parameters a config's model holds that the planner's Llama does not count: Qwen2's biases on
    q/k/v (a width and two key/value widths per block), Qwen3's RMSNorm of q and k (a head's width
    each per block). Well under 0.1% of any released model; said, not hidden."""
    layers, width = config["num_hidden_layers"], config["hidden_size"]
    head = config.get("head_dim") or width // config["num_attention_heads"]
    kv = config.get("num_key_value_heads") or config["num_attention_heads"]
    if config["model_type"] == "qwen2":
        return layers * (width + 2 * kv * head)
    if config["model_type"] == "qwen3":
        return layers * 2 * head
    return 0


def read_hf_config(path: str, seq_len: int | None = None):
    """The planner's model of the ``config.json`` at ``path``: a :class:`~distkit.models.LlamaModelConfig`,
    or its mixture of experts for Mixtral (``num_local_experts`` experts, ``num_experts_per_tok`` per
    token). One-line :class:`UsageError` for a file that cannot be read, a ``model_type`` outside
    :data:`MODEL_TYPES`, a missing size, or a head width the Llama shape cannot hold
    (``head_dim`` other than ``hidden_size / num_attention_heads``)."""
    config = _load(path)
    fields = {}
    for name, key in FIELDS.items():
        if name == "n_kv_head" and config.get(key) is None:
            fields[name] = fields["n_head"]  # Hugging Face's default: one key/value head per query head
            continue
        fields[name] = _integer(config, key, path)
    if fields["n_embd"] % fields["n_head"] or fields["n_head"] % fields["n_kv_head"]:
        raise UsageError(f"--hf-config {path}: hidden_size {fields['n_embd']}, num_attention_heads "
                         f"{fields['n_head']} and num_key_value_heads {fields['n_kv_head']} do not divide")
    head = config.get("head_dim")
    if head is not None and head != fields["n_embd"] // fields["n_head"]:
        raise UsageError(f"--hf-config {path}: head_dim {head} is not hidden_size / num_attention_heads "
                         f"({fields['n_embd'] // fields['n_head']}); the planner's Llama shape cannot hold it")
    cfg = LlamaModelConfig(seq_len=seq_len or DEFAULT_SEQ_LEN, rope_theta=float(config.get("rope_theta", 10000.0)),
                           rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                           tie_embeddings=bool(config.get("tie_word_embeddings", False)), **fields)
    if config["model_type"] == "mixtral":
        experts = _integer(config, "num_local_experts", path)
        top_k = _integer(config, "num_experts_per_tok", path)
        cfg = with_experts(cfg, experts, top_k)
    return cfg


def uncounted_note(path: str, cfg) -> str:
    """One line on the parameters of the config at ``path`` that the plan of ``cfg`` leaves out
    (:func:`uncounted_params`), with their share of the model; empty when there are none."""
    config = _load(path)
    left = uncounted_params(config)
    if not left:
        return ""
    what = {"qwen2": "q/k/v biases", "qwen3": "q/k RMSNorms"}[config["model_type"]]
    counted = sum(math.prod(shape) for shape in theory.param_shapes(cfg).values())
    return (f"note: {config['model_type']}'s {what} ({left:,} parameters, {left / counted:.3%} of the model) "
            "are not counted")


def with_overrides(cfg, **overrides):
    """``cfg`` with the fields the command line gave (``None`` keeps the config's), checked as
    :func:`distkit.models.model_config` checks a preset: the width splits into the heads, the heads
    into key/value groups."""
    cfg = replace(cfg, **{k: v for k, v in overrides.items() if v is not None})
    if cfg.n_embd % cfg.n_head or cfg.n_head % cfg.n_kv_head:
        raise UsageError(f"the width {cfg.n_embd} (--hidden) must split into {cfg.n_head} heads (--heads), and "
                         f"those into {cfg.n_kv_head} key/value heads (--kv-heads)")
    return cfg
