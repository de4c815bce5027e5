"""MNIST from its standard IDX files, or an offline handwritten-digit set.

MNIST: the four IDX files (gzipped or raw) in ``--data-dir`` (also ``DIR/MNIST/raw``, the
torchvision layout). When they are missing and the network allows, they are downloaded with a
short timeout and their MD5 sums checked. Offline: scikit-learn's bundled 8x8 digits (1,797 real
handwritten digits, UCI ML optical recognition set) upsampled to 28x28. Which of the two a job
uses is agreed by all ranks (:func:`load_agreed`).
"""

from __future__ import annotations

import gzip
import hashlib
import logging
import os
import struct
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import torch

from ptcluster.examples.mnist.world import World

log = logging.getLogger(__name__)

MNIST_FILES = {
    # name: md5 of the .gz file, as published with the data set's standard mirrors
    "train-images-idx3-ubyte": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
    "train-labels-idx1-ubyte": "d53e105ee54ea40749a09fcbcd1e9432",
    "t10k-images-idx3-ubyte": "9fb629c4189551a2d022fa330f9573f3",
    "t10k-labels-idx1-ubyte": "ec29112dd5afa0611ce80d1b7f02629c",
}
MIRRORS = (
    "https://ossci-datasets.s3.amazonaws.com/mnist/",
    "https://storage.googleapis.com/cvdf-datasets/mnist/",
)
_IDX_DTYPES = {0x08: torch.uint8, 0x09: torch.int8, 0x0B: torch.int16, 0x0C: torch.int32,
               0x0D: torch.float32, 0x0E: torch.float64}


@dataclass(frozen=True)
class Dataset:
    name: str
    train_x: torch.Tensor  # float32 [N, 784], normalised
    train_y: torch.Tensor  # int64 [N]
    test_x: torch.Tensor
    test_y: torch.Tensor


def read_idx(path: str | os.PathLike[str]) -> torch.Tensor:
    """Read an IDX file (raw or .gz) into a tensor of its declared type and shape."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in _IDX_DTYPES:
        raise ValueError(f"{path}: not an IDX file (bad magic number)")
    ndim = data[3]
    dims = struct.unpack(f">{ndim}I", data[4:4 + 4 * ndim])
    dtype = _IDX_DTYPES[data[2]]
    count = 1
    for d in dims:
        count *= d
    body = data[4 + 4 * ndim:]
    itemsize = torch.tensor([], dtype=dtype).element_size()
    if len(body) != count * itemsize:
        raise ValueError(f"{path}: expected {count * itemsize} data bytes for shape {dims}, "
                         f"found {len(body)}")
    tensor = torch.frombuffer(bytearray(body), dtype=dtype)
    if itemsize > 1:  # IDX is big-endian
        tensor = torch.frombuffer(bytearray(body), dtype=torch.uint8).view(-1, itemsize) \
            .flip(1).contiguous().view(dtype)
    return tensor.reshape(dims)


def find_mnist(data_dir: Path) -> dict[str, Path] | None:
    found = {}
    for base in MNIST_FILES:
        for folder in (data_dir, data_dir / "MNIST" / "raw"):
            for name in (base, base + ".gz"):
                if (folder / name).is_file():
                    found[base] = folder / name
                    break
            if base in found:
                break
    return found if len(found) == len(MNIST_FILES) else None


def download_mnist(data_dir: Path, timeout: float = 5.0) -> str | None:
    """Fetch the four .gz files; None on success, else why not (never hangs: ``timeout``).

    Network failures are returned; a failure to write the files (``OSError``) is raised.
    """
    data_dir.mkdir(parents=True, exist_ok=True)
    for base, md5 in MNIST_FILES.items():
        target = data_dir / (base + ".gz")
        if target.is_file() and hashlib.md5(target.read_bytes()).hexdigest() == md5:
            continue
        errors = []
        for mirror in MIRRORS:
            try:
                with urllib.request.urlopen(mirror + base + ".gz", timeout=timeout) as resp:
                    blob = resp.read()
            except OSError as exc:
                errors.append(f"{mirror}: {exc}")
                continue
            if hashlib.md5(blob).hexdigest() != md5:
                errors.append(f"{mirror}: checksum mismatch")
                continue
            fd, tmp = tempfile.mkstemp(dir=data_dir, prefix=base + ".tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(blob)
                os.replace(tmp, target)
            except BaseException:  # a full disk must not leave a stray file per attempt
                Path(tmp).unlink(missing_ok=True)
                raise
            break
        else:
            return f"cannot download {base}.gz ({'; '.join(errors)})"
    return None


def _normalise(train: torch.Tensor, test: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    mean, std = train.mean(), train.std()
    return (train - mean) / std, (test - mean) / std


def load_mnist(files: dict[str, Path]) -> Dataset:
    tx = read_idx(files["train-images-idx3-ubyte"]).float().div(255).reshape(-1, 784)
    vx = read_idx(files["t10k-images-idx3-ubyte"]).float().div(255).reshape(-1, 784)
    tx, vx = _normalise(tx, vx)
    return Dataset("mnist", tx, read_idx(files["train-labels-idx1-ubyte"]).long(),
                   vx, read_idx(files["t10k-labels-idx1-ubyte"]).long())


def load_digits(test_fraction: float = 0.2, seed: int = 0) -> Dataset:
    try:
        from sklearn.datasets import load_digits as sk_digits
    except ImportError:
        raise RuntimeError("the offline data set needs scikit-learn: "
                           "pip install 'ptcluster[digits]'") from None
    bunch = sk_digits()
    images = torch.tensor(bunch.images, dtype=torch.float32).div(16).unsqueeze(1)
    images = torch.nn.functional.interpolate(images, size=(28, 28), mode="bilinear",
                                             align_corners=False).reshape(-1, 784)
    labels = torch.tensor(bunch.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    n_test = int(len(labels) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    tx, vx = _normalise(images[train], images[test])
    return Dataset("digits", tx, labels[train], vx, labels[test])


def load_agreed(dataset: str, data_dir: Path, world: World, *, download: bool) -> Dataset:
    """The same data set on every rank, whatever each node's disk holds: ``dataset`` as
    ``--dataset`` names it (auto: MNIST where every rank has it, else the digits).

    Every rank takes the same collective steps: local rank 0 of each node downloads what its
    node lacks while the others wait at the barrier; then MNIST only if every rank finds its
    files, else the digits everywhere.
    """
    if dataset == "digits":
        return load_digits()
    why = None
    if download:
        if world.local_rank == 0 and find_mnist(data_dir) is None:
            why = download_mnist(data_dir)
            if why and dataset == "mnist":  # asked for MNIST: every node says why it has none
                log.warning("MNIST unavailable (%s)", why)
            elif why:  # auto: the fallback below says it, once; the mirrors' errors are detail
                log.debug("MNIST unavailable (%s)", why)
        world.barrier()
    files = find_mnist(data_dir)
    found = world.gather(files is not None)
    if files is not None and all(found):
        return load_mnist(files)
    lacking = [r for r, ok in enumerate(found) if not ok]
    where = f"{data_dir} on rank(s) {lacking}" if world.size > 1 else str(data_dir)
    if dataset == "mnist":
        raise RuntimeError(f"MNIST is not in {where}. Put the four IDX files there on every "
                           "node, or use --dataset digits")
    log.info("MNIST %s: every rank uses the offline digits",
             f"is not reachable and not in {where}" if why else f"is not in {where}")
    return load_digits()
