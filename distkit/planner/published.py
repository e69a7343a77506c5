"""Published GPU training runs, as literal rows, each citing the file and table it comes from: the
rows the planner's time model is calibrated on (:data:`CALIBRATION`, torchtitan's H100 benchmark of
December 2024) and the rows it is only checked against (:data:`VALIDATION`, torchtitan's A100 numbers
in docs/performance.md, Trainy's H200 runs of June 2025 and the PyTorch team's Async TP runs of June
2025 in its benchmarks folder), and the published rows planned and shown beside them with their
errors but counted in no error, each with the reason (:data:`EXCLUDED`). Nothing here is computed: a
number that is not in its source is not here.

What the sources do not state is a stated assumption of this module, named per row in ``assumed``:
the sequence length where a table gives none (torchtitan's Llama 3 configs train on 8,192 tokens,
Llama 2 on 4,096), a pipeline's micro-batch count (torchtitan's default, the PP degree), a
"selective" AC that names no kind as torchtitan's default, selective op (the planner's
``titan-op``), and its "selective layer" AC (every second block checkpointed whole) planned as
selective op."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..models import LlamaModelConfig, model_config

H100_FILE = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
A100_FILE = "pytorch/torchtitan docs/performance.md"
H200_FILE = "pytorch/torchtitan benchmarks/llama3_8b_h200_2025-06_torchtitan.md"
ASYNC_FILE = "pytorch/torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md"

# Llama 2's published shapes (Touvron et al. 2023, and the Hugging Face configs torchtitan loads):
# 13B 40 x 5120, 40 heads, MLP 13824; 70B 80 x 8192, 64 heads with 8 kv-heads, MLP 28672; vocab 32k.
LLAMA2_13B = LlamaModelConfig(vocab_size=32000, seq_len=4096, n_layer=40, n_embd=5120, n_head=40, n_kv_head=40,
                              intermediate_size=13824)
LLAMA2_70B = LlamaModelConfig(vocab_size=32000, seq_len=4096, n_layer=80, n_embd=8192, n_head=64, n_kv_head=8,
                              intermediate_size=28672)
MODELS = {**{name: model_config("llama", name) for name in ("llama-3.1-8b", "llama-3.1-70b", "llama-3.1-405b")},
          "llama-2-13b": LLAMA2_13B, "llama-2-70b": LLAMA2_70B}


@dataclass(frozen=True)
class Row:
    """One published run: ``source`` (file, table), ``model`` (a key of :data:`MODELS`), ``gpu`` (a
    :data:`~.inputs.GPUS` key), ``gpus``, ``dims`` (the :class:`~.dims.ParallelDims` axes),
    ``local_batch`` (sequences per batch rank), ``seq_len``, ``ac``, ``compile``, ``float8``, the
    measured ``tps`` (tokens/s per GPU) and ``memory_gib`` (None where not published), ``assumed``
    (what the source does not say), ``compiled_loss`` (the loss compiled too: torchtitan compiles
    it with the model since 2025, and did not in December 2024; see :data:`H200_LOSS`), ``async_tp``
    (TP micro-pipelined with its matmuls, torchtitan's AsyncTP), ``float8_recipe`` (which Float8:
    :data:`~.inputs.FLOAT8_RECIPES`), ``excluded`` (why the run is counted in no error:
    :data:`EXCLUDED` rows only)."""

    source: str
    model: str
    gpu: str
    gpus: int
    dims: dict
    local_batch: int
    seq_len: int
    ac: str
    compile: bool
    float8: bool
    tps: float
    memory_gib: float | None = None
    schedule: str = "1f1b"
    assumed: tuple = field(default_factory=tuple)
    compiled_loss: bool = False
    async_tp: bool = False
    float8_recipe: str = "tensorwise"
    excluded: str = ""

    @property
    def label(self) -> str:
        axes = " ".join(f"{k}={v}" for k, v in self.dims.items())
        fp8 = "float8" if self.float8_recipe == "tensorwise" else f"float8-{self.float8_recipe}"
        tech = "+".join(t for t, on in (("compile", self.compile), (fp8, self.float8), ("asynctp", self.async_tp),
                                        ("compiled-loss", self.compiled_loss)) if on) or "eager"
        sched = f" {self.schedule}" if self.dims.get("pp", 1) > 1 else ""
        return f"{self.model} {self.gpus}x{self.gpu} {axes}{sched} s={self.seq_len} b={self.local_batch} {tech}"


_T1, _T2, _T3 = f"{H100_FILE}, Table 1", f"{H100_FILE}, Table 2", f"{H100_FILE}, Table 3"
_T4, _T5, _T6 = f"{H100_FILE}, Table 4", f"{H100_FILE}, Table 5", f"{H100_FILE}, Table 6"
_SEQ = "seq_len 8192 (torchtitan's Llama 3 config; the table gives none)"
_MICRO = ("as many pipeline micro-batches as PP stages (the table gives none): torchtitan's default at the "
          "file's commit 9dec370, pipeline_parallel_microbatches unset (pipelining_utils.py), which the "
          "405B config leaves unset")
_A = f"{A100_FILE}, Llama 3 table"
_A2 = f"{A100_FILE}, Llama 2 table"
_LAYER = "selective layer AC (every second block checkpointed whole) planned as selective op (titan-op)"
_OP = "the table's selective AC as torchtitan's default, selective op (titan-op; its llama3_8b.toml)"
_SEQ2 = "seq_len 4096 (Llama 2's, as the doc says)"
_H200 = f"{H200_FILE}, Results"
_TOML = ("seq_len 8192, selective op AC (titan-op), FSDP over every GPU: torchtitan's llama3_8b.toml, which the file's "
         "command runs (read at another commit than the run's)")
# torchtitan compiles its loss with --training.compile from 2025 on: build_cross_entropy_loss in
# torchtitan/components/loss.py at the H200 file's commit e7c0cae ("if job_config.training.compile:
# loss_fn = torch.compile(loss_fn)"); at the H100 file's commit 9dec370 train.py has those two lines
# commented out, so the calibration rows ran their loss eagerly.
H200_LOSS = "pytorch/torchtitan torchtitan/components/loss.py at e7c0cae: the loss compiled with --training.compile"
_FP8_FSDP = ("Float8 all-gathers in FSDP and the Float8 weights recomputed in backward (the command's flags) "
             "not modelled")
_A70, _A8 = f"{ASYNC_FILE}, Llama3 70b table", f"{ASYNC_FILE}, Llama3 8b table"
_SEQ820 = ("seq_len 8192: torchtitan's llama3_70b.toml and llama3_8b.toml at the run's commit 820504e (the file gives "
           "none)")
_SAC = "per op SAC as torchtitan's selective op (titan-op: selective_ac_option = \"op\" in its llama3_8b.toml)"
# at 820504e build_cross_entropy_loss compiles the loss with --training.compile, as at the H200 file's
_LOSS820 = "the loss compiled with the model (build_cross_entropy_loss at 820504e)"
_FP8_TP = ("Float8 tensorwise planned with Table 1's Float8 factor (measured in December 2024, when torchtitan's "
           "Float8 was tensorwise); its TP all-gathers in Float8 (enable_float8_tensorwise_tp at 820504e) not modelled")
_ROWWISE = ("Float8 rowwise planned with its own factor, measured on 8 H100s with FSDP in January 2025 (torchtitan "
            "3537666a's message: published_check.FLOAT8_ROWWISE_SPEEDUP), and with tensorwise's memory factor")
# Why ASYNC_FILE's rowwise rows count in no error: the file's note under its results table, and its
# own figures (the rows below and VALIDATION's bf16 rows of the same jobs).
_LOW = ("the file notes that \"the low baseline performance of the vanilla TP float8 rowwise training is being "
        "addressed\"; its rowwise runs, Async TP too, are about as fast as bf16 on the same job or slower (70B 599.6 "
        "against 597.3 tokens/s, 624.8 against 652.4 with Async TP; 8B 3,708.5 against 4,378, 3,914.9 against "
        "4,809.4): they measure that, not the recipe's speed-up")

# H100 (96 GB HBM2e, 500 W: the file's hardware section), 8 per host, 400 Gb/s per GPU between hosts.
_H = "h100-500w"
CALIBRATION = (
    Row(_T1, "llama-3.1-8b", _H, 8, {"dp_shard": 8}, 2, 8192, "titan-op", False, False, 5762, 82.4,
        assumed=(_SEQ, _OP)),
    Row(_T1, "llama-3.1-8b", _H, 8, {"dp_shard": 8}, 2, 8192, "titan-op", True, False, 6667, 77.0,
        assumed=(_SEQ, _OP)),
    Row(_T1, "llama-3.1-8b", _H, 8, {"dp_shard": 8}, 2, 8192, "titan-op", True, True, 8532, 76.8,
        assumed=(_SEQ, _OP)),
    Row(_T2, "llama-3.1-8b", _H, 8, {"dp_shard": 8, "cp": 1}, 1, 32768, "full", True, True, 3890, 83.9),
    Row(_T2, "llama-3.1-8b", _H, 8, {"dp_shard": 4, "cp": 2}, 1, 65536, "full", True, True, 2540, 84.2),
    Row(_T2, "llama-3.1-8b", _H, 8, {"dp_shard": 2, "cp": 4}, 1, 131072, "full", True, True, 1071, 84.0),
    Row(_T2, "llama-3.1-8b", _H, 8, {"dp_shard": 1, "cp": 8}, 1, 262144, "full", True, True, 548, 84.5),
    Row(_T3, "llama-3.1-8b", _H, 128, {"dp_shard": 128}, 2, 8192, "titan-op", False, False, 5605, 67.0,
        assumed=(_SEQ, _OP)),
    Row(_T3, "llama-3.1-8b", _H, 128, {"dp_shard": 128}, 2, 8192, "titan-op", True, False, 6514, 62.0,
        assumed=(_SEQ, _OP)),
    Row(_T3, "llama-3.1-8b", _H, 128, {"dp_shard": 128}, 2, 8192, "titan-op", True, True, 8380, 61.8,
        assumed=(_SEQ, _OP)),
    Row(_T4, "llama-3.1-70b", _H, 256, {"dp_shard": 32, "tp": 8}, 16, 8192, "full", True, True, 829, 71.9,
        assumed=(_SEQ,)),
    Row(_T4, "llama-3.1-70b", _H, 256, {"dp_shard": 32, "tp": 8}, 16, 8192, "full", True, True, 876, 67.6,
        assumed=(_SEQ,), async_tp=True),
    # Tables 5 and 6 ran with AsyncTP (their captions: "+ torch.compile + Float8 + AsyncTP")
    Row(_T5, "llama-3.1-405b", _H, 512, {"dp_shard": 8, "tp": 8, "pp": 8}, 32, 8192, "full", True, True, 100,
        82.5, assumed=(_SEQ, _MICRO), async_tp=True),
    Row(_T5, "llama-3.1-405b", _H, 512, {"dp_shard": 8, "tp": 8, "pp": 8}, 32, 8192, "full", True, True, 128,
        72.7, schedule="interleaved_1f1b", assumed=(_SEQ, _MICRO), async_tp=True),
    Row(_T6, "llama-3.1-405b", _H, 512, {"dp_shard": 8, "tp": 8, "pp": 8, "cp": 1}, 8, 32768, "full", True, True,
        76, 75.3, assumed=(_MICRO,), async_tp=True),
    Row(_T6, "llama-3.1-405b", _H, 512, {"dp_shard": 4, "tp": 8, "pp": 8, "cp": 2}, 8, 65536, "full", True, True,
        47, 75.9, assumed=(_MICRO,), async_tp=True),
    Row(_T6, "llama-3.1-405b", _H, 512, {"dp_shard": 2, "tp": 8, "pp": 8, "cp": 4}, 8, 131072, "full", True,
        True, 31, 77.1, assumed=(_MICRO,), async_tp=True),
    Row(_T6, "llama-3.1-405b", _H, 512, {"dp_shard": 1, "tp": 8, "pp": 8, "cp": 8}, 8, 262144, "full", True,
        True, 16, 84.9, assumed=(_MICRO,), async_tp=True),
)

# A100 80GB, 64 GPUs (8 hosts of 8), FSDP2 only (dp_shard 64), bf16, no compile or Float8 named.
VALIDATION = (
    Row(_A, "llama-3.1-8b", "a100-80gb", 64, {"dp_shard": 64}, 1, 8192, "titan-op", False, False, 2904,
        assumed=(_SEQ, _LAYER)),
    Row(_A, "llama-3.1-8b", "a100-80gb", 64, {"dp_shard": 64}, 1, 8192, "titan-op", False, False, 2973,
        assumed=(_SEQ,)),
    Row(_A, "llama-3.1-70b", "a100-80gb", 64, {"dp_shard": 64}, 1, 8192, "full", False, False, 331, assumed=(_SEQ,)),
    Row(_A2, "llama-2-13b", "a100-80gb", 64, {"dp_shard": 64}, 2, 4096, "none", False, False, 2162, assumed=(_SEQ2,)),
    Row(_A2, "llama-2-13b", "a100-80gb", 64, {"dp_shard": 64}, 2, 4096, "titan-op", False, False, 1914,
        assumed=(_SEQ2, _LAYER)),
    Row(_A2, "llama-2-13b", "a100-80gb", 64, {"dp_shard": 64}, 2, 4096, "titan-op", False, False, 1904,
        assumed=(_SEQ2,)),
    Row(_A2, "llama-2-70b", "a100-80gb", 64, {"dp_shard": 64}, 1, 4096, "titan-op", False, False, 355,
        assumed=(_SEQ2,)),
    Row(_A2, "llama-2-70b", "a100-80gb", 64, {"dp_shard": 64}, 2, 4096, "full", False, False, 353, assumed=(_SEQ2,)),
    # H200 141GB, 8 per host, 400 Gb/s per GPU between hosts; torch 2.8 (nightly of May 2025), torchtitan
    # of June 2025: the TPS/GPU and memory at the 100th step, on 4 and 8 hosts. The loss is compiled
    # with the model: H200_LOSS
    Row(_H200, "llama-3.1-8b", "h200", 32, {"dp_shard": 32}, 2, 8192, "titan-op", True, True, 10938, 47.96,
        assumed=(_TOML, _FP8_FSDP), compiled_loss=True),
    Row(_H200, "llama-3.1-8b", "h200", 64, {"dp_shard": 64}, 2, 8192, "titan-op", True, True, 10753, 46.97,
        assumed=(_TOML, _FP8_FSDP), compiled_loss=True),
    # The PyTorch team's AsyncTP runs (ASYNC_FILE: June 2025, torch 38410cf9, torchtitan 820504e) on the
    # same Grand Teton H100s as CALIBRATION (96 GB, 500 W: the file's hardware section), tokens/s per GPU
    # without and with AsyncTP, bf16 and Float8 tensorwise; no memory published. Float8 rowwise: EXCLUDED
    Row(_A70, "llama-3.1-70b", _H, 256, {"dp_shard": 32, "tp": 8}, 16, 8192, "full", True, False, 597.3,
        assumed=(_SEQ820, _LOSS820), compiled_loss=True),
    Row(_A70, "llama-3.1-70b", _H, 256, {"dp_shard": 32, "tp": 8}, 16, 8192, "full", True, False, 652.4,
        assumed=(_SEQ820, _LOSS820), compiled_loss=True, async_tp=True),
    Row(_A70, "llama-3.1-70b", _H, 256, {"dp_shard": 32, "tp": 8}, 16, 8192, "full", True, True, 809.8,
        assumed=(_SEQ820, _LOSS820, _FP8_TP), compiled_loss=True),
    Row(_A70, "llama-3.1-70b", _H, 256, {"dp_shard": 32, "tp": 8}, 16, 8192, "full", True, True, 942.4,
        assumed=(_SEQ820, _LOSS820, _FP8_TP), compiled_loss=True, async_tp=True),
    Row(_A8, "llama-3.1-8b", _H, 64, {"dp_shard": 8, "tp": 8}, 12, 8192, "titan-op", True, False, 4378,
        assumed=(_SEQ820, _SAC, _LOSS820), compiled_loss=True),
    Row(_A8, "llama-3.1-8b", _H, 64, {"dp_shard": 8, "tp": 8}, 12, 8192, "titan-op", True, False, 4809.4,
        assumed=(_SEQ820, _SAC, _LOSS820), compiled_loss=True, async_tp=True),
    Row(_A8, "llama-3.1-8b", _H, 64, {"dp_shard": 8, "tp": 8}, 12, 8192, "titan-op", True, True, 5078.1,
        assumed=(_SEQ820, _SAC, _LOSS820, _FP8_TP), compiled_loss=True),
    Row(_A8, "llama-3.1-8b", _H, 64, {"dp_shard": 8, "tp": 8}, 12, 8192, "titan-op", True, True, 5570.1,
        assumed=(_SEQ820, _SAC, _LOSS820, _FP8_TP), compiled_loss=True, async_tp=True),
)

# Published rows planned and shown with their errors but counted in no error, each with its reason:
# ASYNC_FILE's Float8 rowwise runs (the same jobs as its rows above), their per-row reason _LOW.
EXCLUDED = (
    Row(_A70, "llama-3.1-70b", _H, 256, {"dp_shard": 32, "tp": 8}, 16, 8192, "full", True, True, 599.6,
        assumed=(_SEQ820, _LOSS820, _ROWWISE), compiled_loss=True, float8_recipe="rowwise", excluded=_LOW),
    Row(_A70, "llama-3.1-70b", _H, 256, {"dp_shard": 32, "tp": 8}, 16, 8192, "full", True, True, 624.8,
        assumed=(_SEQ820, _LOSS820, _ROWWISE), compiled_loss=True, async_tp=True, float8_recipe="rowwise",
        excluded=_LOW),
    Row(_A8, "llama-3.1-8b", _H, 64, {"dp_shard": 8, "tp": 8}, 12, 8192, "titan-op", True, True, 3708.5,
        assumed=(_SEQ820, _SAC, _LOSS820, _ROWWISE), compiled_loss=True, float8_recipe="rowwise", excluded=_LOW),
    Row(_A8, "llama-3.1-8b", _H, 64, {"dp_shard": 8, "tp": 8}, 12, 8192, "titan-op", True, True, 3914.9,
        assumed=(_SEQ820, _SAC, _LOSS820, _ROWWISE), compiled_loss=True, async_tp=True, float8_recipe="rowwise",
        excluded=_LOW),
)
