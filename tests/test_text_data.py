"""The real-text data path (``--data text``, distkit/text.py), pinned from the corpus itself.

* ``test_every_pass_visits_each_training_window_once``: the rows of the global batches of one pass
  are the training split's non-overlapping windows of seq_len + 1 bytes of Python's reference
  topics, each exactly once, the next pass in another order; the held-out windows come from the
  last 10% only. Recomputed from ``pydoc_data.topics`` here. Negative controls: an order drawn with
  replacement (windows repeated, others never seen) and one pass repeated.
* ``test_a_script_trains_on_the_text_rank_by_rank``: chapter 02's README command,
  fsdp_transformer.py ``--data text`` on 2 ranks (at 20 steps), feeds rank r the rows r*B/W... of
  each text batch (observed, tests/workers/observe.py). Mutant: the script ignoring the flag (the
  synthetic task built instead).
* ``test_the_printed_sample_is_the_checkpoints_greedy_continuation``: the sample printed after
  training is what one plain process's greedy decoding of the prompt gives from the saved weights.
  Mutant: the sample decoded by a model built anew (untrained) instead of the trained one.
* ``test_text_with_a_small_vocabulary_is_one_line``: bytes need 256 tokens.

The equivalence tests keep the synthetic task: they compare weights after a few steps, where any
data serves, and its batches need no corpus.
"""
from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

import pytest
import torch

from distkit.checkpoint import safe_load
from distkit.models import build_model, model_config, rank_slice
from distkit.text import TextTask
from launch import REPO, python
from observed import digest_rows, observe_jobs, pinned, seen_calls

CFG = model_config("llama", "tiny", vocab_size=256)
# each check's decisive message: its negative controls must fail with it
NOT_EVERY_WINDOW_ONCE = "a pass is not every window once"
NOT_A_NEW_ORDER = "the next pass is not a new order"
NOT_ITS_TEXT_ROWS = "not its rows of the text batches"
NOT_THE_GREEDY_SAMPLE = "the printed sample is not the checkpoint's greedy continuation"


def corpus() -> bytes:
    from pydoc_data.topics import topics

    return "".join(topics[k] for k in sorted(topics)).encode("utf-8")


def check_passes(task: TextTask, batch: int = 64) -> None:
    data, width = corpus(), CFG.seq_len + 1
    split = int(len(data) * 0.9)
    windows = [data[k * width:(k + 1) * width] for k in range(split // width)]
    steps = -(-len(windows) // batch)
    rows = []
    for step in range(2 * steps):
        inputs, targets = task.global_batch(step, batch)
        assert torch.equal(inputs[:, 1:], targets[:, :-1])
        rows += [bytes(i.tolist()) + bytes([int(t[-1])]) for i, t in zip(inputs, targets)]
    first, second = rows[:len(windows)], rows[len(windows):2 * len(windows)]
    # a multiset: the documentation repeats itself here and there, and equal windows are equal rows
    assert Counter(first) == Counter(windows), NOT_EVERY_WINDOW_ONCE
    assert Counter(second) == Counter(windows) and first != second, NOT_A_NEW_ORDER
    held, _ = task.held_out(8)
    for row in held:
        assert data.find(bytes(row.tolist()), split) >= split


class WithReplacement(TextTask):
    def _order(self, epoch):
        return torch.randint(len(self.train), (len(self.train),), generator=torch.Generator().manual_seed(epoch))


class OnePassRepeated(TextTask):
    def _order(self, epoch):
        return super()._order(0)


def test_every_pass_visits_each_training_window_once():
    check_passes(TextTask(CFG, seed=0))
    for broken, message in ((WithReplacement, NOT_EVERY_WINDOW_ONCE), (OnePassRepeated, NOT_A_NEW_ORDER)):
        with pytest.raises(AssertionError, match=message):
            check_passes(broken(CFG, seed=0))


# ---- through a script ----------------------------------------------------------------------------

SCRIPT = REPO / "02-fsdp" / "fsdp_transformer.py"
W, B, STEPS = 2, 8, 20
RUNS = {
    "text": None,
    "flag_ignored": ("task = make_task(cfg, args)",
                     "task = make_task(cfg, type(args)(data='synthetic', seed=args.seed))"),
    # a model built anew to get an unsharded one: its text is not what training learned
    "untrained_model": ("sample = generate(model,", "sample = generate(build_model(cfg).to(ctx.device),"),
}


def readme_flags() -> list[str]:
    """Chapter 02's --data text command's flags (its rank count is W already), made small below."""
    import shlex

    from ch02_common import TEXT, command

    argv = shlex.split(command(TEXT))
    assert argv[:2] == ["torchrun", f"--nproc_per_node={W}"] and argv[2] == "02-fsdp/fsdp_transformer.py"
    return argv[3:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    # the README's command at a small size (argparse keeps a repeated flag's last value)
    return observe_jobs(tmp_path_factory, SCRIPT, "LlamaLM,FSDPLlamaLM", RUNS,
                        lambda folder: [*readme_flags(), "--global-batch-size", B, "--steps", STEPS,
                                        "--warmup-steps", 1, "--log-every", 10, "--save", folder / "m.pt",
                                        "--results", folder / "r.jsonl"],
                        nproc=W)


def check_text_rows(folder: Path) -> None:
    task = TextTask(CFG, seed=0)
    for rank in range(W):
        calls = [c for c in seen_calls(folder, rank) if c["training"]]
        want = [digest_rows(rank_slice(task.global_batch(s, B)[0], rank, W)) for s in range(STEPS)]
        assert [c["rows"] for c in calls] == want, f"rank {rank}: {NOT_ITS_TEXT_ROWS}"


def printed_sample(out: str) -> str:
    return ast.literal_eval(re.search(r"sample after \d+ steps: (.*)$", out, flags=re.M).group(1))


def greedy_from_checkpoint(path: Path, prompt: str, new_bytes: int) -> str:
    """Greedy decoding written out here: the most likely next byte given the last seq_len bytes."""
    model = build_model(CFG)
    model.load_state_dict(safe_load(path))
    model.eval()
    tokens = list(prompt.encode())
    with torch.no_grad():
        for _ in range(new_bytes):
            logits = model(torch.tensor([tokens[-CFG.seq_len:]]))
            tokens.append(int(logits[0, -1].argmax()))
    return bytes(tokens).decode("utf-8", errors="replace")


def check_sample(folder: Path, out: str) -> None:
    sample = printed_sample(out)
    assert sample.startswith("The ") and len(sample.encode("utf-8", errors="replace")) >= 100
    greedy = greedy_from_checkpoint(folder / "m.pt", "The ", 120)
    assert sample == greedy, f"{NOT_THE_GREEDY_SAMPLE}: printed {sample!r}, greedy {greedy!r}"


def test_a_script_trains_on_the_text_rank_by_rank(runs):
    pinned(runs, check_text_rows, "flag_ignored", correct="text", match=NOT_ITS_TEXT_ROWS)


def test_the_printed_sample_is_the_checkpoints_greedy_continuation(runs):
    pinned(runs, check_sample, "untrained_model", output=True, correct="text", match=NOT_THE_GREEDY_SAMPLE)


def test_text_with_a_small_vocabulary_is_one_line():
    done = python(SCRIPT, "--data", "text", "--vocab-size", "64", check=False)
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    assert (done.returncode != 0
            and lines[-1] == "error: --data text has 256 byte tokens; --vocab-size 64 is too small"), lines


# ---- every transformer script takes --data from the one place ----------------------------------

def task_problems(source: str) -> list[str]:
    """What keeps ``--data`` from reaching a script that has the model flags: a task built without
    ``make_task`` (the flag parsed, then ignored), or no task built through it."""
    if "add_model_args(" not in source:
        return []
    problems = []
    if re.search(r"\bTokenTask\(", source):
        problems.append("builds TokenTask itself")
    if not re.search(r"\bmake_task\(\w+, args", source):
        problems.append("never calls make_task(cfg, args)")
    return problems


def test_every_transformer_script_builds_its_task_from_the_data_flag():
    scripts = sorted(p for folder in ("01-ddp-basics", "02-fsdp", "03-deepspeed", "05-advanced", "benchmarks")
                     for p in (REPO / folder).glob("*.py") if p.name != "notebook.py")
    checked = {p.name: task_problems(p.read_text()) for p in scripts if "add_model_args(" in p.read_text()}
    assert len(checked) >= 15 and not {k: v for k, v in checked.items() if v}, checked
    # negative control: the script as it was before the flag existed
    before = (REPO / "02-fsdp" / "fsdp_basics.py").read_text().replace("make_task(cfg, args)",
                                                                      "TokenTask(cfg, seed=args.seed)")
    assert task_problems(before) == ["builds TokenTask itself", "never calls make_task(cfg, args)"]
