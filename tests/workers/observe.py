"""Worker: run a chapter script as torchrun would, and write down what its model was really fed.

    torchrun --nproc_per_node=4 tests/workers/observe.py CLASS[,CLASS...] OUT_DIR SCRIPT [--outputs] \\
        [--inputs] [--param NAME] [--mutate OLD NEW] -- [script arguments]

Before the script runs, a global forward hook (``torch.nn.modules.module.
register_module_forward_hook``, a public torch API) is installed. Every forward call of a module
whose class is named CLASS (one of them) appends one JSON line to ``OUT_DIR/rank<R>.jsonl``:
``{"class": its class, "training": bool, "grad": whether autograd recorded it, "rows": [sha1 of each
sample's bytes, ...], "more": [the same for each further tensor argument]}``. Small models only:
``--outputs`` adds the module's output as nested lists (``"outputs"``), ``--inputs`` its first
argument (``"inputs"``), ``--param NAME`` the values of its parameter NAME at that call, before
the optimizer's step (``"param"``, for example a router's weight). The test maps the digests back to
dataset indices (or token rows) on its own, so it checks what reached the model, not what the script
says it fed it. Nothing else changes: the script's own ``main`` runs, with every flag, record and
checkpoint as usual.

``--mutate OLD NEW`` runs a deliberately broken variant instead (``OLD`` must occur exactly once in
the script, see mutation.py), for negative controls.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import torch


def digest_rows(batch: torch.Tensor) -> list[str]:
    """sha1 of each sample (first dimension) of ``batch``, from its raw bytes on the CPU: what this
    worker records, and what the tests compute for the samples they expect (tests/observed.py)."""
    rows = batch.detach().to("cpu").contiguous()
    return [hashlib.sha1(row.numpy().tobytes()).hexdigest() for row in rows]


def values(tensor: torch.Tensor) -> list:
    """A tensor's values as nested lists (float64 holds every float32 and bfloat16 exactly)."""
    return tensor.detach().to("cpu", torch.float64).tolist()


def install(class_names: set[str], out_dir: Path, outputs: bool, inputs: bool = False,
            param: str | None = None) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"rank{os.environ.get('RANK', '0')}.jsonl"

    def hook(module, args, output):
        if type(module).__name__ in class_names and args and isinstance(args[0], torch.Tensor):
            line = {"class": type(module).__name__, "training": module.training, "grad": torch.is_grad_enabled(),
                    "rows": digest_rows(args[0]),
                    # the other tensor arguments (positions, masks), row by row the same way
                    "more": [digest_rows(a) for a in args[1:] if isinstance(a, torch.Tensor)]}
            if outputs:
                line["outputs"] = values(output)
            if inputs:
                line["inputs"] = values(args[0])
            if param is not None and param in dict(module.named_parameters()):
                line["param"] = values(module.get_parameter(param))
            with open(path, "a") as f:
                f.write(json.dumps(line) + "\n")

    torch.nn.modules.module.register_module_forward_hook(hook)


USAGE = ("error: usage: observe.py CLASS[,CLASS...] OUT_DIR SCRIPT [--outputs] [--inputs] [--param NAME] "
         "[--mutate OLD NEW] -- [script arguments]")


def main(argv: list[str]) -> None:
    if "--" not in argv or len(argv[:argv.index("--")]) < 3:
        sys.exit(USAGE)
    head, rest = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    (class_names, out_dir, script), options = head[:3], head[3:]
    flags, mutation, param = set(), None, None
    while options:
        if options[0] in ("--outputs", "--inputs"):
            flags.add(options.pop(0))
        elif options[0] == "--param" and len(options) >= 2:
            param = options[1]
            del options[:2]
        elif options[0] == "--mutate" and len(options) >= 3:
            mutation = options[1:3]
            del options[:3]
        else:
            sys.exit(USAGE)
    from mutation import mutated_source  # tests/workers/mutation.py, beside this worker (the tests import
    # digest_rows from here as workers.observe, where that import would not resolve)

    path = Path(script).resolve()
    source = mutated_source(path, *mutation) if mutation else path.read_text()
    install(set(class_names.split(",")), Path(out_dir), "--outputs" in flags, "--inputs" in flags, param)
    sys.argv = [str(path), *rest]
    exec(compile(source, str(path), "exec"), {"__name__": "__main__", "__file__": str(path)})


if __name__ == "__main__":
    main(sys.argv[1:])
