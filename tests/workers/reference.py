"""The single-process reference every equivalence worker compares a distributed run with."""
from __future__ import annotations

import torch

from distkit.models import TokenTask, lm_loss


def train_one_process(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int,
                      batch: int) -> tuple[dict, dict]:
    """Train ``model`` in this one process on the whole global batch of the synthetic token task
    (``TokenTask`` seed 0: the batches the distributed ranks slice) for ``steps`` steps.

    Returns the (initial, final) state dicts, cloned.
    """
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    task = TokenTask(model.cfg, seed=0)
    for step in range(steps):
        inputs, targets = task.global_batch(step, batch)
        optimizer.zero_grad()
        lm_loss(model(inputs), targets).backward()
        optimizer.step()
    return initial, {k: v.clone() for k, v in model.state_dict().items()}
