"""The reference trainer: real data, real DDP over gloo, checkpoints and resume."""

from __future__ import annotations

import gzip
import hashlib
import logging
import re
import socket
import struct
import urllib.error
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ptcluster.examples.mnist import checkpoint
from ptcluster.examples.mnist import data as mnist_data
from ptcluster.examples.mnist import train as train_mod
from ptcluster.examples.mnist.config import TrainConfig, parse_config
from ptcluster.examples.mnist.train import main as train_main
from ptcluster.examples.mnist.world import World
from tests.support.head import by_rank, only_run, rank_fields, run_head

EPOCH = re.compile(r"\bepoch (\d+/\d+) loss=")
"""The trainer's line at an epoch's end: which epoch of how many."""


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


ONE = World(0, 0, 1, torch.device("cpu"), "none")
"""A plain run's world (no process group)."""


def end_epochs(folder) -> set[int]:
    """The epochs with a complete end-of-epoch checkpoint in ``folder`` (the trainer itself
    needs positions only: this lives with the tests that ask)."""
    return {epoch for epoch, step in checkpoint.positions_in(folder) if step == checkpoint.END}


def test_the_trainer_prefers_idx_files_else_the_digits_offline(tmp_path) -> None:
    """The trainer's own rule (``data.load_agreed``; one rank: no process group needed)."""
    def load(dataset: str, data_dir) -> mnist_data.Dataset:
        return mnist_data.load_agreed(dataset, data_dir, ONE, download=False)

    make_mnist_dir(tmp_path / "MNIST" / "raw")
    ds = load("auto", tmp_path)
    assert ds.name == "mnist" and ds.train_x.shape == (1400, 784) and len(ds.test_y) == 397
    with pytest.raises(RuntimeError, match="--dataset digits"):
        load("mnist", tmp_path / "empty")
    assert load("auto", tmp_path / "empty").name == "digits"


def test_offline_the_fallback_to_the_digits_is_said_once_plainly(tmp_path, monkeypatch,
                                                                 caplog) -> None:
    """No network: one line says MNIST is not reachable and the digits are used; the mirrors'
    URL errors are not shown (``--dataset mnist`` still names them: it asked for MNIST)."""
    def offline(url: str, timeout: float) -> None:
        raise urllib.error.URLError(OSError(-3, "Temporary failure in name resolution"))

    monkeypatch.setattr(mnist_data.urllib.request, "urlopen", offline)
    caplog.set_level(logging.INFO, logger=mnist_data.log.name)
    ds = mnist_data.load_agreed("auto", tmp_path / "data", ONE, download=True)
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert ds.name == "digits" and said == [
        f"MNIST is not reachable and not in {tmp_path / 'data'}: every rank uses the offline "
        "digits"], said
    caplog.clear()
    with pytest.raises(RuntimeError, match="--dataset digits"):
        mnist_data.load_agreed("mnist", tmp_path / "data", ONE, download=True)
    assert "name resolution" in caplog.records[0].getMessage()


def test_the_command_line_is_one_config() -> None:
    """Every flag lands in its field, with TrainConfig's defaults; a value the config refuses
    ends the command as argparse's own errors do (usage, exit 2)."""
    assert parse_config([]) == TrainConfig()
    cfg = parse_config(["--epochs", "3", "--batch-size", "32", "--optimizer", "sgd",
                        "--momentum", "0.5", "--seed", "4", "--data-dir", "d", "--dataset",
                        "digits", "--no-download", "--checkpoint-dir", "c", "--resume",
                        "--checkpoint-every-steps", "7", "--amp", "off", "--timeout", "60"])
    assert cfg == TrainConfig(epochs=3, batch_size=32, optimizer="sgd", momentum=0.5, seed=4,
                              data_dir=Path("d"), dataset="digits", download=False,
                              checkpoint_dir=Path("c"), resume=True, checkpoint_every_steps=7,
                              amp="off", timeout=60.0)
    assert cfg.learning_rate == 0.05 and TrainConfig().learning_rate == 1e-3
    assert parse_config(["--lr", "0.2"]).learning_rate == 0.2
    for bad in (["--batch-size", "0"], ["--checkpoint-every-steps", "-1"], ["--timeout", "0"]):
        with pytest.raises(SystemExit) as exc:
            parse_config(bad)
        assert exc.value.code == 2
    with pytest.raises(ValueError, match="optimizer must be one of adamw, sgd"):
        TrainConfig(optimizer="adam")


@pytest.mark.slow
def test_ddp_trainer_reaches_accuracy_with_identical_params(tmp_path, no_leftovers) -> None:
    code, head = run_head(["run", "--nproc", "2", "--run-dir", "runs", "-m",
                           "ptcluster.examples.mnist", "--dataset", "digits"], cwd=tmp_path,
                          timeout=180)
    job_id, _ = only_run(tmp_path / "runs")
    no_leftovers.append(job_id)
    assert code == 0, head.output()
    final = [line for line in head.lines if line.startswith("[localhost:0] final ")]
    assert len(final) == 1, head.output()
    fields = dict(f.split("=") for f in final[0].split()[2:])
    assert float(fields["test_accuracy"]) >= 0.90, final
    assert fields["world_size"] == "2" and fields["backend"] == "gloo"
    assert float(fields["samples_per_s"]) > 0
    ranks = rank_fields(head.lines)
    assert sorted(ranks) == [0, 1], head.output()
    assert ranks[0]["params_sha256"] == ranks[1]["params_sha256"], ranks
    assert ranks[0]["start_epoch"] == ranks[1]["start_epoch"] == "0"
    epochs = [line for line in head.lines if "epoch " in line and "test_accuracy" in line]
    assert len(epochs) == 5 and all(line.startswith("[localhost:0]") for line in epochs)
    assert end_epochs(tmp_path / "checkpoints") == {3, 4}  # the last two

    # --resume on 2 ranks: both continue after epoch index 4, from the node's newest copy.
    code, head = run_head(["run", "--nproc", "2", "--run-dir", "runs2", "-m",
                           "ptcluster.examples.mnist", "--dataset", "digits", "--epochs", "6",
                           "--resume"], cwd=tmp_path, timeout=180)
    no_leftovers.append(only_run(tmp_path / "runs2")[0])
    assert code == 0, head.output()
    ranks = rank_fields(head.lines)
    assert [ranks[r]["start_epoch"] for r in (0, 1)] == ["5", "5"], ranks
    assert ranks[0]["params_sha256"] == ranks[1]["params_sha256"], ranks
    epochs = {who: [m.group(1) for m in map(EPOCH.search, lines) if m]
              for who, lines in by_rank(head.lines).items()}
    assert {who: e for who, e in epochs.items() if e} == {("localhost", 0): ["6/6"]}, epochs
    assert end_epochs(tmp_path / "checkpoints") == {4, 5}


@pytest.fixture
def plain(tmp_path, monkeypatch):
    """A plain single-process run in tmp_path (no torchrun variables)."""
    monkeypatch.chdir(tmp_path)
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    return tmp_path


def digest(out: str) -> str:
    return re.search(r"rank=0 params_sha256=(\w+)", out).group(1)


def test_resume_continues_at_the_right_epoch(plain, capsys) -> None:
    assert train_main(["--epochs", "4", "--dataset", "digits", "--checkpoint-dir", "whole"]) == 0
    uninterrupted = digest(capsys.readouterr().out)
    assert train_main(["--epochs", "2", "--dataset", "digits"]) == 0
    ckpt = torch.load(plain / "checkpoints" / "checkpoint-1.pt")
    assert ckpt["epoch"] == 1 and ckpt["dataset"] == "digits"
    assert end_epochs(plain / "checkpoints") == {0, 1}
    assert not list((plain / "checkpoints").glob("*.tmp*"))
    capsys.readouterr()
    assert train_main(["--epochs", "4", "--dataset", "digits", "--resume"]) == 0
    out = capsys.readouterr().out
    assert "start_epoch=2" in out  # resumed: epoch 3 (index 2) is the first it runs
    assert "epoch 1/4" not in out and "epoch 2/4" not in out
    assert "epoch 3/4" in out and "epoch 4/4" in out
    # model, optimizer and RNG state all came back: the same result as never stopping
    assert digest(out) == uninterrupted
    assert torch.load(plain / "checkpoints" / "checkpoint-3.pt")["epoch"] == 3
    assert end_epochs(plain / "checkpoints") == {2, 3}


def test_resume_without_checkpoints_starts_fresh(plain, capsys) -> None:
    assert train_main(["--epochs", "1", "--dataset", "digits", "--resume"]) == 0
    out = capsys.readouterr().out
    assert "start_epoch=0" in out and "epoch 1/1" in out


def test_resume_refuses_a_checkpoint_of_another_data_set(plain) -> None:
    assert train_main(["--epochs", "1", "--dataset", "digits"]) == 0
    make_mnist_dir(plain / "data")
    with pytest.raises(ValueError, match="digits.*mnist"):
        train_main(["--epochs", "2", "--no-download", "--resume"])


E = checkpoint.END


@pytest.mark.parametrize(("per_rank", "newest"), [
    ([[(0, E), (1, E)], [(0, E), (1, E)], [(0, E), (1, E)]], (1, E)),
    ([[(0, E), (1, E)], [(0, E)], [(0, E), (1, E)]], (1, E)),  # one node lost its newest copy
    ([[(3, E), (4, E)], [(2, E), (3, E)]], (4, E)),  # one save apart (a kill between two saves)
    ([[], [(0, E), (1, E)]], (1, E)),                # a node lost its disk
    ([[(1, 20), (1, 40)], [(1, 20)]], (1, 40)),      # step checkpoints within an epoch
    ([[(1, 40), (1, E)], [(1, 40), (1, E)]], (1, E)),  # the end of an epoch is after its steps
    ([[(0, E), (1, 10)]], (1, 10)),
    ([[], []], None),                                # no node has any: a fresh start
    ([[]], None),
])
def test_resume_takes_the_newest_position_any_rank_has(per_rank, newest) -> None:
    assert checkpoint.newest(per_rank) == newest


def test_checkpoint_save_is_atomic_and_keeps_the_last_two(tmp_path, monkeypatch) -> None:
    folder = tmp_path / "ckpt"
    previous = None
    for position in [(0, 5), (0, E), (1, 5), (1, E)]:
        checkpoint.save(folder, position, {"p": position}, keep=previous)
        previous = position
    assert checkpoint.positions_in(folder) == {(1, 5), (1, E)}
    assert sorted(p.name for p in folder.iterdir()) == ["checkpoint-1-5.pt", "checkpoint-1.pt"]
    assert end_epochs(folder) == {1}
    checkpoint.save(folder, (0, E), {})  # a fresh run prunes a previous run's newer ones
    assert end_epochs(folder) == {0} and checkpoint.positions_in(folder) == {(0, E)}

    def broken_save(obj, f) -> None:
        f.write(b"half a checkpoint")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="No space"):
        checkpoint.save(folder, (1, E), {}, keep=(0, E))
    assert sorted(p.name for p in folder.iterdir()) == ["checkpoint-0.pt"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_world_of_one_under_torchrun_ends_its_process_group(plain, monkeypatch) -> None:
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "PTCLUSTER_BACKEND": "gloo"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    try:
        assert train_main(["--epochs", "1", "--dataset", "digits"]) == 0
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore:.*GradScaler.*:FutureWarning")  # the old spelling, on purpose
def test_grad_scaler_works_without_torch_amp_grad_scaler(monkeypatch) -> None:
    """torch < 2.3 has no torch.amp.GradScaler (the declared floor is torch 2.1)."""
    monkeypatch.delattr(torch.amp, "GradScaler", raising=False)
    scaler = train_mod.grad_scaler(enabled=False)
    assert not scaler.is_enabled()
    assert isinstance(scaler, torch.cuda.amp.GradScaler)


@pytest.mark.skipif(not hasattr(torch.amp, "GradScaler"), reason="torch < 2.3: no CPU scaler")
def test_the_fp16_loss_scale_is_checkpointed_and_resumed(plain, monkeypatch) -> None:
    """On a GPU with fp16 the GradScaler's state goes into every checkpoint and comes back on
    resume (here: torch's CPU GradScaler in the trainer's place, the same contract)."""
    scalers: list[Any] = []
    original = train_mod.mixed_precision

    def with_scaler(scale: float) -> None:
        def mixed_precision(amp: str, device: torch.device) -> tuple[Any, Any]:
            scalers.append(torch.amp.GradScaler("cpu", init_scale=scale))
            return nullcontext, scalers[-1]
        monkeypatch.setattr(train_mod, "mixed_precision", mixed_precision)

    with_scaler(512.0)  # e.g. where the loss scale had come down to after overflows
    assert train_main(["--epochs", "1", "--dataset", "digits"]) == 0
    assert torch.load(plain / "checkpoints" / "checkpoint-0.pt")["scaler"]["scale"] == 512.0
    with_scaler(2.0 ** 16)  # a fresh run's scale
    assert train_main(["--epochs", "2", "--dataset", "digits", "--resume"]) == 0
    assert scalers[-1].get_scale() == 512.0  # restored, not started over
    assert torch.load(plain / "checkpoints" / "checkpoint-1.pt")["scaler"]["scale"] == 512.0
    # bf16, or CPU: the scaler is off and nothing is kept
    monkeypatch.setattr(train_mod, "mixed_precision", original)
    assert train_main(["--epochs", "3", "--dataset", "digits", "--resume"]) == 0
    assert "scaler" not in torch.load(plain / "checkpoints" / "checkpoint-2.pt")


def test_mnist_idx_path_trains(plain, capsys) -> None:
    make_mnist_dir(plain / "data")
    assert train_main(["--epochs", "3", "--no-download"]) == 0
    out = capsys.readouterr().out
    assert "dataset=mnist" in out
    acc = float(re.search(r"final .*test_accuracy=([\d.]+)", out).group(1))
    assert acc >= 0.85


STEPS, GLOBAL_BATCH = 5, 64


def _steps_on(rank: int, world: int, port: int, out: str) -> None:
    """One rank of a gloo job on loopback: the trainer's own model, optimizer and
    ``run_epoch`` for STEPS global batches of GLOBAL_BATCH; rank 0 saves the parameters."""
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)
    cpu = torch.device("cpu")
    net, opt = train_mod.build(TrainConfig(optimizer="sgd", lr=0.1), cpu)
    ddp = torch.nn.parallel.DistributedDataParallel(net) if world > 1 else net
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(STEPS * GLOBAL_BATCH, 784, generator=g), torch.randint(
        0, 10, (STEPS * GLOBAL_BATCH,), generator=g)
    order = train_mod.epoch_order(len(y), 0, 0, cpu)
    learner = train_mod.Learner(ddp, opt, *train_mod.mixed_precision("off", cpu))
    batches = train_mod.Batches(x, y, order, GLOBAL_BATCH, World(rank, rank, world, cpu, "gloo"))
    _, count, _ = train_mod.run_epoch(learner, batches, range(STEPS), lambda k: False)
    assert count == STEPS * len(range(rank, GLOBAL_BATCH, world))  # 22 or 21 of 64 on 3
    if rank == 0:
        torch.save([p.detach().clone() for p in net.parameters()], out)
    if world > 1:
        dist.destroy_process_group()


@pytest.mark.slow
def test_a_step_is_the_same_step_on_any_world_size(tmp_path) -> None:
    """64 samples a step: 64 on 1 rank, 16 each on 4, and 22+21+21 on 3 (each rank's loss
    weighted by its share): after 5 steps the parameters agree up to float rounding."""
    params = {}
    for world in (1, 3, 4):
        out = str(tmp_path / f"params-{world}.pt")
        torch.multiprocessing.spawn(_steps_on, args=(world, free_port(), out), nprocs=world)
        params[world] = torch.load(out)
    start = train_mod.build(TrainConfig(), torch.device("cpu"))[0]
    for world in (3, 4):
        for a, b, p0 in zip(params[1], params[world], start.parameters(), strict=True):
            assert not torch.equal(a, p0)  # it trained
            torch.testing.assert_close(b, a, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_resume_on_another_world_size_keeps_the_global_batch(tmp_path, no_leftovers) -> None:
    common = ["-m", "ptcluster.examples.mnist", "--dataset", "digits", "--batch-size", "32",
              "--checkpoint-every-steps", "7"]
    code, head = run_head(["run", "--nproc", "2", "--run-dir", "r1", *common, "--epochs", "1"],
                          cwd=tmp_path, timeout=180)
    no_leftovers.append(only_run(tmp_path / "r1")[0])
    assert code == 0, head.output()
    # 2 ranks x 32 = a global batch of 64, 22 steps per epoch: saved at step 7, 14, 21 and 22.
    assert checkpoint.positions_in(tmp_path / "checkpoints") == {(0, 21), (0, checkpoint.END)}

    # 3 ranks share the 64 samples of each step as 22+21+21: it continues in epoch 2.
    code, head = run_head(["run", "--nproc", "3", "--run-dir", "r2", *common, "--epochs", "2",
                           "--resume"], cwd=tmp_path, timeout=180)
    no_leftovers.append(only_run(tmp_path / "r2")[0])
    assert code == 0, head.output()
    ranks = rank_fields(head.lines)
    assert sorted(ranks) == [0, 1, 2] and {r["start_step"] for r in ranks.values()} == {"22"}
    assert len({r["params_sha256"] for r in ranks.values()}) == 1, ranks
    assert "epoch 2/2" in head.output() and "epoch 1/2" not in head.output()

    # 1 rank takes all 64: it continues in epoch 3 with the same steps as 2 ranks would.
    code, head = run_head(["run", "--nproc", "1", "--run-dir", "r3", *common, "--epochs", "3",
                           "--resume"], cwd=tmp_path, timeout=180)
    no_leftovers.append(only_run(tmp_path / "r3")[0])
    assert code == 0, head.output()
    assert rank_fields(head.lines)[0]["start_step"] == "44", head.output()
    assert "epoch 3/3" in head.output() and "epoch 2/3" not in head.output()
