"""The trainer's configuration: one frozen :class:`TrainConfig`, built from the command line
by :func:`parse_config` (the flags are the fields' names, ``--no-download`` aside)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

OPTIMIZERS = ("adamw", "sgd")
DATASETS = ("auto", "mnist", "digits")
AMP_MODES = ("auto", "bf16", "fp16", "off")
DEFAULT_LR = {"adamw": 1e-3, "sgd": 0.05}


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    epochs: int = 5
    """Epochs to train in all (a resume continues up to this many)."""
    batch_size: int = 64
    """Samples per rank and step; the global batch (this x the ranks) is kept on a resume, so a
    resume on another number of ranks takes the same steps."""
    optimizer: str = "adamw"
    """``adamw`` or ``sgd``."""
    lr: float | None = None
    """The learning rate; None (or 0): the optimizer's default (:attr:`learning_rate`)."""
    momentum: float = 0.9
    """SGD's momentum (AdamW ignores it)."""
    seed: int = 0
    """Seeds the model's initialization and every epoch's shuffle (the same on every rank)."""
    data_dir: Path = Path("data")
    """Where each node keeps MNIST, relative to its workdir."""
    dataset: str = "auto"
    """``mnist``, ``digits`` (offline), or ``auto``: MNIST when every node has its files (or can
    download them), else the digits everywhere."""
    download: bool = True
    """Whether a node that lacks MNIST may download it (``--no-download``: never touch the
    network)."""
    checkpoint_dir: Path = Path("checkpoints")
    """Where each node keeps its copy of the checkpoints, relative to its workdir."""
    resume: bool = False
    """Continue after the newest checkpoint any node has (a restart of ``ptcluster run
    --max-restarts`` does so by itself)."""
    checkpoint_every_steps: int = 0
    """Also save every this many optimizer steps, not only at the end of every epoch (0: off)."""
    amp: str = "auto"
    """Autocast on GPU: ``bf16``, ``fp16`` (with loss scaling), ``off``, or ``auto`` (bf16 where
    the GPU supports it, else fp16)."""
    timeout: float = 1800.0
    """Seconds a collective may wait for the other ranks."""

    def __post_init__(self) -> None:
        for name, value, allowed in (("optimizer", self.optimizer, OPTIMIZERS),
                                     ("dataset", self.dataset, DATASETS),
                                     ("amp", self.amp, AMP_MODES)):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, not {value!r}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, not {self.batch_size}")
        if self.checkpoint_every_steps < 0:
            raise ValueError("checkpoint_every_steps must be 0 (off) or more, not "
                             f"{self.checkpoint_every_steps}")
        if self.lr is not None and self.lr < 0:
            raise ValueError(f"lr must not be negative, not {self.lr}")
        if self.timeout <= 0:
            raise ValueError(f"timeout must be positive, not {self.timeout}")

    @property
    def learning_rate(self) -> float:
        return self.lr or DEFAULT_LR[self.optimizer]


def parser() -> argparse.ArgumentParser:
    """The flags, with :class:`TrainConfig`'s defaults."""
    d = TrainConfig()
    p = argparse.ArgumentParser(
        prog="python -m ptcluster.examples.mnist",
        description="DDP MNIST, done right. The seed recipe's job, without its bugs.")
    p.add_argument("--epochs", type=int, default=d.epochs)
    p.add_argument("--batch-size", type=int, default=d.batch_size,
                   help="per rank; the global batch (this x the ranks) is kept on a resume")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default=d.optimizer)
    p.add_argument("--lr", type=float, default=d.lr,
                   help="default: 1e-3 for adamw, 0.05 for sgd")
    p.add_argument("--momentum", type=float, default=d.momentum, help="sgd only")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--data-dir", type=Path, default=d.data_dir,
                   help="on each node; relative to its workdir")
    p.add_argument("--dataset", choices=DATASETS, default=d.dataset,
                   help="auto: MNIST when every node has its files (or can download them), "
                        "else digits")
    p.add_argument("--no-download", action="store_true", help="never touch the network")
    p.add_argument("--checkpoint-dir", type=Path, default=d.checkpoint_dir,
                   help="on each node; relative to its workdir")
    p.add_argument("--resume", action="store_true",
                   help="continue after the newest checkpoint any node has (a restart of "
                        "ptcluster run --max-restarts does so by itself)")
    p.add_argument("--checkpoint-every-steps", type=int, default=d.checkpoint_every_steps,
                   metavar="K",
                   help="also save every K optimizer steps, not only every epoch (0: off)")
    p.add_argument("--amp", choices=AMP_MODES, default=d.amp,
                   help="autocast on GPU (auto: bf16 where supported, else fp16)")
    p.add_argument("--timeout", type=float, default=d.timeout,
                   help="seconds a collective may wait for the other ranks")
    return p


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The one translation from the parsed flags. Raises ``ValueError`` (see TrainConfig)."""
    fields = vars(args).copy()
    fields["download"] = not fields.pop("no_download")
    return TrainConfig(**fields)


def parse_config(argv: list[str] | None = None) -> TrainConfig:
    """The command line (``sys.argv[1:]`` when None) as a :class:`TrainConfig`; a value it
    refuses ends the program as argparse's own errors do (usage, exit 2)."""
    p = parser()
    try:
        return config_from_args(p.parse_args(argv))
    except ValueError as exc:
        p.error(str(exc))
