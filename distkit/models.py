"""The models the chapters train: a small MNIST CNN, a GPT-style transformer you can read in one
sitting, and a Llama-architecture decoder (Hugging Face ``transformers``, built from a config with
random weights: nothing is downloaded), plus a learnable synthetic token task for the transformers.

Every transformer script takes the model as flags (:func:`add_model_args`): ``--arch gpt|llama``
and a ``--model-size`` of that architecture (:data:`MODEL_PRESETS`), with optional overrides;
:func:`build_model` builds either from its config.

The transformer is written so every parallelism in the repository can cut it without rewriting it:
separate ``q_proj``/``k_proj``/``v_proj`` (tensor parallel shards heads column-wise), the number of
heads derived from the projected width at run time (a TP shard simply has fewer heads), blocks in an
``nn.ModuleList`` of identical ``Block`` modules (FSDP wraps each; pipeline stages take a slice),
and no weight tying (so stages and shards own disjoint parameters).
"""
from __future__ import annotations

import functools
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


class MnistCNN(nn.Module):
    """Two conv layers and two linear layers (about 1.2M parameters), the classic MNIST net."""

    def __init__(self, dropout: float = 0.25):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(2 * dropout)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(self.dropout1(x), 1)
        x = self.dropout2(F.relu(self.fc1(x)))
        return self.fc2(x)  # logits


@dataclass
class GPTConfig:
    """Shape of :class:`TinyGPT`. ``n_embd`` must divide by ``n_head``."""

    vocab_size: int = 256
    seq_len: int = 64
    n_layer: int = 4
    n_embd: int = 128
    n_head: int = 4
    mlp_ratio: int = 4
    dropout: float = 0.0

    arch = "gpt"  # a class attribute, not a field: the record's ``model`` field names the architecture

    def to_dict(self) -> dict:
        return asdict(self)


# Sizes used across chapters and benchmarks. "tiny" keeps 4-rank CPU tests to seconds.
GPT_PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(vocab_size=64, seq_len=32, n_layer=2, n_embd=64, n_head=4),
    "small": GPTConfig(vocab_size=256, seq_len=64, n_layer=4, n_embd=128, n_head=4),
    "medium": GPTConfig(vocab_size=512, seq_len=128, n_layer=6, n_embd=256, n_head=8),
    "large": GPTConfig(vocab_size=1024, seq_len=256, n_layer=12, n_embd=512, n_head=8),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"n_embd={cfg.n_embd} is not divisible by n_head={cfg.n_head}")
        self.head_dim = cfg.n_embd // cfg.n_head
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.k_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.v_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.out_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 heads: under tensor parallelism each rank's projections are narrower, so it holds fewer heads.
        q, k, v = (proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).reshape(batch, seq, -1)
        return self.out_proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc_in = nn.Linear(cfg.n_embd, cfg.mlp_ratio * cfg.n_embd)
        self.fc_out = nn.Linear(cfg.mlp_ratio * cfg.n_embd, cfg.n_embd)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.fc_out(F.gelu(self.fc_in(x))))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    """A decoder-only transformer: embeddings, ``n_layer`` blocks, final norm, LM head.

    ``forward(tokens)`` returns logits of shape ``(batch, seq, vocab)``. Pipeline stages can be made
    by setting blocks (and ``tok_emb``/``pos_emb`` or ``ln_f``/``lm_head``) to ``None``: missing
    parts are skipped, so a stage's forward takes hidden states instead of tokens.
    """

    def __init__(self, cfg: GPTConfig):
        if not isinstance(cfg, GPTConfig):
            from .runtime import UsageError

            raise UsageError(f"this script builds the small GPT only: --arch gpt, not --arch {cfg.arch}")
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """``positions``: the position of each token of ``x`` in its sequence, when ``x`` is not a
        whole sequence from position 0 (context parallelism gives a rank chunks from its middle and
        end); by default 0, 1, 2, ..."""
        if self.tok_emb is not None:
            if positions is None:
                positions = torch.arange(x.shape[1], device=x.device)
            x = self.tok_emb(x) + self.pos_emb(positions)
        for block in self.blocks:
            if block is not None:
                x = block(x)
        if self.ln_f is not None:
            x = self.ln_f(x)
        if self.lm_head is not None:
            x = self.lm_head(x)
        return x


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def synthetic_tokens(num_sequences: int, seq_len: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    """A learnable token task: sequences from a fixed random Markov chain with two successors.

    Every token ``t`` is followed by one of two tokens fixed for ``t`` (chosen once from ``seed``),
    with probability 1/2 each. A model that learns the table reaches the loss floor ln 2 ~= 0.693
    from ln(vocab_size) at the start, a drop that is clearly visible within a few hundred steps.
    Returns ``(num_sequences, seq_len + 1)`` int64 tokens: inputs are ``[:, :-1]``, targets ``[:, 1:]``.
    """  # noqa: E501
    gen = torch.Generator().manual_seed(seed)
    successors = torch.stack([torch.randperm(vocab_size, generator=gen) for _ in range(2)], dim=1)
    tokens = torch.empty(num_sequences, seq_len + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(vocab_size, (num_sequences,), generator=gen)
    choices = torch.randint(2, (num_sequences, seq_len), generator=gen)
    for t in range(seq_len):
        tokens[:, t + 1] = successors[tokens[:, t], choices[:, t]]
    return tokens


class TokenTask:
    """The synthetic token task as a deterministic stream of global batches.

    ``global_batch(step, batch_size)`` returns the same ``(inputs, targets)`` in every process, so a
    data-parallel rank takes its slice with :func:`rank_slice`, and a test can rebuild exactly the
    global batch a distributed job trained on to compare against single-process training.
    """

    def __init__(self, cfg: GPTConfig, num_sequences: int = 4096, seed: int = 0):
        self.cfg = cfg
        self.tokens = synthetic_tokens(num_sequences, cfg.seq_len, cfg.vocab_size, seed)

    def global_batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets of step ``step``: ``batch_size`` sequences, wrapping around the data."""
        index = (step * batch_size + torch.arange(batch_size)) % len(self.tokens)
        seqs = self.tokens[index]
        # contiguous: a pipeline stage checks its inputs' strides against the micro-batch it was
        # built for (torch 2.11 refuses the (S+1, 1) strides of a slice)
        return seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()


def rank_slice(batch: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous share of a global batch (its size must divide by ``world_size``)."""
    if len(batch) % world_size:
        raise ValueError(f"global batch {len(batch)} is not divisible by {world_size} ranks")
    per_rank = len(batch) // world_size
    return batch[rank * per_rank:(rank + 1) * per_rank]


# ------------------------------------------------------------------------------ Llama architecture
@dataclass
class LlamaModelConfig:
    """Shape of a Llama-architecture decoder (Hugging Face ``transformers``' ``LlamaForCausalLM``):
    RMSNorm, rotary position embeddings, grouped-query attention (``n_kv_head`` key/value heads
    shared by ``n_head`` query heads), a SwiGLU MLP of width ``intermediate_size``, no biases.

    Field names are the small GPT's where the concept is the same (``n_layer``, ``n_embd``,
    ``n_head``, ``seq_len``, ``vocab_size``), so the same ``--n-layer`` ... flags override both.
    The real Llama 3 shapes use RoPE scaling for long contexts; it changes no parameter or FLOP
    count, so it is left out.
    """

    vocab_size: int = 64
    seq_len: int = 32
    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 8
    n_kv_head: int = 4
    intermediate_size: int = 128
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = False

    arch = "llama"  # class attribute, not a field: what the record's ``model`` field calls it

    def to_dict(self) -> dict:
        return asdict(self)

    def hf_config(self):
        """The equivalent ``transformers.LlamaConfig`` (SDPA attention, no KV cache)."""
        transformers = import_transformers()
        return transformers.LlamaConfig(
            vocab_size=self.vocab_size, hidden_size=self.n_embd, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.n_layer, num_attention_heads=self.n_head,
            num_key_value_heads=self.n_kv_head, max_position_embeddings=self.seq_len,
            rope_theta=self.rope_theta, rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=self.tie_embeddings, attn_implementation="sdpa", use_cache=False)


# "tiny"/"small" mirror the small GPT's sizes for tests and CPU benchmarks; the named shapes are the
# published Llama 3 models (for GPUs, and for counting bytes and FLOPs on paper).
LLAMA_PRESETS: dict[str, LlamaModelConfig] = {
    "tiny": LlamaModelConfig(),
    "small": LlamaModelConfig(vocab_size=256, seq_len=64, n_layer=4, n_embd=128, n_head=8, n_kv_head=4,
                              intermediate_size=384),
    "llama-3.2-1b": LlamaModelConfig(vocab_size=128256, seq_len=2048, n_layer=16, n_embd=2048, n_head=32,
                                     n_kv_head=8, intermediate_size=8192, rope_theta=500000.0,
                                     tie_embeddings=True),
    "llama-3.2-3b": LlamaModelConfig(vocab_size=128256, seq_len=2048, n_layer=28, n_embd=3072, n_head=24,
                                     n_kv_head=8, intermediate_size=8192, rope_theta=500000.0,
                                     tie_embeddings=True),
    "llama-3.1-8b": LlamaModelConfig(vocab_size=128256, seq_len=2048, n_layer=32, n_embd=4096, n_head=32,
                                     n_kv_head=8, intermediate_size=14336, rope_theta=500000.0),
    # the two large ones at Llama 3's pre-training length (8,192): they are only ever planned, never
    # trained here, and a plan of them at 2,048 tokens would describe no job anyone runs
    "llama-3.1-70b": LlamaModelConfig(vocab_size=128256, seq_len=8192, n_layer=80, n_embd=8192, n_head=64,
                                      n_kv_head=8, intermediate_size=28672, rope_theta=500000.0),
    "llama-3.1-405b": LlamaModelConfig(vocab_size=128256, seq_len=8192, n_layer=126, n_embd=16384, n_head=128,
                                       n_kv_head=8, intermediate_size=53248, rope_theta=500000.0),
}


def import_transformers():
    """Import Hugging Face ``transformers`` (it imports torchvision, which needs
    :func:`distkit.data.import_torchvision`'s workaround on a CPU torch)."""
    from .data import import_torchvision

    import_torchvision()
    import transformers

    transformers.logging.set_verbosity_error()  # no advice about generation or hub files: none is used
    return transformers


@functools.lru_cache(maxsize=None)
def _llama_class():
    transformers = import_transformers()

    class LlamaLM(transformers.LlamaForCausalLM):
        """``transformers.LlamaForCausalLM`` as the chapters use a model: ``forward(tokens)`` returns
        logits ``(batch, seq, vocab)`` (no KV cache), ``.cfg`` is its :class:`LlamaModelConfig` and
        ``.blocks`` its decoder layers (what FSDP wraps one by one). Parameter names and the state
        dict are Hugging Face's own, so ``save_pretrained``/``from_pretrained`` read them as they are.
        """

        def __init__(self, cfg: LlamaModelConfig):
            super().__init__(cfg.hf_config())
            self.cfg = cfg

        @property
        def blocks(self) -> nn.ModuleList:
            return self.model.layers

        def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
            """Logits of ``tokens``; ``positions`` (as TinyGPT's) places them in their sequences when they
            are not a whole sequence from position 0 (context parallelism's chunks): RoPE's angles."""
            return super().forward(input_ids=tokens, position_ids=positions, use_cache=False).logits

    return LlamaLM


def build_model(cfg: "GPTConfig | LlamaModelConfig") -> nn.Module:
    """The transformer ``cfg`` describes, with random weights from the current seed:
    :class:`TinyGPT` for a :class:`GPTConfig`, a Hugging Face Llama (``LlamaLM``) for a
    :class:`LlamaModelConfig`. Both take tokens and return logits, and expose ``.cfg`` and ``.blocks``.
    A mixture-of-experts config (:func:`is_moe`) is refused: its experts are sharded as they are built
    (``05-advanced/expert_parallel.py``), and a dense model of its base shape would be the wrong model."""
    if is_moe(cfg):
        raise ValueError(f"build_model builds dense models; the {cfg.arch} model is built by "
                         "05-advanced/expert_parallel.py (build_moe_model)")
    if isinstance(cfg, LlamaModelConfig):
        return _llama_class()(cfg)
    return TinyGPT(cfg)


# ------------------------------------------------------------------ mixture of experts (MoE)
@dataclass
class GPTMoEConfig(GPTConfig):
    """The small GPT with every block's MLP replaced by a mixture of experts, as
    ``05-advanced/expert_parallel.py`` builds it: a router (``n_embd -> num_experts``, no bias) and
    ``num_experts`` MLPs of the GPT's own shape per block; each token goes to its ``top_k`` experts,
    and an expert takes at most ``ceil(capacity_factor x tokens x top_k / num_experts)`` of the
    tokens one rank routes (the rest are dropped). Parameter names: ``blocks.N.mlp.router.weight``,
    ``blocks.N.mlp.experts.E.fc_in.weight`` ..."""

    num_experts: int = 8
    top_k: int = 2
    capacity_factor: float = 1.25

    arch = "gpt_moe"


@dataclass
class LlamaMoEConfig(LlamaModelConfig):
    """A Llama whose SwiGLU MLPs are mixtures of ``num_experts`` experts of the same shape with top-k
    routing (Mixtral's layout, ``model.layers.N.mlp.router.weight``,
    ``model.layers.N.mlp.experts.E.gate_proj.weight`` ...): for counting bytes and FLOPs on paper
    (the planner's ``--experts``); no chapter trains it."""

    num_experts: int = 8
    top_k: int = 2
    capacity_factor: float = 1.25

    arch = "llama_moe"


_MOE_OF = {GPTConfig: GPTMoEConfig, LlamaModelConfig: LlamaMoEConfig}


def is_moe(cfg) -> bool:
    """True for a mixture-of-experts config (:class:`GPTMoEConfig`, :class:`LlamaMoEConfig`)."""
    return isinstance(cfg, (GPTMoEConfig, LlamaMoEConfig))


def dense_config(cfg) -> "GPTConfig | LlamaModelConfig":
    """The dense model an MoE config is built on (its experts one MLP again); a dense config itself."""
    if not is_moe(cfg):
        return cfg
    base = next(dense for dense, moe in _MOE_OF.items() if isinstance(cfg, moe))
    fields = cfg.to_dict()
    for name in ("num_experts", "top_k", "capacity_factor"):
        fields.pop(name)
    return base(**fields)


def with_experts(cfg, num_experts: int, top_k: int = 2, capacity_factor: float = 1.25):
    """``cfg`` (the GPT or the Llama) with every block's MLP turned into ``num_experts`` experts of
    the same shape, ``top_k`` of them per token. One-line :class:`distkit.UsageError` when a token
    would pick more experts than exist."""
    from .errors import UsageError

    if top_k > num_experts:
        raise UsageError(f"--top-k {top_k} is larger than --experts {num_experts}")
    return _MOE_OF[type(dense_config(cfg))](**dense_config(cfg).to_dict(), num_experts=num_experts,
                                              top_k=top_k, capacity_factor=capacity_factor)


# Sizes per architecture; "tiny" keeps 4-rank CPU tests to seconds.
MODEL_PRESETS: dict[str, dict] = {"gpt": GPT_PRESETS, "llama": LLAMA_PRESETS}
# Every architecture a record's ``model`` field can name (the MoE ones have no presets: a dense
# preset with_experts).
CONFIG_CLASSES = {"gpt": GPTConfig, "llama": LlamaModelConfig, "gpt_moe": GPTMoEConfig, "llama_moe": LlamaMoEConfig}


def model_config(arch: str = "gpt", size: str = "small", **overrides) -> "GPTConfig | LlamaModelConfig":
    """The ``size`` preset of architecture ``arch`` (:data:`MODEL_PRESETS`) with fields overridden
    (``None`` values are ignored).

    Raises :class:`distkit.UsageError` (one line) for a size the architecture does not have, or a
    width that does not split into the heads (or heads into key/value groups).
    """
    from .runtime import UsageError

    if arch not in MODEL_PRESETS:
        raise UsageError(f"unknown --arch {arch!r}; choose from {sorted(MODEL_PRESETS)}")
    if size not in MODEL_PRESETS[arch]:
        raise UsageError(f"--arch {arch} has no --model-size {size!r}; choose from {list(MODEL_PRESETS[arch])}")
    base = asdict(MODEL_PRESETS[arch][size])
    base.update({k: v for k, v in overrides.items() if v is not None})
    cfg = CONFIG_CLASSES[arch](**base)
    if cfg.n_embd % cfg.n_head:
        raise UsageError(f"the width {cfg.n_embd} (--n-embd) must be divisible by the head count "
                         f"{cfg.n_head} (--n-head)")
    if arch == "llama" and cfg.n_head % cfg.n_kv_head:
        raise UsageError(f"the head count {cfg.n_head} (--n-head) must be divisible by the key/value "
                         f"head count {cfg.n_kv_head} (--n-kv-head)")
    return cfg


def gpt_config(preset: str = "small", **overrides) -> GPTConfig:
    """A preset of the small GPT (:data:`GPT_PRESETS`) with fields overridden: ``model_config("gpt", ...)``."""
    return model_config("gpt", preset, **overrides)


def config_from_dict(model: dict) -> "GPTConfig | LlamaModelConfig":
    """The config a record's ``model`` field (``{"arch": ..., <fields>}``) describes."""
    fields = dict(model)
    arch = fields.pop("arch", "gpt")
    if arch not in CONFIG_CLASSES:
        raise ValueError(f"no model config for arch {arch!r}")
    return CONFIG_CLASSES[arch](**fields)


def add_model_args(parser, default_size: str = "small") -> None:
    """Model flags shared by the transformer chapters: an architecture, a size preset of it, and
    optional overrides.

    The overrides are range-checked where they are defined (``--n-head 0`` is argparse's one-line
    error); :func:`model_config_from_args` checks what only the combination can tell.
    """
    from .flags import positive_int

    sizes = ", ".join(f"{arch}: {'/'.join(presets)}" for arch, presets in MODEL_PRESETS.items())
    group = parser.add_argument_group("model")
    group.add_argument("--arch", choices=sorted(MODEL_PRESETS), default="gpt",
                       help="the repository's small GPT, or a Llama-architecture model built with "
                            "Hugging Face transformers from a config, random weights (default: gpt)")
    group.add_argument("--model-size", default=default_size, metavar="SIZE",
                       help=f"size preset of --arch ({sizes}; default: {default_size})")
    group.add_argument("--n-layer", type=positive_int, default=None, help="override the preset's layer count")
    group.add_argument("--n-embd", type=positive_int, default=None, help="override the preset's width")
    group.add_argument("--n-head", type=positive_int, default=None, help="override the preset's head count")
    group.add_argument("--n-kv-head", type=positive_int, default=None,
                       help="override the preset's key/value head count (--arch llama)")
    group.add_argument("--seq-len", type=positive_int, default=None,
                       help="override the preset's sequence length")
    group.add_argument("--vocab-size", type=positive_int, default=None, help="override the preset's vocabulary")
    group.add_argument("--tie-embeddings", choices=["on", "off"], default=None,
                       help="override whether the output layer shares the embedding's weight (--arch llama; "
                            "llama-3.2-1b ties them)")
    group.add_argument("--data", choices=["synthetic", "text"], default="synthetic",
                       help="synthetic: the Markov-chain token task; text: Python's reference documentation "
                            "as bytes (distkit.text; vocabulary 256, offline) (default: synthetic)")


def model_config_from_args(args) -> "GPTConfig | LlamaModelConfig":
    """The config that :func:`add_model_args` flags describe (checked by :func:`model_config`)."""
    from .runtime import UsageError

    arch = getattr(args, "arch", "gpt")
    for flag in ("n_kv_head", "tie_embeddings"):
        if arch != "llama" and getattr(args, flag, None) is not None:
            raise UsageError(f"--{flag.replace('_', '-')} applies to --arch llama only")
    vocab = args.vocab_size
    if getattr(args, "data", "synthetic") == "text":  # byte tokens: the vocabulary is at least 256
        if vocab is not None and vocab < 256:
            raise UsageError(f"--data text has 256 byte tokens; --vocab-size {vocab} is too small")
        vocab = vocab or max(256, model_config(arch, args.model_size).vocab_size)
    overrides = dict(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, seq_len=args.seq_len,
                     vocab_size=vocab)
    if arch == "llama":
        overrides["n_kv_head"] = getattr(args, "n_kv_head", None)
        tie = getattr(args, "tie_embeddings", None)
        overrides["tie_embeddings"] = None if tie is None else tie == "on"
    return model_config(arch, args.model_size, **overrides)
