"""ddp_mnist.py's own lesson, pinned: which samples each rank trained and evaluated on, and every
number the script reports, recomputed without the script's code.

What is observed: tests/workers/observe.py runs the unchanged script and records, through a global
forward hook, the sha1 of every image that reached the model on each rank (and the logits it
returned). The test maps those digests back to dataset indices itself.

What each test pins, and a bug that fails it (its negative control, a mutant of the script run with
the same flags on 2 ranks, is in the same file and must fail the same check, with that check's own
message; the unmutated script runs with those flags twice, on the README's 4 ranks and, like for like
with its mutants, on 2, and must pass it both times):

* ``test_each_rank_trains_on_its_own_slice_of_a_fresh_shuffle``: in epoch e every rank trains on
  positions rank, rank+W, ... of the permutation ``randperm(n, seed + e)`` (DistributedSampler's
  contract, written out here), batch by batch, so the ranks' samples are disjoint and each epoch
  reshuffles. Fails: a sampler never told the epoch (``set_epoch`` missing: the same order every
  epoch).
* ``test_each_rank_evaluates_its_own_stride_and_the_test_set_is_counted_once``: rank r scores test
  samples r, r+W, ..., so the ranks together score every test sample exactly once. Fails: every rank
  scoring the whole test set (its accuracy is still right, which is why a threshold cannot see it).
* ``test_logged_train_and_test_numbers_are_the_observed_logits``: each epoch's logged train loss and
  accuracy, and test loss and accuracy, equal what the observed logits and the true labels give over
  all ranks. Fails: per-rank train sums not all-reduced (rank 0's share logged as the job's).
* ``test_final_accuracy_is_what_one_process_computes_from_the_checkpoint`` (on the quick start's
  own run, and on the unmutated run with the mutants' flags): the recorded test accuracy (and the
  logged test loss) equals one plain process's over the whole test set from the saved checkpoint,
  the same count of right answers. Fails: the evaluation's all-reduce removed (rank 0's stride
  reported as the test set).
* ``test_throughput_is_the_recorded_step_times`` (the quick start's run, and the unmutated run with
  the mutants' flags): samples per timed step is what the data gives (every rank's batches, the
  short last one of each epoch included, without the untimed first steps), the step time is the
  slowest rank's median of its recorded step times, and the rate logged and recorded is their
  quotient. Fails: the harness told the per-rank batch.

ddp_training.py (2 ranks, 2 micro-batches per step):

* ``test_training_feeds_each_rank_its_rows_in_micro_batches``: at step s rank r's model sees rows
  r*B/W ... of the token task's global batch s, in k consecutive micro-batches. Fails: every rank
  given rank 0's rows; the first micro-batch used k times.
* ``test_training_loss_history_is_the_observed_logits``: each step's recorded (and the final
  logged) loss is the job's mean token cross-entropy, recomputed from the returned logits. Fails: the
  all-reduced loss not divided by the world size.
* ``test_training_tokens_per_s_and_mfu_are_the_step_times_and_the_formula``: tokens per step is
  B x sequence length; tokens/s is that over the slowest rank's median step; MFU is tokens/s per
  device x 6N + 12 L d s (N counted from the built model) over the recorded peak. Fails: the harness
  told sequences instead of tokens.

Not pinned here: that the ranks' weights stay identical (test_ch01_ddp.py, test_ddp_equivalence.py),
the gradient bytes (test_ddp_mnist.py).
"""
from __future__ import annotations

import functools
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from distkit.checkpoint import safe_load
from distkit.data import MNIST_MEAN, MNIST_STD, import_torchvision
from distkit.harness import read_records
from distkit.models import MnistCNN, model_config
from launch import QUICK_START_FILES, REPO, job, quick_start_record
from observed import (
    MFU_MISMATCH,
    TOKENS_PER_STEP,
    check_mfu,
    check_tokens_per_s,
    digest_rows,
    observe_jobs,
    seen_calls,
    slowest_median,
)

SCRIPT = REPO / "01-ddp-basics" / "ddp_mnist.py"
EPOCHS, STEPS, BATCH, SEED = 2, 3, 16, 0
FLAGS = ["--offline", "--epochs", str(EPOCHS), "--max-steps", str(STEPS), "--batch-size", str(BATCH)]

# name -> mutation or None; each mutant is the script with one realistic DDP bug
MUTATIONS = {
    "correct": None,
    "correct_2ranks": None,  # the mutants' world size: each check holds here too, like for like
    "no_set_epoch": ("sampler.set_epoch(epoch)", "None"),
    "eval_everything": ("range(ctx.rank, len(test_set), ctx.world_size)", "range(len(test_set))"),
    "train_not_reduced": ("dist.all_reduce(totals)  # per-rank sums", "None  #"),
    "eval_not_reduced": ("dist.all_reduce(totals)  # sum of per-rank counts", "None  #"),
    "per_rank_samples": ("samples=len(images) * ctx.world_size", "samples=len(images)"),
}
WORLD = {name: 4 if name == "correct" else 2 for name in MUTATIONS}  # the README's 4; mutants on 2
CORRECT = ("correct", "correct_2ranks")

# each check's decisive message: its negative control must fail with it
NOT_THE_SHUFFLE = "not its slice of that epoch's shuffle"
NOT_THE_STRIDE = "not its stride of the test set"
TRAIN_NOT_LOGITS = "the logged train loss and accuracy are not the observed logits'"
NOT_ONE_PROCESS = "the recorded accuracy is not one process's count from the checkpoint"
SAMPLES_PER_STEP = "the recorded samples per step are not the data's"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return observe_jobs(tmp_path_factory, SCRIPT, "MnistCNN", MUTATIONS, lambda folder: [
        *FLAGS, "--data-dir", folder / "data", "--results", folder / "r.jsonl", "--save", folder / "m.pt",
        "--log-file", folder / "log.txt"], nproc=WORLD, outputs=True)


# ---- independent views of the data and of the run --------------------------------------------------

def mnist(folder: Path):
    """(train, test) as the model sees them: torchvision's MNIST with the chapter's normalisation."""
    torchvision = import_torchvision()
    from torchvision import transforms

    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((MNIST_MEAN,), (MNIST_STD,))])
    return [torchvision.datasets.MNIST(str(folder / "data"), train=split, transform=transform)
            for split in (True, False)]


@functools.lru_cache(maxsize=None)
def mnist_and_index(folder: Path):
    datasets = mnist(folder)
    return datasets, [index_of(d) for d in datasets]


def index_of(dataset) -> dict[str, int]:
    """sha1 of each sample's bytes -> its index (every digit of the sample is distinct)."""
    digests = {digest_rows(dataset[i][0][None])[0]: i for i in range(len(dataset))}
    assert len(digests) == len(dataset), "two identical images: digests cannot name samples"
    return digests


class Seen:
    """What one run's ranks fed their models: per rank, per epoch, the train batches and the eval
    batches as dataset indices, with the logits the model returned."""

    def __init__(self, folder: Path, world: int):
        train_index, test_index = mnist_and_index(folder)[1]
        self.train = [[[] for _ in range(EPOCHS)] for _ in range(world)]
        self.test = [[[] for _ in range(EPOCHS)] for _ in range(world)]
        for rank in range(world):
            epoch, was_training = -1, False
            for call in seen_calls(folder, rank):
                if call["training"] and not was_training:
                    epoch += 1  # training resumes: a new epoch
                was_training = call["training"]
                index = train_index if call["training"] else test_index
                batches = (self.train if call["training"] else self.test)[rank][epoch]
                batches.append(([index[d] for d in call["rows"]], torch.tensor(call["outputs"])))


def expected_order(n: int, world: int, rank: int, epoch: int) -> list[int]:
    """The positions DistributedSampler promises rank ``rank`` in ``epoch``: the seeded permutation
    of all n samples, padded to a multiple of world by wrapping around, every world-th from rank."""
    generator = torch.Generator()
    generator.manual_seed(SEED + epoch)
    order = torch.randperm(n, generator=generator).tolist()
    total = math.ceil(n / world) * world
    order += order[:total - n]
    return order[rank:total:world]


def logged_epochs(output: str) -> list[tuple[float, ...]]:
    """(train loss, train acc %, test loss, test acc %) of every logged epoch."""
    pattern = (r"epoch \d+/\d+ \| train loss ([\d.]+) acc ([\d.]+)% \| test loss ([\d.]+) acc ([\d.]+)%")
    return [tuple(map(float, m)) for m in re.findall(pattern, output)]


def loss_and_accuracy(batches, labels) -> tuple[float, float, int]:
    """Mean cross-entropy and accuracy of observed (indices, logits) batches against true labels."""
    loss, correct, count = 0.0, 0, 0
    for indices, logits in batches:
        target = torch.tensor([labels[i] for i in indices])
        loss += F.cross_entropy(logits, target, reduction="sum").item()
        correct += (logits.argmax(1) == target).sum().item()
        count += len(indices)
    return loss / count, correct / count, count


# ---- the checks (each a function, so its negative control runs the same code) ---------------------

def check_training_slices(seen: Seen, world: int, n: int) -> None:
    for epoch in range(1, EPOCHS + 1):
        taken = []
        for rank in range(world):
            got = [indices for indices, _ in seen.train[rank][epoch - 1]]
            order = expected_order(n, world, rank, epoch)
            assert got == [order[s * BATCH:(s + 1) * BATCH] for s in range(STEPS)], \
                f"rank {rank}, epoch {epoch}: {NOT_THE_SHUFFLE}"
            taken += [i for batch in got for i in batch]
        assert len(set(taken)) == len(taken), f"epoch {epoch}: ranks trained on the same samples"


def check_evaluation_strides(seen: Seen, world: int, n: int) -> None:
    for epoch in range(EPOCHS):
        scored = []
        for rank in range(world):
            got = [i for indices, _ in seen.test[rank][epoch] for i in indices]
            assert got == list(range(rank, n, world)), f"rank {rank}, epoch {epoch + 1}: {NOT_THE_STRIDE}"
            scored += got
        assert sorted(scored) == list(range(n)), f"epoch {epoch + 1}: not every test sample scored once"


def check_logged_numbers(seen: Seen, world: int, output: str, datasets) -> None:
    train_labels, test_labels = ([int(t) for t in d.targets] for d in datasets)
    logged = logged_epochs(output)
    assert len(logged) == EPOCHS
    for epoch, (train_loss, train_acc, test_loss, test_acc) in enumerate(logged):
        loss, acc, count = loss_and_accuracy([b for r in range(world) for b in seen.train[r][epoch]], train_labels)
        assert count == world * STEPS * BATCH
        assert abs(loss - train_loss) <= 6e-5 and abs(100 * acc - train_acc) <= 6e-3, \
            f"epoch {epoch + 1}: {TRAIN_NOT_LOGITS}: logged {train_loss} / {train_acc}%, observed {loss} / {100 * acc}%"
        loss, acc, count = loss_and_accuracy([b for r in range(world) for b in seen.test[r][epoch]], test_labels)
        assert count == len(test_labels)
        assert abs(loss - test_loss) <= 6e-5 and abs(100 * acc - test_acc) <= 6e-3, (epoch, loss, acc)


def check_numbers_from_checkpoint(folder: Path, checkpoint: Path, record: dict, output: str) -> None:
    """One plain process, the saved weights, the whole test set: the same count of right answers as
    recorded, and the last logged test loss. A sample whose two best logits lie within 1e-5 may round
    either way in another batch shape; the counts may differ by at most those."""
    test = mnist(folder)[1]
    model = MnistCNN()
    model.load_state_dict(safe_load(checkpoint)["model"])
    model.eval()
    with torch.no_grad():
        logits = model(torch.stack([test[i][0] for i in range(len(test))]))
    top2 = logits.topk(2, dim=1).values
    ambiguous = int(((top2[:, 0] - top2[:, 1]) < 1e-5).sum())
    correct = int((logits.argmax(1) == test.targets).sum())
    reported = record["test_accuracy"] * len(test)
    assert abs(reported - round(reported)) < 1e-9, "the accuracy is not a count over the test set"
    assert abs(round(reported) - correct) <= ambiguous, \
        f"{NOT_ONE_PROCESS}: recorded {round(reported)} right, one process {correct} of {len(test)}"
    loss = F.cross_entropy(logits.double(), test.targets).item()
    assert abs(loss - logged_epochs(output)[-1][2]) <= 6e-5, loss


def samples_in_timed_steps(record: dict, n_train: int, per_rank_batch: int, epochs: int,
                           max_steps: int | None) -> float:
    """Samples per timed step, from the data alone: each epoch every rank takes ceil(n/W) samples
    (DistributedSampler pads), in batches of per_rank_batch with a short last one; the untimed
    steps (warm-up and instrumented) are the first of epoch 1, all full."""
    world = record["world_size"]
    per_rank = math.ceil(n_train / world)
    batches = [min(per_rank_batch, per_rank - start) for start in range(0, per_rank, per_rank_batch)]
    batches = batches[:max_steps] * epochs
    untimed = len(batches) - record["metrics"]["timed_steps"]
    assert 0 < untimed < len(batches)
    return world * sum(batches[untimed:]) / record["metrics"]["timed_steps"]


def check_throughput(record: dict, output: str, expected_samples_per_step: float) -> None:
    metrics = record["metrics"]
    assert metrics["samples_per_step"] == pytest.approx(expected_samples_per_step, rel=1e-12), \
        f"{SAMPLES_PER_STEP}: recorded {metrics['samples_per_step']}, the data gives {expected_samples_per_step}"
    times = metrics["step_times_s_per_rank"]
    assert len(times) == record["world_size"] and all(len(t) == metrics["timed_steps"] for t in times)
    step_s = slowest_median(metrics)
    assert metrics["step_time_s_median"] == pytest.approx(step_s, rel=1e-12)
    rate = expected_samples_per_step / step_s
    assert metrics["samples_per_s"] == pytest.approx(rate, rel=1e-12)
    logged = float(re.search(r"\| (\d+) samples/s", output).group(1))
    assert abs(logged - rate) <= 0.5 + 1e-9


def observed(runs, name: str):
    folder, done = job(runs, name)
    world = WORLD[name]
    return folder, done, world, mnist_and_index(folder)[0], Seen(folder, world)


# ---- the tests ----------------------------------------------------------------------------------

def test_each_rank_trains_on_its_own_slice_of_a_fresh_shuffle(runs):
    for name in CORRECT:
        _, _, world, datasets, seen = observed(runs, name)
        check_training_slices(seen, world, len(datasets[0]))
        # the lesson in one line: epoch 2 is a different order than epoch 1 on every rank
        assert all(seen.train[r][0][0][0] != seen.train[r][1][0][0] for r in range(world))
    _, _, world, datasets, seen = observed(runs, "no_set_epoch")
    with pytest.raises(AssertionError, match=NOT_THE_SHUFFLE):
        check_training_slices(seen, world, len(datasets[0]))


def test_each_rank_evaluates_its_own_stride_and_the_test_set_is_counted_once(runs):
    for name in CORRECT:
        _, _, world, datasets, seen = observed(runs, name)
        check_evaluation_strides(seen, world, len(datasets[1]))
    folder, done, world, datasets, seen = observed(runs, "eval_everything")
    with pytest.raises(AssertionError, match=NOT_THE_STRIDE):
        check_evaluation_strides(seen, world, len(datasets[1]))
    # the bug that a threshold cannot see: every rank scores everything, and the numbers are right
    check_numbers_from_checkpoint(folder, folder / "m.pt", read_records(folder / "r.jsonl")[0], done.stdout)


def test_logged_train_and_test_numbers_are_the_observed_logits(runs):
    for name in CORRECT:
        _, done, world, datasets, seen = observed(runs, name)
        check_logged_numbers(seen, world, done.stdout, datasets)
    _, done, world, datasets, seen = observed(runs, "train_not_reduced")
    with pytest.raises(AssertionError, match=TRAIN_NOT_LOGITS):
        check_logged_numbers(seen, world, done.stdout, datasets)


def test_final_accuracy_is_what_one_process_computes_from_the_checkpoint(first_command_run, runs):
    folder, done = first_command_run
    record = quick_start_record(folder)
    check_numbers_from_checkpoint(folder, folder / QUICK_START_FILES["model"], record, done.stdout)
    for name in CORRECT:  # the script as it is, with the control's flags
        folder, done = job(runs, name)
        check_numbers_from_checkpoint(folder, folder / "m.pt", read_records(folder / "r.jsonl")[0], done.stdout)
    folder, done = job(runs, "eval_not_reduced")
    with pytest.raises(AssertionError, match=NOT_ONE_PROCESS):
        check_numbers_from_checkpoint(folder, folder / "m.pt", read_records(folder / "r.jsonl")[0], done.stdout)


def test_throughput_is_the_recorded_step_times(first_command_run, runs):
    folder, done = first_command_run
    record = quick_start_record(folder)
    n_train = len(mnist(folder)[0])
    # the script's defaults: --batch-size 64, --epochs 3, whole epochs
    check_throughput(record, done.stdout, samples_in_timed_steps(record, n_train, 64, 3, None))
    for name in CORRECT:  # the script as it is, with the control's flags
        folder, done = job(runs, name)
        (record,) = read_records(folder / "r.jsonl")
        check_throughput(record, done.stdout, samples_in_timed_steps(record, n_train, BATCH, EPOCHS, STEPS))
    folder, done = job(runs, "per_rank_samples")
    (record,) = read_records(folder / "r.jsonl")
    expected = samples_in_timed_steps(record, n_train, BATCH, EPOCHS, STEPS)
    with pytest.raises(AssertionError, match=SAMPLES_PER_STEP):
        check_throughput(record, done.stdout, expected)


# ==== ddp_training.py: the global batch split over ranks, then over micro-batches ====================

TRAINING = REPO / "01-ddp-basics" / "ddp_training.py"
T_STEPS, T_BATCH, T_ACCUM, T_WORLD = 4, 8, 2, 2
T_FLAGS = ["--model-size", "tiny", "--global-batch-size", str(T_BATCH), "--grad-accum-steps", str(T_ACCUM),
           "--steps", str(T_STEPS), "--warmup-steps", "1", "--log-every", "1"]
TRAINING_RUNS = {
    "correct": None,
    "same_slice": ("rank_slice(t, ctx.rank, ctx.world_size)", "rank_slice(t, 0, ctx.world_size)"),
    "first_micro_batch_twice": ("chunks = list(zip(inputs.chunk(k), targets.chunk(k)))",
                                "chunks = [(inputs.chunk(k)[0], targets.chunk(k)[0])] * k"),
    "loss_summed_over_ranks": ("losses.append(step_loss.item() / ctx.world_size)", "losses.append(step_loss.item())"),
    "tokens_per_sequence": ("tokens=args.global_batch_size * gpt.seq_len", "tokens=args.global_batch_size"),
}
NOT_ITS_ROWS = "not its micro-batch of its rows"
LOSS_NOT_MEAN = "the recorded loss is not the job's mean cross-entropy"


@pytest.fixture(scope="module")
def training_runs(tmp_path_factory):
    return observe_jobs(tmp_path_factory, TRAINING, "TinyGPT", TRAINING_RUNS, lambda folder: [
        *T_FLAGS, "--results", folder / "r.jsonl", "--checkpoint-dir", folder / "ck", "--log-dir", folder / "logs"],
        nproc=T_WORLD, outputs=True)


def training_calls(folder: Path) -> list[list[dict]]:
    """Per rank, every forward call of the model: the digests of its rows and its logits."""
    return [seen_calls(folder, rank) for rank in range(T_WORLD)]


def expected_micro_batches():
    """(inputs, targets) of each (step, rank, micro-batch), by the lesson's arithmetic: step s's global
    batch (the token task's sequences s*B ... s*B+B-1), rank r's contiguous B/W rows, then k equal parts."""
    from distkit.models import TokenTask, model_config

    task = TokenTask(model_config("gpt", "tiny"), num_sequences=4096, seed=SEED)  # the script's defaults
    per_rank, micro = T_BATCH // T_WORLD, T_BATCH // T_WORLD // T_ACCUM
    expected = {}
    for step in range(T_STEPS):
        inputs, targets = task.global_batch(step, T_BATCH)
        for rank in range(T_WORLD):
            for i in range(T_ACCUM):
                rows = slice(rank * per_rank + i * micro, rank * per_rank + (i + 1) * micro)
                expected[step, rank, i] = inputs[rows], targets[rows]
    return expected


def check_training_rows(calls) -> None:
    expected = expected_micro_batches()
    for rank in range(T_WORLD):
        assert len(calls[rank]) == T_STEPS * T_ACCUM
        for n, call in enumerate(calls[rank]):
            step, i = divmod(n, T_ACCUM)
            assert call["rows"] == digest_rows(expected[step, rank, i][0]), \
                f"step {step}, rank {rank}, micro-batch {i}: {NOT_ITS_ROWS}"


def check_loss_history(calls, record: dict, output: str) -> None:
    """Each step's logged loss: the mean over ranks of the mean over micro-batches of the token
    cross-entropy, recomputed from the logits the model returned and the task's targets."""
    expected = expected_micro_batches()
    for step in range(T_STEPS):
        total = 0.0
        for rank in range(T_WORLD):
            for i in range(T_ACCUM):
                logits = torch.tensor(calls[rank][step * T_ACCUM + i]["outputs"])
                target = expected[step, rank, i][1]
                total += F.cross_entropy(logits.flatten(0, 1), target.flatten()).item() / T_ACCUM
        assert abs(record["loss_history"][step] - total / T_WORLD) <= 1e-5, \
            f"step {step}: {LOSS_NOT_MEAN}: recorded {record['loss_history'][step]}, recomputed {total / T_WORLD}"
    assert record["final_loss"] == record["loss_history"][-1]
    assert f"done: loss {record['final_loss']:.4f}" in output


def test_training_feeds_each_rank_its_rows_in_micro_batches(training_runs):
    folder, _ = job(training_runs, "correct")
    check_training_rows(training_calls(folder))
    for mutant in ("same_slice", "first_micro_batch_twice"):
        folder, _ = job(training_runs, mutant)
        with pytest.raises(AssertionError, match=NOT_ITS_ROWS):
            check_training_rows(training_calls(folder))


def test_training_loss_history_is_the_observed_logits(training_runs):
    folder, done = job(training_runs, "correct")
    check_loss_history(training_calls(folder), read_records(folder / "r.jsonl")[0], done.stdout)
    folder, done = job(training_runs, "loss_summed_over_ranks")
    with pytest.raises(AssertionError, match=LOSS_NOT_MEAN):
        check_loss_history(training_calls(folder), read_records(folder / "r.jsonl")[0], done.stdout)


def test_training_tokens_per_s_and_mfu_are_the_step_times_and_the_formula(training_runs):
    folder, _ = job(training_runs, "correct")
    (record,) = read_records(folder / "r.jsonl")
    cfg = model_config("gpt", "tiny")
    check_tokens_per_s(record, T_BATCH * cfg.seq_len)
    check_mfu(record, cfg, T_BATCH * cfg.seq_len)
    folder, _ = job(training_runs, "tokens_per_sequence")
    (record,) = read_records(folder / "r.jsonl")
    with pytest.raises(AssertionError, match=TOKENS_PER_STEP):
        check_tokens_per_s(record, T_BATCH * cfg.seq_len)
    with pytest.raises(AssertionError, match=MFU_MISMATCH):
        check_mfu(record, cfg, T_BATCH * cfg.seq_len)
