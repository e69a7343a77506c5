"""Chapter 02, fsdp_hf_checkpoint.py: a Hugging Face folder in, FSDP2 training, DCP and a Hugging Face
folder out, checked against Hugging Face's own loader and single-process training.

The README's command, as the reader's play ran it (tests/spine.py: 4 ranks, the tiny Llama with vocab
65, so dim 0 of the embedding and the LM head is padded, 4 AdamW steps), created its random-weights
folder with ``--create-hf-in``, trained from it and wrote the README's outputs; the variants below
run the same command on a folder this test writes (``save_pretrained`` of a random tiny Llama):

(a) ``--steps 0`` exports the loaded weights unchanged: every tensor of the exported folder equals the
    input's bit for bit, and ``transformers.LlamaForCausalLM.from_pretrained`` loads it in this process.
(b) After 4 AdamW steps (the played run) the exported weights equal single-process training of the same Hugging Face
    model on the same global batches within FP32_ATOL (2e-4, ch02_common.py; what is left is summation
    order through Adam: measured below). The bugs it must catch, shown by the negative controls (the
    script's own source with one piece replaced, tests/workers/mutation.py through ch05_mutant.py):
    rank 0 loads the folder but does not broadcast it (ranks != 0 keep the uninitialised memory
    ``to_empty`` gave them), and the RoPE ``inv_freq`` buffers left uninitialised after ``to_empty``.
(c) The sharded DCP checkpoint holds exactly the exported weights (read back in this process).
(d) The exported folder's logits (``from_pretrained`` here) equal the trained FSDP model's logits on
    the first global batch (``--dump-logits``) within LOGITS_ATOL = 1e-5: the same weights in another
    process, only the batch split and summation order differ. Bug it must catch: a trained model whose
    RoPE differs from what the exported config tells ``from_pretrained`` to build (the inv_freq mutant).
(e) The DCP checkpoint resumes: fsdp_checkpoint.py --resume loads it into 2 ranks bit for bit and two
    more steps equal six single-process steps (FP32_ATOL).
Plus: the folder ``--create-hf-in`` wrote loads with ``from_pretrained``; the README's Python
snippet runs as written from the clone's root; a tied model keeps its tie; bad inputs (a missing
folder, a config that disagrees with the flags, a folder without safetensors, --arch gpt) are one
``error:`` line.

Measured on 2-core CPU, gloo (tiny Llama, vocab 65, AdamW lr 3e-3, 4 steps, global batch 8; training
moves the weights by up to 1.2e-2): max |FSDP - single process| 1.2e-5 on 4 ranks, 1.1e-6 on 2, so
FP32_ATOL (2e-4) is 16x above the correct run; the mutants land at 1.06 (ranks != 0 from random init)
and 2.4e-2 (inv_freq zeros), 5,000x and 100x above it. Logits: 0 for the correct run (the same
weights and the same kernels: FSDP's forward on a slice of the batch gave bit-identical logits), 1.6e-2
for the inv_freq mutant, 1,500x LOGITS_ATOL. (c) and (a) are exact equalities: no tolerance.

All launches of this file run in one module fixture, two at a time.
"""
from __future__ import annotations

import json
import math
import shutil
from types import SimpleNamespace

import pytest
import torch

from ch02_common import (
    CHAPTER,
    FP32_ATOL,
    HF_CHECKPOINT,
    HF_STEPS,
    LR,
    README,
    check_ok,
    dcp_weights,
    readme_argv,
    run_all,
)
from distkit import UsageError
from distkit.models import build_model, import_transformers, model_config
from launch import WORKERS, assert_one_line_error, command_argv, load_script, parse_args_result
from spine import play_chapter
from workers.reference import train_one_process

SCRIPT = CHAPTER / "fsdp_hf_checkpoint.py"
CFG = model_config("llama", "tiny", vocab_size=65)
TIED_CFG = model_config("llama", "tiny", vocab_size=65, tie_embeddings=True)  # as Llama-3.2-1B
FLAGS = ("--model-size", "tiny", "--vocab-size", "65", "--global-batch-size", "8")
STEPS = HF_STEPS  # the played run's (ch02_common.PLAY); the variants below take the same
LOGITS_ATOL = 1e-5
WIDE = 20  # a negative control must miss the tolerance by at least this factor
# The negative controls: (piece of fsdp_hf_checkpoint.py, its broken replacement).
BROADCAST = ("set_model_state_dict(model, state, "
             "options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))")
MUTANTS = {
    # rank 0's weights are broadcast, then every other rank overwrites its shards with a random init:
    # what a job gets when ranks != 0 skip the load (each initialised the model itself)
    "no_broadcast": (BROADCAST, BROADCAST + "\n    with torch.no_grad():\n        [p.to_local().normal_(std=0.02) "
                                "for p in model.parameters() if not ctx.is_main]"),
    # inv_freq not recomputed, and the memory to_empty gave it happens to be zeros: the kindest
    # garbage (no rotation at all; garbage with a NaN in it fails by infinity)
    "no_rope_reinit": ("    reinit_rope_buffers(model)\n", "    model.model.rotary_emb.inv_freq.zero_()\n"),
}


def write_hf_folder(folder, seed=1, cfg=CFG):
    """A random tiny Llama saved as a Hugging Face folder (what a download would give)."""
    transformers = import_transformers()
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(cfg.hf_config()).save_pretrained(folder)


def read_folder(folder) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def from_pretrained(folder):
    return import_transformers().LlamaForCausalLM.from_pretrained(str(folder)).eval()


def reference(folder, steps: int, cfg=CFG) -> dict:
    """Single-process AdamW training of the folder's model on the whole global batch of each step (a
    tied model's file holds the shared matrix once, as the embedding: strict=False lets the LM head,
    the same Parameter, go unnamed)."""
    model = build_model(cfg)
    missing, unexpected = model.load_state_dict(read_folder(folder), strict=not cfg.tie_embeddings)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return train_one_process(model, torch.optim.AdamW(model.parameters(), lr=LR), steps, 8)[1]


def max_diff(a: dict, b: dict) -> float:
    """max |a - b| over every tensor; NaN anywhere (a model trained from garbage) counts as infinite."""
    assert set(a) == set(b), set(a) ^ set(b)
    worst = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    return math.inf if math.isnan(worst) else worst


def logits_diff(folder, dumped) -> float:
    with torch.no_grad():
        logits = from_pretrained(folder)(input_ids=dumped["inputs"]).logits
    worst = (logits - dumped["logits"]).abs().max().item()
    return math.inf if math.isnan(worst) else worst


@pytest.fixture(scope="module")
def created(reader):
    """The README's command as the play ran it in the clone (ch02_common.PLAY): it created the random
    tiny Llama folder checkpoints/hf/llama-small, trained from it on 4 ranks for STEPS steps and wrote
    the README's outputs: checkpoints/fsdp_hf/dcp and checkpoints/fsdp_hf/hf."""
    run = play_chapter("02-fsdp", reader).ok(HF_CHECKPOINT)
    clone = reader.clone
    return SimpleNamespace(stdout=run["stdout"], clone=clone, hf_in=clone / "checkpoints" / "hf" / "llama-small",
                           hf=clone / "checkpoints" / "fsdp_hf" / "hf", dcp=clone / "checkpoints" / "fsdp_hf" / "dcp",
                           logits=run["out"] / "logits.pt")


@pytest.fixture(scope="module")
def jobs(tmp_path_factory, created):
    tmp = tmp_path_factory.mktemp("ch02_hf")
    write_hf_folder(tmp / "hf_in")
    write_hf_folder(tmp / "hf_tied", cfg=TIED_CFG)

    def job(name, *extra, hf_in=tmp / "hf_in", nproc=4, steps=STEPS, mutant=None):
        out = tmp / name
        argv = readme_argv(HF_CHECKPOINT, *FLAGS, "--steps", steps, "--hf-in", hf_in, "--hf-out", out / "hf",
                           "--checkpoint-dir", out / "ckpt", "--results", out / "records.jsonl",
                           "--dump-logits", out / "logits.pt", "--log-every", 1, *extra, nproc=nproc)
        argv.remove("--create-hf-in")  # these read the folders written above
        if mutant:  # the launcher's script argument becomes the mutant worker, the script its argument
            at = argv.index(str(SCRIPT)) if str(SCRIPT) in argv else argv.index("02-fsdp/fsdp_hf_checkpoint.py")
            argv[at:at + 1] = [str(WORKERS / "ch05_mutant.py"), str(SCRIPT), *MUTANTS[mutant], "--"]
        return argv

    results = run_all({
        "zero4": job("zero4", steps=0),
        "no_broadcast": job("no_broadcast", mutant="no_broadcast"),
        "no_rope_reinit": job("no_rope_reinit", mutant="no_rope_reinit"),
        "mismatch": job("mismatch", "--n-layer", 3, nproc=2),
        "tied2": job("tied2", "--tie-embeddings", "on", hf_in=tmp / "hf_tied", nproc=2),
        # the next run of the played job: chapter 02's resume script continues from its DCP checkpoint, on 2 ranks
        "resume2": [*command_argv("torchrun --nproc_per_node=2 02-fsdp/fsdp_checkpoint.py"), "--arch", "llama", *FLAGS,
                    "--steps", STEPS + 2, "--resume", created.dcp, "--checkpoint-dir", tmp / "resume2",
                    "--checkpoint-format", "full", "--dump-loaded", tmp / "resume2" / "loaded.pt"],
    }, tmp, parallel=2, timeout=600)
    return tmp, results


def test_steps_0_exports_the_input_bit_for_bit(jobs):
    """(a) on 4 ranks: the loaded, resharded, gathered and re-saved weights are the input's."""
    tmp, results = jobs
    out = check_ok(results["zero4"])
    assert "on rank 0 only" in out and "Hugging Face folder" in out, out[-3000:]
    given, exported = read_folder(tmp / "hf_in"), read_folder(tmp / "zero4" / "hf")
    assert set(given) == set(exported)
    for name in given:
        assert torch.equal(given[name], exported[name]), name
    loaded = from_pretrained(tmp / "zero4" / "hf").state_dict()
    for name in given:
        assert torch.equal(loaded[name], given[name]), name


def test_created_folder_loads_and_training_equals_single_process(created):
    """The README's command (4 ranks, as the play ran it): --create-hf-in wrote a folder
    from_pretrained loads, leaving no temporary; (b) exported = single-process training from that
    folder (FP32_ATOL); (c) DCP = export exactly; (d) the export's logits under from_pretrained = the
    trained FSDP model's (LOGITS_ATOL)."""
    assert "created a random-weights Hugging Face folder" in created.stdout, created.stdout[-3000:]
    given = read_folder(created.hf_in)
    loaded = from_pretrained(created.hf_in).state_dict()
    assert all(torch.equal(loaded[k], given[k]) for k in given)
    assert [p.name for p in created.hf_in.parent.iterdir()] == ["llama-small"]  # no temporary left

    exported = read_folder(created.hf)
    expected = reference(created.hf_in, STEPS)
    moved, diff = max_diff(expected, given), max_diff(exported, expected)
    print(f"played: max |FSDP - single process| {diff:.2e} (training moved weights {moved:.2e})")
    assert moved > WIDE * FP32_ATOL  # the comparison would mean nothing if training barely moved them
    assert diff <= FP32_ATOL, diff

    saved = dcp_weights(created.dcp, exported)
    for name in exported:
        assert torch.equal(saved[name], exported[name]), name
    trainer_state = json.loads((created.dcp / "trainer_state.json").read_text())
    assert trainer_state == {"step": STEPS, "world_size": 4, "model": CFG.to_dict()}

    logits = logits_diff(created.hf, torch.load(created.logits))
    print(f"played: max |from_pretrained logits - FSDP logits| {logits:.2e}")
    assert logits <= LOGITS_ATOL, logits


def test_dcp_checkpoint_resumes_training_on_2_ranks(jobs, created):
    """The DCP checkpoint is a real training checkpoint: fsdp_checkpoint.py --resume loads it into 2
    ranks exactly (the exported weights, bit for bit) and 2 more steps equal 6 uninterrupted
    single-process steps within FP32_ATOL, so the Adam state came back too (a resume without it
    lands at 1.4e-2: test_ch02_negative.py's resume control, the same load_dcp)."""
    tmp, results = jobs
    out = check_ok(results["resume2"])
    assert "resumed from dcp checkpoint" in out and "(saved by 4 ranks) into 2 ranks" in out, out[-3000:]
    exported, loaded = read_folder(created.hf), torch.load(tmp / "resume2" / "loaded.pt")
    assert set(loaded) == set(exported)
    assert all(torch.equal(loaded[k], exported[k]) for k in exported)
    continued = torch.load(tmp / "resume2" / "full.pt")["model"]
    diff = max_diff(continued, reference(created.hf_in, STEPS + 2))
    print(f"resume2: max |4 steps on 4 ranks + 2 on 2 - 6 single-process steps| {diff:.2e}")
    assert diff <= FP32_ATOL, diff


def test_tied_model_round_trip_keeps_the_tie(jobs):
    """A tied Llama (--tie-embeddings on; its folder stores the shared matrix once) through the whole
    job on 2 ranks: the tie survives the load, FSDP2 (the embedding and the LM head are one parameter
    in the root unit) and the export: config.json says tie_word_embeddings, from_pretrained's LM head
    IS its embedding (one storage) and holds exactly the exported weights; training equals one process
    training the tied model (FP32_ATOL; an untied run misses it by 2.4e-2, test_llama_equivalence.py);
    the export's logits are the FSDP model's (LOGITS_ATOL: an export that lost the trained LM head
    would give other logits). The export stores the matrix once, as save_pretrained does for a tied
    model: the gathered state dict holds two copies of it, and before the script put one tensor
    under both names they untied the model it saves and the folder held the matrix twice (this test
    failed at that assertion)."""
    tmp, results = jobs
    check_ok(results["tied2"])
    out = tmp / "tied2" / "hf"
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    exported = read_folder(out)
    model = from_pretrained(out)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    loaded = model.state_dict()
    for name in exported:
        assert torch.equal(loaded[name], exported[name]), name
    assert torch.equal(loaded["lm_head.weight"], exported["model.embed_tokens.weight"])
    expected = reference(tmp / "hf_tied", STEPS, cfg=TIED_CFG)
    assert torch.equal(expected["lm_head.weight"], expected["model.embed_tokens.weight"])
    assert "lm_head.weight" not in exported  # save_pretrained writes a tied matrix once
    weights = {**exported, "lm_head.weight": exported["model.embed_tokens.weight"]}
    diff = max_diff(weights, expected)
    print(f"tied2: max |FSDP - single process| {diff:.2e}")
    assert diff <= FP32_ATOL, diff
    logits = logits_diff(out, torch.load(tmp / "tied2" / "logits.pt"))
    assert logits <= LOGITS_ATOL, logits


def test_negative_controls_fail_the_tolerances(jobs):
    """A broadcast skipped, or inv_freq left uninitialised: (b) and (d) must fail, far outside."""
    tmp, results = jobs
    expected = reference(tmp / "hf_in", STEPS)
    for name in MUTANTS:
        check_ok(results[name])
        diff = max_diff(read_folder(tmp / name / "hf"), expected)
        logits = logits_diff(tmp / name / "hf", torch.load(tmp / name / "logits.pt"))
        print(f"{name}: max |weights - single process| {diff:.2e}, |logits| {logits:.2e}")
        assert diff > WIDE * FP32_ATOL, (name, diff)
        if name == "no_rope_reinit":  # (d): from_pretrained builds the right RoPE, the job did not
            assert logits > WIDE * LOGITS_ATOL, (name, logits)


def test_bad_input_is_one_error_line(jobs, tmp_path):
    """A folder of another model: one line on every rank of a 2-rank job (rank 0 finds it, the others
    are told: nobody waits in a broadcast). The other bad folders take the same path; their messages
    are checked on rank 0's reader in this process."""
    tmp, results = jobs
    assert_one_line_error(results["mismatch"], "another model than the flags say: num_hidden_layers 2 there, 3 here")
    script = load_script(SCRIPT)
    assert_one_line_error(parse_args_result(script, "--hf-in", "x", "--arch", "gpt"), "--arch llama only")
    expected = {k: tuple(v.shape) for k, v in read_folder(tmp / "hf_in").items()}
    (tmp_path / "no_weights").mkdir()
    shutil.copy(tmp / "hf_in" / "config.json", tmp_path / "no_weights" / "config.json")
    (tmp_path / "damaged").mkdir()
    shutil.copy(tmp / "hf_in" / "config.json", tmp_path / "damaged" / "config.json")
    (tmp_path / "damaged" / "model.safetensors").write_bytes(b"\x00" * 100)
    for folder, message in ((tmp_path / "nowhere", "no such folder"),
                            (SCRIPT.parent, "no readable config.json"),
                            (tmp_path / "no_weights", "not a folder of safetensors weights"),
                            (tmp_path / "damaged", "not a folder of safetensors weights")):
        with pytest.raises(UsageError, match=message):
            script.read_hf_folder(str(folder), CFG, expected)
    assert script.read_hf_folder(str(tmp / "hf_in"), CFG, expected).keys() == expected.keys()
    with pytest.raises(UsageError, match=r"tie_word_embeddings False there, True here \(--tie-embeddings\)"):
        script.read_hf_folder(str(tmp / "hf_in"), TIED_CFG, expected)


def test_readme_from_pretrained_snippet_runs_as_written(created, tmp_path):
    """The README's Python snippet, as written, from the clone's root after the README's command
    wrote checkpoints/fsdp_hf/hf there (the reader's order). Negative control: on a CPU-only torch
    (this suite's), the plain ``from transformers import LlamaForCausalLM`` fails the way the README
    says."""
    import re
    import subprocess
    import sys

    from launch import job_env

    snippet = next(block for block in re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
                   if "from_pretrained" in block)
    done = subprocess.run([sys.executable, "-c", snippet], cwd=created.clone, env=job_env(tmp_path),
                          capture_output=True, text=True, timeout=300)
    params = sum(t.numel() for t in read_folder(created.hf).values())
    assert done.returncode == 0 and f"LlamaForCausalLM {params} parameters" in done.stdout, done.stderr[-3000:]
    if torch.version.cuda is None:
        plain = "from transformers import LlamaForCausalLM\nLlamaForCausalLM.from_pretrained('checkpoints/fsdp_hf/hf')"
        done = subprocess.run([sys.executable, "-c", plain], cwd=created.clone, env=job_env(tmp_path),
                              capture_output=True, text=True, timeout=300)
        assert done.returncode != 0 and "torchvision::nms" in done.stderr, done.stderr[-3000:]
