"""Worker: run a chapter script with ``torch.compile``'s backend chosen here, exactly as torchrun
would run the script otherwise.

    torchrun --nproc_per_node=1 tests/workers/compiled_with.py BACKEND SCRIPT -- [script arguments]

Every ``torch.compile`` call (``nn.Module.compile`` goes through it) gets ``backend=BACKEND`` unless
the script names one. For tests whose claim holds for any backend (which steps the harness counts
for a compiled model) and must not pay inductor's C++ build: ``aot_eager`` traces the same graphs
(Dynamo, then AOTAutograd's forward and backward) and runs them with eager kernels, in seconds on a
cold machine where inductor's first build takes a minute. Nests under harness_mutant.py (give this
file as its SCRIPT).
"""
from __future__ import annotations

import functools
import runpy
import sys
from pathlib import Path

import torch


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[2] != "--":
        sys.exit("error: usage: compiled_with.py BACKEND SCRIPT -- [script arguments]")
    backend, script, _, *rest = argv
    original = torch.compile

    @functools.wraps(original)
    def compile_with_backend(*args, **kwargs):
        kwargs.setdefault("backend", backend)
        return original(*args, **kwargs)

    torch.compile = compile_with_backend
    sys.argv = [script, *rest]
    sys.path[0] = str(Path(script).resolve().parent)  # as `python SCRIPT` sets it
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
