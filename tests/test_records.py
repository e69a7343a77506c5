"""Every README figure is regenerated from a committed record, and the check that says so can fail.

``python -m distkit.records check`` rebuilds every output block, table and plot of every Markdown
file from the records committed beside it and compares with what is committed. The reader's play
runs it as the top README shows it, over the whole repository, after every other README command
(tests/test_reader_play.py; benchmarks/README.md's ``check benchmarks`` runs within it).
The negative controls below prove it notices a hand-typed figure, a stale block, a redrawn plot and
a record that is missing.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from distkit import records
from distkit.harness import read_records, upgrade_record
from launch import REPO, job_env


def _record(name: str, output: str) -> dict:
    return {"name": name, "schema": 1, "command": f"echo {name}", "backend": "gloo",
            "machine": {"device_name": "2-core CPU"}, "torch": "2.13.0+cpu", "date": "2026-11-22",
            "returncode": 0, "wall_s": 84.4, "output": output}


RENDERER = '''
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
from distkit.records import save_figure

def figures(out_dir):
    values = [1, 2, 3]
    fig, ax = plt.subplots()
    ax.plot(values)
    save_figure(fig, out_dir / "plot.png")
    return "| value |\\n|---|\\n" + "".join(f"| {v} |\\n" for v in values) + "\\n![values](plot.png)"
'''


def _chapter(tmp_path: Path) -> Path:
    """A tiny chapter: one recorded output block and one rendered table + plot, generated."""
    chapter = tmp_path / "chapter"
    chapter.mkdir()
    records.write_jsonl(chapter / "records" / "outputs.jsonl", [_record("hello", "one\ntwo\nthree")])
    (chapter / "figs.py").write_text(RENDERER)
    (chapter / "README.md").write_text(
        "# chapter\n\n<!-- output: records/outputs.jsonl hello -->\n<!-- /output -->\n\n"
        "<!-- render: figs.py:figures -->\n<!-- /render -->\n")
    assert records.render([str(chapter)]) == [chapter / "README.md"]
    assert records.check([str(chapter)]) == []
    return chapter


def test_generated_parts_carry_the_record_and_where_it_ran(tmp_path):
    text = (_chapter(tmp_path) / "README.md").read_text()
    assert "```text\none\ntwo\nthree\n```" in text
    assert "Recorded on 2-core CPU, gloo, torch 2.13.0+cpu, 2026-11-22, took 84 s:" in text  # the record's wall_s
    assert "| 1 |\n| 2 |\n| 3 |" in text and "![values](plot.png)" in text


def test_check_fails_on_a_stale_block(tmp_path):
    chapter = _chapter(tmp_path)
    records.upsert(chapter / "records" / "outputs.jsonl", _record("hello", "one\nTWO\nthree"))
    assert any("differ from their records" in p for p in records.check([str(chapter)]))


def test_check_fails_on_an_edited_table_or_a_different_plot(tmp_path):
    chapter = _chapter(tmp_path)
    readme = chapter / "README.md"
    readme.write_text(readme.read_text().replace("| 2 |", "| 2.5 |"))
    assert any("differ from their records" in p for p in records.check([str(chapter)]))
    records.render([str(chapter)])
    (chapter / "figs.py").write_text(RENDERER.replace("ax.plot(values)", "ax.plot(values, 'o')"))
    records._MODULES.clear()
    assert any("plot.png differs" in p for p in records.check([str(chapter)]))


def test_check_fails_on_hand_typed_figures_and_missing_records(tmp_path):
    chapter = _chapter(tmp_path)
    readme = chapter / "README.md"
    readme.write_text(readme.read_text() + "\n```text\n940 samples/s\n```\n\n![old](old.png)\n"
                      "<!-- output: records/outputs.jsonl gone -->\n<!-- /output -->\n")
    problems = records.check([str(chapter)])
    assert any("text block" in p for p in problems)
    assert any("image" in p for p in problems)
    assert any("no record named 'gone'" in p for p in problems)


def test_run_records_the_command_its_output_and_the_machine(tmp_path):
    into = tmp_path / "outputs.jsonl"
    cmd = [sys.executable, "-m", "distkit.records", "run", "--into", str(into), "--name", "demo", "--",
           "echo to-stdout; echo to-stderr >&2; printf 'bar 10%%\\rbar 100%%\\n'; exit 3"]
    subprocess.run(cmd, check=True, env=job_env(tmp_path), cwd=REPO, capture_output=True)
    record = records.read_jsonl(into)[0]
    assert record["output"] == "to-stdout\nto-stderr\nbar 100%"
    assert record["returncode"] == 3 and record["backend"] == "gloo"
    assert record["machine"]["cpu_cores"] >= 1 and record["torch"].startswith("2.")
    assert record["command"].startswith("echo to-stdout") and record["schema"] == records.SCHEMA_VERSION
    assert record["root"] == str(REPO)  # where it ran: README blocks show paths relative to it
    assert record["interpreter"] == sys.executable  # and which interpreter: blocks show it by name


def test_old_records_are_read_with_the_median_throughput(tmp_path):
    # Before schema 1, samples_per_s came from the mean step time. 4 steps of 16 samples at
    # 0.1, 0.1, 0.1, 0.5 s: mean 0.2 s -> 80 samples/s; median 0.1 s -> 160 samples/s.
    old = {"strategy": "ddp", "metrics": {"step_time_s_median": 0.1, "step_time_s_mean": 0.2,
                                          "samples_per_s": 80.0, "tokens_per_s": 80.0 * 32}}
    path = tmp_path / "old.jsonl"
    path.write_text(json.dumps(old) + "\n")
    metrics = read_records(path)[0]["metrics"]
    assert abs(metrics["samples_per_s"] - 160.0) < 1e-9 and abs(metrics["tokens_per_s"] - 160.0 * 32) < 1e-6
    assert "step_time_s_mean" not in metrics and abs(metrics["samples_per_step"] - 16.0) < 1e-9
    # A record of today's schema is read as written.
    new = {"schema": 2, "strategy": "ddp", "model": {"arch": "gpt", "n_layer": 2},
           "metrics": {"step_time_s_median": 0.1, "samples_per_s": 160.0}}
    assert upgrade_record(json.loads(json.dumps(new))) == new


def test_recorded_command_keeps_what_it_wrote_under_runs(tmp_path, monkeypatch):
    """``records run --keep runs/X=records/X``: the recorded command is the reader's (it writes under
    runs/); the runs/ file is emptied before the run and becomes the committed file after it."""
    monkeypatch.setattr(records, "REPO", tmp_path)
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "r.jsonl").write_text('{"an": "older run"}\n')
    keep = records.parse_keep(["runs/r.jsonl=ch/records/r.jsonl"])
    record = records.capture('echo \'{"a": "new run"}\' >> runs/r.jsonl', "kept",
                             into=tmp_path / "out.jsonl", keep=keep)
    assert (tmp_path / "ch" / "records" / "r.jsonl").read_text() == '{"a": "new run"}\n'
    assert record["keep"] == [["runs/r.jsonl", "ch/records/r.jsonl"]]
    assert records.find(tmp_path / "out.jsonl", "kept")["keep"] == record["keep"]  # rerun keeps it too
    # negative control: a failed run leaves the committed file as it was
    records.capture("echo half >> runs/r.jsonl; exit 3", "failed", keep=keep)
    assert (tmp_path / "ch" / "records" / "r.jsonl").read_text() == '{"a": "new run"}\n'
    for bad in ("records/r.jsonl=ch/r.jsonl", "runs/r.jsonl", "=x"):
        with pytest.raises(records.RecordError):
            records.parse_keep([bad])


def test_an_output_block_under_an_edited_command_is_stale(tmp_path):
    """``records check`` sees a README command edited after its run was recorded: the output block
    below it no longer shows what that command prints. A wrapper the record adds (an environment
    variable) is allowed; a command of another script above the block is not compared."""
    records.write_jsonl(tmp_path / "outputs.jsonl", [
        {**_record("demo", "ok"), "command": "FOO=1 torchrun --nproc_per_node=2 demo.py --steps 3"}])
    block = "<!-- output: outputs.jsonl demo -->\n```text\nok\n```\n<!-- /output -->\n"

    def problems(command):
        md = tmp_path / "README.md"
        md.write_text(f"```bash\n{command}\n```\n\n{block}")
        return records.stale_commands(md, md.read_text())

    assert problems("torchrun --nproc_per_node=2 demo.py --steps 3") == []
    assert problems("torchrun --nproc_per_node=2 other.py") == []
    assert len(problems("torchrun --nproc_per_node=2 demo.py --steps 3 --results runs/x.jsonl")) == 1
