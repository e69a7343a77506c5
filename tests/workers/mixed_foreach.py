"""Worker: the optimizer ``distkit.flags.make_optimizer`` builds for a model whose parameters mix
DTensors (a tensor-parallel linear) with plain tensors (a norm left out of the plan), as
``05-advanced/tensor_parallel.py``'s models do, against the same AdamW forced onto its foreach kernels
(what torch picks by default on CUDA). Writes ``{"make_optimizer": ..., "forced_foreach": ...}``: "ok"
or the step's error, and the ``foreach`` each choice had, to the JSON file named by its argument.
"""
import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

from distkit.flags import make_optimizer


def step(optimizer, model) -> str:
    model(torch.ones(4, 8)).sum().backward()
    try:
        optimizer.step()
        return "ok"
    except RuntimeError as e:
        return str(e).strip().splitlines()[0]


def main(out: str) -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    parallelize_module(model, mesh, {"0": ColwiseParallel(output_layouts=Replicate())})
    built = make_optimizer("adamw", model.parameters(), 1e-3)
    forced = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    uniform = make_optimizer("adamw", model[1].parameters(), 1e-3)  # plain tensors only
    result = {"make_optimizer": step(built, model), "forced_foreach": step(forced, model),
              "foreach": [built.defaults["foreach"], forced.defaults["foreach"], uniform.defaults["foreach"]]}
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
