"""The Megatron tensor-parallel plan of each model family, written once: module name -> how
``torch.distributed.tensor.parallel.parallelize_module`` splits it (the pytorch/examples
``distributed/tensor_parallelism`` way). Chapter 05's ``tensor_parallel.py`` and
``hybrid_parallelism.py`` apply these plans, and :mod:`distkit.predictors` reads from them which
parameters are split and along which dimension.

Inside a block (Shoeybi et al., "Megatron-LM", 2019, section 3): the attention's q/k/v projections
and the MLP's input projections are column-parallel (each rank computes some heads / some hidden
units with no communication), the attention's output projection and the MLP's output projection
row-parallel (each rank produces a partial sum, and one all-reduce adds them). ``PrepareModuleInput``
turns the attention's and the MLP's input into ONE replicated DTensor that every projection reads,
so backward sums their input gradients locally and all-reduces once per attention and once per MLP
(Megatron's "f" operator), not once per projection.

With sequence parallelism (Korthikanti et al., 2022) the activations between those matmuls stay
split along the sequence (``Shard(1)``): the same ``PrepareModuleInput`` all-gathers them, the
row-parallel outputs are reduce-scattered back to ``Shard(1)`` instead of all-reduced, and the
norms compute on their sequence shard (``SequenceParallel``). Outside the blocks the embeddings
leave already split along the sequence, the final norm works on the shard, and the LM head gathers
the sequence and returns full logits, so the loss is the usual one.

Each function returns ``(block plan, model plan)``: the first for every transformer block, the
second for the model outside the blocks (empty without sequence parallelism).
"""
from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel


def gpt_tp_plan(sequence_parallel: bool = False) -> tuple[dict, dict]:
    """The small GPT (:class:`distkit.models.TinyGPT`): blocks ``attn`` / ``mlp`` / ``ln_1`` /
    ``ln_2``; outside them ``tok_emb``, ``pos_emb`` (learned positions, added to the token
    embeddings), ``ln_f`` and ``lm_head``."""
    seq = Shard(1) if sequence_parallel else Replicate()  # the residual stream between the matmuls
    block = {
        "attn": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
        "attn.q_proj": ColwiseParallel(),
        "attn.k_proj": ColwiseParallel(),
        "attn.v_proj": ColwiseParallel(),
        "attn.out_proj": RowwiseParallel(output_layouts=seq),
        "mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
        "mlp.fc_in": ColwiseParallel(),
        "mlp.fc_out": RowwiseParallel(output_layouts=seq),
    }
    if not sequence_parallel:
        return block, {}
    block |= {"ln_1": SequenceParallel(), "ln_2": SequenceParallel()}
    model = {
        "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "ln_f": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        "pos_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)),  # (seq, n_embd)
    }
    return block, model


def llama_tp_plan(sequence_parallel: bool = False) -> tuple[dict, dict]:
    """Hugging Face's Llama, by its own module names: blocks ``self_attn`` / ``mlp`` (SwiGLU: two
    column-parallel input projections, ``gate_proj`` and ``up_proj``, multiplied elementwise on the
    shard) / ``input_layernorm`` / ``post_attention_layernorm``; outside them
    ``model.embed_tokens``, ``model.norm`` and ``lm_head`` (positions are rotary: no table).

    Its attention reshapes with -1 heads, so a shard of q_proj (and, with grouped-query attention,
    of k/v_proj: n_kv_head / tp key/value heads) simply runs fewer heads. It takes its input by
    keyword (``hidden_states=``). With sequence parallelism its residual stream stays a DTensor
    (``use_local_output=False``): ``LlamaModel.forward`` computes the rotary position embeddings (and
    the causal mask) from ``inputs_embeds.shape[1]``, which a DTensor reports as the WHOLE sequence,
    while a local shard would say seq / tp and rotate every rank's tokens as if they started at
    position 0. (torchtitan hands its Llama the precomputed rotary table for the whole sequence
    instead.)"""
    seq = Shard(1) if sequence_parallel else Replicate()
    local = not sequence_parallel
    block = {
        "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": seq},
                                        desired_input_kwarg_layouts={"hidden_states": Replicate()}),
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=seq, use_local_output=local),
        "mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=seq, use_local_output=local),
    }
    if not sequence_parallel:
        return block, {}
    block |= {"input_layernorm": SequenceParallel(), "post_attention_layernorm": SequenceParallel()}
    model = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1),
                                              use_local_output=False),
        "model.norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    return block, model


TP_PLANS = {"gpt": gpt_tp_plan, "llama": llama_tp_plan}


def tp_plan(arch: str, sequence_parallel: bool = False) -> tuple[dict, dict]:
    """``(block plan, model plan)`` of the architecture ``arch`` (``gpt`` or ``llama``)."""
    return TP_PLANS[arch](sequence_parallel)
