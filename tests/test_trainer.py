"""The reference trainer: real data, real DDP over gloo, checkpoints and resume."""

from __future__ import annotations

import gzip
import hashlib
import re
import struct

import pytest
import torch

from ptcluster.examples.mnist import data as mnist_data
from ptcluster.examples.mnist.train import main as train_main
from tests.jobs import only_run, run_head


def write_idx(path, tensor: torch.Tensor, gz: bool) -> None:
    codes = {torch.uint8: 0x08, torch.int32: 0x0C, torch.float32: 0x0D}
    header = bytes([0, 0, codes[tensor.dtype], tensor.dim()])
    header += struct.pack(f">{tensor.dim()}I", *tensor.shape)
    body = tensor.contiguous()
    if tensor.element_size() > 1:
        body = body.view(torch.uint8).view(-1, tensor.element_size()).flip(1)
    blob = header + body.numpy().tobytes()
    if gz:
        path = path.with_name(path.name + ".gz")
        path.write_bytes(gzip.compress(blob))
    else:
        path.write_bytes(blob)


@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int32, torch.float32])
def test_read_idx_round_trip(tmp_path, gz: bool, dtype: torch.dtype) -> None:
    t = (torch.arange(2 * 3 * 4) * 7 % 250).reshape(2, 3, 4).to(dtype)
    write_idx(tmp_path / "x-idx3", t, gz)
    back = mnist_data.read_idx(tmp_path / ("x-idx3" + (".gz" if gz else "")))
    assert back.dtype == dtype and torch.equal(back, t)


def test_read_idx_rejects_bad_files(tmp_path) -> None:
    (tmp_path / "bad").write_bytes(b"\x01\x02\x03\x04")
    with pytest.raises(ValueError, match="magic"):
        mnist_data.read_idx(tmp_path / "bad")
    (tmp_path / "short").write_bytes(bytes([0, 0, 8, 1]) + struct.pack(">I", 10) + b"abc")
    with pytest.raises(ValueError, match="expected 10"):
        mnist_data.read_idx(tmp_path / "short")


def test_failed_download_write_leaves_no_temp_file(tmp_path, monkeypatch) -> None:
    blob = b"not really mnist"

    class Response:
        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            pass

        def read(self) -> bytes:
            return blob

    monkeypatch.setattr(mnist_data, "MNIST_FILES", {"x-idx3": hashlib.md5(blob).hexdigest()})
    monkeypatch.setattr(mnist_data.urllib.request, "urlopen", lambda *a, **kw: Response())

    def full_disk(src, dst) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(mnist_data.os, "replace", full_disk)
    with pytest.raises(OSError, match="No space"):
        mnist_data.download_mnist(tmp_path)
    assert list(tmp_path.iterdir()) == []


def make_mnist_dir(folder) -> None:
    """The offline digits written as the four MNIST IDX files (uint8, 28x28)."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    imgs = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16
    imgs = torch.nn.functional.interpolate(imgs, size=(28, 28), mode="bilinear")
    imgs = (imgs.squeeze(1) * 255).round().clamp(0, 255).to(torch.uint8)
    labels = torch.tensor(bunch.target, dtype=torch.uint8)
    folder.mkdir(parents=True, exist_ok=True)
    write_idx(folder / "train-images-idx3-ubyte", imgs[:1400], gz=True)
    write_idx(folder / "train-labels-idx1-ubyte", labels[:1400].reshape(-1), gz=True)
    write_idx(folder / "t10k-images-idx3-ubyte", imgs[1400:], gz=False)
    write_idx(folder / "t10k-labels-idx1-ubyte", labels[1400:].reshape(-1), gz=False)


def test_load_dataset_prefers_idx_files_and_never_hangs_offline(tmp_path) -> None:
    make_mnist_dir(tmp_path / "MNIST" / "raw")
    ds = mnist_data.load_dataset("auto", tmp_path, download=False)
    assert ds.name == "mnist" and ds.train_x.shape == (1400, 784) and len(ds.test_y) == 397
    with pytest.raises(RuntimeError, match="--dataset digits"):
        mnist_data.load_dataset("mnist", tmp_path / "empty", download=False)
    assert mnist_data.load_dataset("auto", tmp_path / "empty", download=False).name == "digits"


@pytest.mark.slow
def test_ddp_trainer_reaches_accuracy_with_identical_params(tmp_path, no_leftovers) -> None:
    code, head = run_head(["run", "--nproc", "2", "--run-dir", "runs", "-m",
                           "ptcluster.examples.mnist", "--dataset", "digits"], cwd=tmp_path)
    job_id, _ = only_run(tmp_path / "runs")
    no_leftovers.append(job_id)
    assert code == 0, head.output()
    final = [line for line in head.lines if line.startswith("[localhost:0] final ")]
    assert len(final) == 1, head.output()
    fields = dict(f.split("=") for f in final[0].split()[2:])
    assert float(fields["test_accuracy"]) >= 0.90, final
    assert fields["world_size"] == "2" and fields["backend"] == "gloo"
    assert float(fields["samples_per_s"]) > 0
    digests = {}
    for line in head.lines:
        m = re.match(r"\[localhost:(\d)\] rank=(\d) params_sha256=(\w+)", line)
        if m:
            assert m.group(1) == m.group(2)
            digests[int(m.group(1))] = m.group(3)
    assert len(digests) == 2 and digests[0] == digests[1], digests
    epochs = [line for line in head.lines if "epoch " in line and "test_accuracy" in line]
    assert len(epochs) == 5 and all(line.startswith("[localhost:0]") for line in epochs)
    assert (tmp_path / "checkpoints" / "checkpoint.pt").is_file()


def test_resume_continues_at_the_right_epoch(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert train_main(["--epochs", "2", "--dataset", "digits"]) == 0
    ckpt = torch.load(tmp_path / "checkpoints" / "checkpoint.pt")
    assert ckpt["epoch"] == 1 and ckpt["dataset"] == "digits"
    assert not list((tmp_path / "checkpoints").glob("*.tmp*"))
    capsys.readouterr()
    assert train_main(["--epochs", "4", "--dataset", "digits", "--resume"]) == 0
    out = capsys.readouterr().out
    assert "resumed from" in out and "continuing at epoch 3" in out
    assert "epoch 1/4" not in out and "epoch 2/4" not in out
    assert "epoch 3/4" in out and "epoch 4/4" in out
    assert torch.load(tmp_path / "checkpoints" / "checkpoint.pt")["epoch"] == 3


def test_mnist_idx_path_trains(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    make_mnist_dir(tmp_path / "data")
    assert train_main(["--epochs", "3", "--no-download"]) == 0
    out = capsys.readouterr().out
    assert "dataset=mnist" in out
    acc = float(re.search(r"final .*test_accuracy=([\d.]+)", out).group(1))
    assert acc >= 0.85
