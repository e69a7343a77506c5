"""Worker: run a chapter script with one piece of its source replaced (a *mutant*), exactly as
torchrun would run the script itself.

    torchrun --nproc_per_node=4 tests/workers/ch05_mutant.py SCRIPT OLD NEW -- [script arguments]

``OLD`` must occur exactly once in SCRIPT (otherwise the mutant would silently be the original
program and the negative control would prove nothing): the worker stops with one ``error:`` line.
The mutated source is compiled under the script's own file name and run as ``__main__`` with
``sys.argv`` = [SCRIPT, script arguments...], so every flag, record and checkpoint behaves as in the
real script; only the deliberate bug differs. Used by tests/test_ch05_negative.py, e.g. to prove that
removing gradient_accumulation.py's ``/ k`` fails the equivalence test's tolerance.
"""
from __future__ import annotations

import sys
from pathlib import Path

from mutation import mutated_source  # tests/workers/mutation.py, beside this worker


def main(argv: list[str]) -> None:
    if len(argv) < 3:
        sys.exit("error: usage: ch05_mutant.py SCRIPT OLD NEW -- [script arguments]")
    script, old, new, *rest = argv
    rest = rest[1:] if rest[:1] == ["--"] else rest
    path = Path(script).resolve()
    code = compile(mutated_source(path, old, new), str(path), "exec")  # old must occur exactly once
    sys.argv = [str(path), *rest]
    exec(code, {"__name__": "__main__", "__file__": str(path)})


if __name__ == "__main__":
    main(sys.argv[1:])
