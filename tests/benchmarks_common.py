"""What tests/test_benchmarks.py (CPU suite) and tests/test_benchmarks_gpu.py (``pytest -m gpu``)
share: where benchmarks/ lives, the issue's bars for theory vs measurement, loading a benchmarks
script by path, and running a script's argument parser in this process."""
from __future__ import annotations

import contextlib
import importlib.util
import io
import subprocess
import sys

from launch import REPO

BENCH = REPO / "benchmarks"
README = BENCH / "README.md"
COMMITTED_RESULTS = BENCH / "records" / "results_cpu.jsonl"
BYTES_TOLERANCE = 0.01   # the bar: communication bytes within 1% of distkit.theory
STATE_TOLERANCE = 0.05   # model-state bytes within 5%


def load_script(name: str):
    """benchmarks/<name>.py imported by path as module ``benchmarks_<name>`` (once per session)."""
    key = f"benchmarks_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


def parse_args_result(module, *args: str) -> subprocess.CompletedProcess:
    """A script's ``parse_args()`` on ``args`` in this process, as a CompletedProcess (exit code and
    everything printed) for ``launch.assert_one_line_error``. argparse rejects a bad flag before the
    script touches a tensor, so this checks the same code, line and exit code as a launch, without
    starting an interpreter that imports torch for every case."""
    out, argv = io.StringIO(), sys.argv
    sys.argv = [module.__file__, *map(str, args)]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            module.parse_args()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    finally:
        sys.argv = argv
    return subprocess.CompletedProcess(sys.argv, code, out.getvalue(), "")
