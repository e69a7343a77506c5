"""Committed records, and every README figure regenerated from them.

No figure in this repository is typed by hand. Each one is rebuilt from a *record*: a JSON line,
committed next to the README that shows it, that says what ran, where and when::

    {"schema": 1, "name": "ddp_mnist", "command": "torchrun --nproc_per_node=4 01-ddp-basics/ddp_mnist.py",
     "machine": {"device_name": "2-core CPU", ...}, "torch": "2.13.0+cpu", "date": "2026-11-22",
     "returncode": 0, "output": "..."}

Harness records (``distkit.harness``: one per measured run) carry the same provenance fields.

A Markdown file marks each generated part, and this module rewrites what lies between the marks:

* an **output block**, the captured output of a recorded command::

      <!-- output: records/outputs.jsonl ddp_mnist -->
      ...generated...
      <!-- /output -->

  ``head=N`` / ``tail=N`` after the name keep the first / last lines (with ``...`` between).
* a **rendered part** (a table, a plot and its image link): a function of a script, given the folder
  to write files into, returns the Markdown::

      <!-- render: ddp_benchmark.py:readme_figures -->
      ...generated...
      <!-- /render -->

Paths in marks are relative to the Markdown file. The commands::

    python -m distkit.records run --into 01-ddp-basics/records/outputs.jsonl --name ddp_mnist -- \\
        torchrun --nproc_per_node=4 01-ddp-basics/ddp_mnist.py        # run a command, record its output
    python -m distkit.records run --into 02-fsdp/records/outputs.jsonl --name fsdp_strategies \\
        --keep runs/fsdp_strategies.jsonl=02-fsdp/records/fsdp_strategies.jsonl -- \\
        torchrun ... --results runs/fsdp_strategies.jsonl               # ... and keep what it wrote
    python -m distkit.records rerun 01-ddp-basics/README.md             # re-run every recorded command
    python -m distkit.records render [PATH ...]                          # regenerate blocks, tables, plots
    python -m distkit.records check [PATH ...]                           # exit 1 if anything is stale

``render`` also re-executes the notebook of every chapter folder among the paths (all without
paths; ``--no-notebooks`` skips them) and ``check`` fails on a notebook not executed from its current
cells: see :mod:`distkit.notebooks`.

``check`` also fails on a ```text block or an image that no mark generates (a hand-typed figure),
and on an output block whose recorded command is not the one the README shows above it (a command
edited without recording it again).
Recorded runs hold a machine-wide lock, so two never measure at the same time, and set
``DISTKIT_NO_PROGRESS=1`` (progress bars are drawn for a terminal, not a record).
"""
from __future__ import annotations

import argparse
import fcntl
import importlib.util
import json
import os
import re
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from .checkpoint import atomic_write
from .jobs import GRACE_S, run_job
from .provenance import LOCK_FILE, SCHEMA_VERSION, machine, machine_label, provenance, run_device  # noqa: F401
from .shown_output import shown

REPO = Path(__file__).resolve().parent.parent
# Folders never scanned for Markdown: scratch output, data, virtual environments.
_SKIP_DIRS = {"runs", "data", "checkpoints", "build", "node_modules", "site-packages"}
_MARK = re.compile(r"<!-- (output|render): (?P<args>[^\n]*?) -->\n(?P<body>.*?)<!-- /\1 -->", re.S)
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


class RecordError(Exception):
    """A mark that names a missing record, file or function; reported as one line."""


# provenance (LOCK_FILE, machine, machine_label, provenance) lives in distkit.provenance


# ------------------------------------------------------------------------------------- record files
def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Every record of a JSON Lines file, oldest first."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def write_jsonl(path: str | os.PathLike, records: list[dict[str, Any]]) -> None:
    """Write records as JSON Lines atomically (:func:`distkit.checkpoint.atomic_write`)."""
    text = "".join(json.dumps(r, sort_keys=False) + "\n" for r in records)
    atomic_write(path, lambda f: f.write(text.encode()))


def upsert(path: str | os.PathLike, record: dict[str, Any]) -> None:
    """Store ``record`` in ``path``, replacing an older record of the same ``name`` in place."""
    records = read_jsonl(path) if Path(path).exists() else []
    for i, old in enumerate(records):
        if old.get("name") == record["name"]:
            records[i] = record
            break
    else:
        records.append(record)
    write_jsonl(path, records)


def find(path: str | os.PathLike, name: str) -> dict[str, Any]:
    """The record called ``name`` in ``path``."""
    path = Path(path)
    if not path.exists():
        raise RecordError(f"record file {path} does not exist")
    for record in read_jsonl(path):
        if record.get("name") == name:
            return record
    raise RecordError(f"no record named {name!r} in {path}")


# ----------------------------------------------------------------------------------- recorded runs
def clean_output(raw: str) -> str:
    """What a terminal would show at the end: colours dropped, ``\\r``-redrawn lines resolved."""
    lines = []
    for line in _ANSI.sub("", raw).split("\n"):
        lines.append(line.split("\r")[-1].rstrip())
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines)


def parse_keep(pairs: list[str] | None) -> list[list[str]]:
    """``RUN_FILE=RECORD_FILE`` pairs (``--keep``): what a recorded command writes under ``runs/``,
    as the reader's command does, and the committed file it becomes."""
    kept = []
    for pair in pairs or []:
        source, sep, target = pair.partition("=")
        if not sep or not source or not target:
            raise RecordError(f"--keep {pair!r}: give RUN_FILE=RECORD_FILE")
        if Path(source).parts[:1] != ("runs",):
            raise RecordError(f"--keep {pair!r}: the run's file must lie under runs/ (it is replaced)")
        kept.append([source, target])
    return kept


def capture(command: str, name: str, timeout_s: float | None = None,
            into: str | os.PathLike | None = None, keep: list[list[str]] | None = None, *,
            machine: dict | None = None,  # noqa: F811 - the record's field; machine() is not called here
            torch_version: str | None = None, cuda_available: bool | None = None,
            grace_s: float = GRACE_S, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``command`` (a shell command line, from the repository root) and return its record,
    stored in ``into`` (replacing an older record of that name) when given.

    ``keep`` (:func:`parse_keep`): README commands write only under ``runs/``, so the command
    recorded is the reader's own. Each ``runs/`` file it names is removed before the run and, when
    the run succeeds, copied over its committed file: the committed file holds this run alone.

    stdout and stderr are captured together, in order. The run and the store hold
    :data:`LOCK_FILE`, so recorded runs on one machine never overlap (their timings would distort
    each other) and two of them never write one record file at once. The command runs in a session
    of its own, and at ``timeout_s`` its whole process tree is ended (:func:`distkit.jobs.run_job`:
    SIGTERM, ``grace_s`` seconds, SIGKILL).

    A caller that already knows the machine passes ``machine`` and ``torch_version`` (the record's
    fields) and ``cuda_available`` (for :func:`distkit.provenance.run_device`): capture then never
    touches torch itself. Without them they come from this process's torch. ``env``: the command's
    environment (default: this process's).
    """
    if (machine is None) != (torch_version is None):
        raise ValueError("capture: give machine and torch_version together")
    env = dict(os.environ if env is None else env, DISTKIT_NO_PROGRESS="1", PYTHONUNBUFFERED="1")
    with open(LOCK_FILE, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        # Other work on the machine slows a recorded run down; keep how busy it was (1-min load).
        load = round(os.getloadavg()[0], 1)
        for source, _ in keep or []:
            (REPO / source).unlink(missing_ok=True)
        started = time.perf_counter()
        result = run_job(["bash", "-c", command], timeout_s, cwd=REPO, env=env, grace_s=grace_s)
        if result.cut:
            raise RecordError(f"{command!r} ran past {timeout_s:g} s")
        seconds = time.perf_counter() - started
        # decoded here, not read as text: universal newlines would turn a progress bar's \r into lines
        output = clean_output(result.output.decode(errors="replace"))
        # The machine as the command used it (a CPU run on a GPU host is labelled with the CPU); the
        # chapter scripts use NCCL on GPUs and gloo on the CPU.
        device = run_device(command, output, cuda_available=cuda_available)
        fields = provenance(command, device=device, known_machine=machine, torch_version=torch_version)
        record = {"name": name, **fields,
                  "backend": "nccl" if device == "cuda" else "gloo", "returncode": result.returncode,
                  "wall_s": round(seconds, 1), "load_1min": load, "root": str(REPO),
                  "interpreter": sys.executable, "output": output}
        if keep:
            record["keep"] = keep
            if result.returncode == 0:
                for source, target in keep:
                    if not (REPO / source).is_file():
                        raise RecordError(f"{command!r} wrote no {source} (--keep)")
                    kept = (REPO / source).read_bytes()
                    atomic_write(REPO / target, lambda f: f.write(kept))
        if into is not None:
            upsert(into, record)
    return record


# ------------------------------------------------------------------------------------------ marks
@dataclass
class Mark:
    kind: str          # "output" or "render"
    args: list[str]
    start: int         # span of the whole mark (opening comment to closing comment) in the text
    end: int


def marks(text: str) -> list[Mark]:
    """The generated parts of a Markdown text."""
    return [Mark(m.group(1), shlex.split(m.group("args")), m.start(), m.end()) for m in _MARK.finditer(text)]


def _output_body(md_dir: Path, args: list[str]) -> str:
    if len(args) < 2:
        raise RecordError(f"output mark needs 'FILE NAME', got {' '.join(args)!r}")
    file, name, *options = args
    record = find(md_dir / file, name)
    lines = shown(record).split("\n")
    opts = dict(o.split("=", 1) for o in options)
    head, tail = int(opts.get("head", 0)), int(opts.get("tail", 0))
    if (head or tail) and head + tail < len(lines):
        lines = lines[:head] + ["..."] + (lines[-tail:] if tail else [])
    where = machine_label(record["machine"], record.get("backend"))
    return ("```text\n" + "\n".join(lines) + "\n```\n"
            f"<sub>Recorded on {where}, torch {record['torch']}, {record['date']}{took(record)}: `{name}` in "
            f"[{file}]({file}).</sub>\n")


def took(record: dict) -> str:
    """``, took 84 s`` / ``, took 11 min``: how long the recorded command ran there (a reader's rough
    time for it on a machine like that one), or nothing for a record without it."""
    seconds = record.get("wall_s")
    if seconds is None:
        return ""
    return f", took {seconds:.0f} s" if seconds < 90 else f", took {seconds / 60:.0f} min"


_MODULES: dict[Path, Any] = {}


def load_function(script: Path, function: str) -> Callable[[Path], str]:
    """``function`` of the script at ``script``, imported by its path (scripts import only distkit and
    libraries, never a sibling script, so nothing is added to ``sys.path``)."""
    script = script.resolve()
    if script not in _MODULES:
        if not script.exists():
            raise RecordError(f"render mark names {script}, which does not exist")
        spec = importlib.util.spec_from_file_location(f"_rendered_{script.stem}_{len(_MODULES)}", script)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)  # type: ignore[union-attr]
        _MODULES[script] = module
    fn = getattr(_MODULES[script], function, None)
    if fn is None:
        raise RecordError(f"{script.name} has no function {function!r}")
    return fn


def _render_body(md_dir: Path, args: list[str], out_dir: Path) -> str:
    if len(args) != 1 or ":" not in args[0]:
        raise RecordError(f"render mark needs 'SCRIPT:FUNCTION', got {' '.join(args)!r}")
    script, function = args[0].rsplit(":", 1)
    body = load_function(md_dir / script, function)(out_dir)
    return body if body.endswith("\n") else body + "\n"


def regenerate(md_path: Path, out_dir: Path | None = None) -> str:
    """The text of ``md_path`` with every mark regenerated; rendered files go to ``out_dir``
    (default: the Markdown file's folder, i.e. in place)."""
    md_dir = md_path.parent
    out_dir = out_dir or md_dir
    text = md_path.read_text()
    pieces, last = [], 0
    for mark in marks(text):
        opening = text[mark.start:text.index("\n", mark.start) + 1]
        body = (_output_body(md_dir, mark.args) if mark.kind == "output"
                else _render_body(md_dir, mark.args, out_dir))
        pieces += [text[last:mark.start], opening, body, f"<!-- /{mark.kind} -->"]
        last = mark.end
    pieces.append(text[last:])
    return "".join(pieces)


_BASH = re.compile(r"```bash\n(.*?)```", re.S)
_SCRIPT = re.compile(r"[\w./-]+\.(?:py|sh|sbatch)\b")


def stale_commands(md_path: Path, text: str) -> list[str]:
    """Output blocks whose record ran another command than the one the README shows above them.

    An output block shows what the README's command printed. When the nearest bash block above it
    (no heading in between) runs the recorded command's script, one of its commands must be part of
    the recorded command as written (the record may add an environment variable or a loop around
    it): a command edited after its run was recorded fails here until it is recorded again.
    """
    problems = []
    for mark in marks(text):
        if mark.kind != "output":
            continue
        before = text[:mark.start]
        blocks = list(_BASH.finditer(before))
        if not blocks or "\n#" in before[blocks[-1].end():]:
            continue
        shown = [" ".join(line.split()) for line in re.sub(r"\\\n\s*", " ", blocks[-1].group(1)).splitlines()
                 if line.strip() and not line.lstrip().startswith("#")]
        try:
            recorded = " ".join(find(md_path.parent / mark.args[0], mark.args[1])["command"].split())
        except RecordError:
            continue  # reported by regenerate
        scripts = set(_SCRIPT.findall(recorded))
        same_script = [c for c in shown if scripts & set(_SCRIPT.findall(c))]
        if same_script and not any(c in recorded for c in same_script):
            problems.append(f"output block {mark.args[1]!r} was recorded from {recorded!r}, not from the "
                            f"command shown above it (record it again: python -m distkit.records run ...)")
    return problems


def unrecorded_figures(text: str) -> list[str]:
    """```text blocks and images outside every mark: figures with no record behind them."""
    inside = [(m.start, m.end) for m in marks(text)]
    found = []
    for pattern, what in ((r"^```text$", "text block"), (r"!\[[^\]]*\]\([^)]*\)", "image")):
        for m in re.finditer(pattern, text, re.M):
            if not any(s <= m.start() < e for s, e in inside):
                line = text.count("\n", 0, m.start()) + 1
                found.append(f"line {line}: {what} {m.group(0)[:60]!r} is not generated from a record")
    return found


def markdown_files(paths: list[str] | None = None) -> list[Path]:
    """Markdown files under ``paths`` (default: the repository), skipping scratch folders."""
    roots = [Path(p) for p in paths] if paths else [REPO]
    files = []
    for root in roots:
        root = root if root.is_absolute() else Path.cwd() / root
        if root.is_file():
            files.append(root.resolve())
            continue
        for path in sorted(root.rglob("*.md")):
            rel = path.relative_to(root).parts
            if not any(p.startswith(".") or p in _SKIP_DIRS for p in rel):
                files.append(path.resolve())
    return files


def render(paths: list[str] | None = None) -> list[Path]:
    """Regenerate every mark of every Markdown file under ``paths`` in place; the changed files."""
    changed = []
    for md in markdown_files(paths):
        new = regenerate(md)
        if new != md.read_text():
            md.write_text(new)
            changed.append(md)
    return changed


def check(paths: list[str] | None = None) -> list[str]:
    """What differs between the committed Markdown/plots and what their records regenerate."""
    problems = []
    for md in markdown_files(paths):
        rel = md.relative_to(REPO) if md.is_relative_to(REPO) else md
        text = md.read_text()
        problems += [f"{rel}: {p}" for p in unrecorded_figures(text) + stale_commands(md, text)]
        if not marks(text):
            continue
        with tempfile.TemporaryDirectory() as tmp:
            try:
                new = regenerate(md, Path(tmp))
            except RecordError as e:
                problems.append(f"{rel}: {e}")
                continue
            if new != text:
                problems.append(f"{rel}: generated parts differ from their records "
                                f"(run: python -m distkit.records render {rel})")
            for written in sorted(Path(tmp).rglob("*")):
                if written.is_file():
                    committed = md.parent / written.relative_to(tmp)
                    if not committed.exists() or committed.read_bytes() != written.read_bytes():
                        problems.append(f"{rel}: {committed.relative_to(md.parent)} differs from what "
                                        f"its record draws (run: python -m distkit.records render {rel})")
    from . import notebooks  # chapter notebooks: committed executed, from their current cells

    return problems + notebooks.problems(paths)


def save_figure(fig, path: str | os.PathLike, dpi: int = 110) -> None:
    """Save a matplotlib figure reproducibly (no version stamp or date in the file) and close it."""
    import matplotlib.pyplot as plt

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi, metadata={"Software": None})
    plt.close(fig)


# --------------------------------------------------------------------------------------------- CLI
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distkit.records",
                                     description="Record runs and regenerate every README figure from records.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a command and store its output as a record")
    run.add_argument("--into", required=True, help="the JSON Lines file to store the record in")
    run.add_argument("--name", required=True, help="the record's name (replaces an older one of that name)")
    run.add_argument("--timeout-s", type=float, default=3600, help="give up after this long (default 3600)")
    run.add_argument("--keep", action="append", metavar="RUN_FILE=RECORD_FILE",
                     help="a file the command writes under runs/ that becomes a committed record file "
                          "(removed before the run, copied after it succeeds; repeatable)")
    run.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the command line")
    rerun = sub.add_parser("rerun", help="re-run the recorded command of every output block of Markdown files")
    rerun.add_argument("paths", nargs="+")
    rerun.add_argument("--only", nargs="*", default=None, help="record names to re-run (default: all)")
    for name, text in (("render", "regenerate every output block, table and plot in place"),
                       ("check", "exit 1 when a generated part differs from what its record gives")):
        p = sub.add_parser(name, help=text)
        p.add_argument("paths", nargs="*", help="Markdown files or folders (default: the whole repository)")
    sub.choices["render"].add_argument("--no-notebooks", action="store_true",
                                       help="do not re-execute the notebook.ipynb of chapter folders among the paths")
    args = parser.parse_args(argv)
    try:
        if args.command == "run":
            cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
            if not cmd:
                parser.error("give the command after --")
            command = cmd[0] if len(cmd) == 1 else shlex.join(cmd)
            record = capture(command, args.name, args.timeout_s, into=args.into, keep=parse_keep(args.keep))
            print(f"recorded {args.name!r} (exit {record['returncode']}, {record['wall_s']} s) in {args.into}")
        elif args.command == "rerun":
            for md in markdown_files(args.paths):
                for mark in marks(md.read_text()):
                    if mark.kind != "output" or (args.only is not None and mark.args[1] not in args.only):
                        continue
                    file = md.parent / mark.args[0]
                    old = find(file, mark.args[1])
                    print(f"re-running {old['name']}: {old['command']}", flush=True)
                    capture(old["command"], old["name"], into=file, keep=old.get("keep"))
            print("now: python -m distkit.records render")
        elif args.command == "render":
            for path in render(args.paths):
                print(f"regenerated {path.relative_to(REPO) if path.is_relative_to(REPO) else path}")
            if not args.no_notebooks:
                from . import notebooks  # executes chapter folders' notebook.py into notebook.ipynb

                if notebooks.render(args.paths):
                    return 1
        else:
            problems = check(args.paths)
            for p in problems:
                print(p)
            if problems:
                return 1
            print("every generated part matches its record")
    except RecordError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
