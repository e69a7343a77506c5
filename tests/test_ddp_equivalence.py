"""DDP on 2 and 4 ranks ends with the same parameters as one process trained on the global batch.

Tolerance: 1e-5 absolute on every parameter after 3 SGD-momentum steps (fp32). DDP averages the
ranks' gradients of their per-rank mean losses; with equal per-rank batches that is exactly the
gradient of the mean loss over the concatenated global batch, so the only difference is the order
of floating-point additions (observed differences ~1e-7). A gradient summed instead of averaged
moves SGD's weights by lr x (world - 1) x grad, orders of magnitude above 1e-5. The negative
control below runs the same comparison with that bug (a DDP comm hook that sums and never divides,
trained by the 2-rank job's worker with ``--summed``) and requires it to fail the tolerance by at
least 100x. The 2- and 4-rank jobs run once, side by side, in a module fixture.
"""
import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F

from distkit.harness import bus_factor
from distkit.models import MnistCNN
from distkit.runtime import seed_everything
from launch import WORKERS, torchrun
from workers.ddp_equivalence import global_batches

STEPS, GLOBAL_BATCH, TOLERANCE = 3, 16, 1e-5


def single_process_reference():
    """One process, the whole global batch, the workers' optimizer (the MNIST CNN's own reference:
    tests/workers/reference.py trains the token-task GPT)."""
    seed_everything(0)  # the workers' seed: same initial weights
    model = MnistCNN(dropout=0.0)
    initial = {name: t.clone() for name, t in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    images, labels = global_batches(STEPS, GLOBAL_BATCH)
    for step in range(STEPS):
        optimizer.zero_grad()
        F.cross_entropy(model(images[step]), labels[step]).backward()
        optimizer.step()
    return initial, model.state_dict()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``{nproc: output folder}`` of the 2-rank (with the summing variant) and the 4-rank job."""
    folders = {nproc: tmp_path_factory.mktemp(f"ddp{nproc}") for nproc in (2, 4)}

    def launch(nproc):
        extra = ["--summed"] if nproc == 2 else []
        torchrun(WORKERS / "ddp_equivalence.py", "--steps", STEPS, "--global-batch", GLOBAL_BATCH,
                 "--out", folders[nproc] / "out", *extra, nproc=nproc, tmp_path=folders[nproc])
        return folders[nproc] / "out"

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(folders, pool.map(launch, folders)))


@pytest.mark.parametrize("nproc", [2, 4])
def test_ddp_matches_single_process_and_comm_counter_is_exact(nproc, runs):
    out = runs[nproc]
    ddp_params = torch.load(out / "params.pt", weights_only=True)
    initial, reference = single_process_reference()
    for name, ref in reference.items():
        assert not torch.equal(ref, initial[name]), f"{name} did not change: the comparison would be empty"
        diff = (ddp_params[name] - ref).abs().max().item()
        assert diff < TOLERANCE, f"{name}: max |DDP - single| = {diff:.2e} >= {TOLERANCE}"

    comm = json.loads((out / "comm.json").read_text())
    f32 = 4
    expected = {"all_reduce": 1000 * f32, "all_gather": 250 * nproc * f32,
                "reduce_scatter": 100 * nproc * f32, "broadcast": 64 * 8}
    assert set(comm) == set(expected)
    for name, payload in expected.items():
        assert comm[name]["calls"] == 1
        assert comm[name]["bytes"] == payload, name
        assert comm[name]["bus_bytes"] == pytest.approx(payload * bus_factor(name, nproc)), name


def test_summed_gradients_fail_the_same_comparison(runs):
    """Negative control: the same data, model, optimizer and tolerance, but DDP sums the 2 ranks'
    gradients instead of averaging them. It must land far outside the tolerance."""
    summed = torch.load(runs[2] / "summed.pt", weights_only=True)
    _, reference = single_process_reference()
    diff = max((summed[name] - ref).abs().max().item() for name, ref in reference.items())
    print(f"summed instead of averaged: max |DDP - single| = {diff:.2e}")
    assert diff > 100 * TOLERANCE, diff
