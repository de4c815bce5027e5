"""``bench --predict``'s measurement inside a user's rank (stdlib at import; torch once armed).

The shim arms it in the rank's process when ``PREDICT_VAR`` is set (JSON: ``warmup``, ``steps``),
before the user's program runs; the program is not changed. Through public torch hooks only:

* a step ends when an optimizer's ``step()`` returns (``register_optimizer_step_post_hook``:
  every ``torch.optim.Optimizer``, also under a ``GradScaler``); the first optimizer that steps
  is the one counted;
* the DDP buckets: every ``DistributedDataParallel`` built afterwards gets a comm hook
  (``register_comm_hook``) that notes each bucket's bytes and the moment it is ready, then
  averages it over the ranks as DDP's own path does, and notes when that all-reduce is done. DDP's
  own path divides each gradient by the world size while it copies it into the bucket; a hook gets
  the bucket already copied, so it divides in a scan of its own (``default_hooks.allreduce_hook``
  does too, by ``div_``: on a CPU a third of the values of a division by 3 differ in their last
  bit from DDP's multiplication by 1/3): with a 21 MB gradient on a CPU that scan was ~1 ms of an
  8 ms step (11-17 %, 2026-12-07). The probe times that scan and leaves it out of the step and the
  buckets' moments; on one rank it skips it (a division by 1). Measured after ``warmup`` steps:
  DDP rebuilds its buckets in the order of the first backward;
* without DDP (a one-rank run that does not wrap its model): the buckets DDP would make of the
  optimizer's parameters (reverse order, 1 MiB first, then 25 MiB: DDP's defaults), ready when
  their last gradient is (``register_post_accumulate_grad_hook``);
* samples per step: the first dimension of the first tensor of the first module call of the
  step (DDP's forward, or the model's). A step in which a module ran without autograd (an
  evaluation between epochs) is marked ``eval``: the head leaves it out of the step time.

On a GPU every step ends with ``torch.cuda.synchronize()`` (one sync a step: the step time is
the GPU's, not the launch queue's); the buckets' ready and done moments are still taken on the
CPU, when backward queued them: on a GPU the overlap they show is an upper bound.

After ``warmup + steps`` steps rank 0 sends a ``predict`` record; while the measured steps took
less than ``min_s``, rank 0 says how many more should make it (one ``broadcast_object_list``
between two steps, again after those), and at the end it sends the record again (the head keeps
the last). A job that ends by itself meanwhile sends what it measured when its interpreter
exits (``atexit``, and before ``os._exit``: ``ptcluster.end_rank`` leaves by it). Every rank
ends with exit 0 at the same step (DDP keeps ranks in step; no collective is pending after
``step()``).
"""

import atexit
import json
import os
import sys
import time
from typing import Any, NoReturn, TypedDict

FIRST_BUCKET = 1 << 20
"""DDP's first bucket cap (``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``)."""
BUCKET_CAP = 25 << 20
"""DDP's ``bucket_cap_mb`` default (25 MiB)."""
MAX_STEPS = 5000
"""Most measured steps (however short they are)."""
KEEP_BUCKETS = 20
"""The record keeps the buckets of this many last steps (the others: their times only)."""


class MeasuredStep(TypedDict):
    """One measured step in the ``predict`` record (``steps``: ``bench.predict`` reads them)."""

    step_s: float
    batch: int
    """Its batch's first dimension (0: not seen)."""
    eval: bool
    """It ran without gradients (an evaluation: not a training step)."""
    buckets: list[list[float]] | None
    """``[bytes, ready_s, done_s]`` of each gradient bucket (only the last steps keep them)."""
    ddp: bool


class PredictRecord(TypedDict):
    """What rank 0 sends (``bench.probe`` reads it, checked: ``remote.rank_records``)."""

    kind: str
    """``predict``."""
    world_size: int
    steps: list[MeasuredStep]
    """Every measured step so far (the head keeps the last record)."""


class Probe:
    """Per-step timings of one rank; ``send`` gets the record (rank 0's guard socket);
    ``grad_enabled``: torch's ``is_grad_enabled``; ``sync``: waits for the GPU's queued work;
    ``broadcast``: rank 0's list to every rank (None: one rank, nothing to agree)."""

    def __init__(self, warmup: int, steps: int, send: Any, grad_enabled: Any,
                 sync: Any = None, min_s: float = 0.0, broadcast: Any = None) -> None:
        self.warmup, self.steps, self.send = warmup, steps, send
        self.min_s = min_s
        self.check_at = warmup + steps
        self.extra = False
        self._broadcast = broadcast
        self._grad_enabled = grad_enabled
        self._sync = sync
        self.done = 0
        self.optimizer: object = None
        self.t0 = time.perf_counter()
        self.overhead = 0.0
        """Seconds of this step the probe's own work took (left out of its figures)."""
        self.batch = 0
        self.evaluated = False
        self.ddp = False
        self.buckets: list[list[float]] = []  # [bytes, ready_s, done_s] of this step
        self.params: list[Any] = []  # no DDP: (param, bucket index) order
        self.measured: list[MeasuredStep] = []
        self.sent = 0
        """How many measured steps the last record held."""

    # -- the hooks ---------------------------------------------------------------------------
    def forward_pre(self, module: object, args: tuple[Any, ...]) -> None:
        if not self.evaluated and not self._grad_enabled():
            self.evaluated = True
        if self.batch:
            return
        for arg in args:
            shape = getattr(arg, "shape", None)
            if shape is not None and len(shape) > 0:
                self.batch = int(shape[0])
                return

    def comm_hook(self, state: Any, bucket: Any) -> Any:
        import torch.distributed as dist

        self.ddp = True
        buf = bucket.buffer()
        entry = [float(buf.numel() * buf.element_size()), self._since_start(), 0.0]
        self.buckets.append(entry)
        group = state if state is not None else dist.group.WORLD
        size = dist.get_world_size(group)
        if size > 1:  # (DDP's own path divides while copying into the bucket: not timed)
            began = time.perf_counter()
            buf.mul_(1.0 / size)  # (as DDP's: by the reciprocal; div_ differs in the last bit)
            self.overhead += time.perf_counter() - began
        fut = dist.all_reduce(buf, group=group, async_op=True).get_future()

        def finished(f: Any) -> Any:
            entry[2] = self._since_start()
            return f.value()[0]

        return fut.then(finished)

    def _since_start(self) -> float:
        """Seconds since this step started, less the probe's own work in it."""
        return time.perf_counter() - self.t0 - self.overhead

    def after_step(self, optimizer: object, args: object, kwargs: object) -> None:
        if self.optimizer is None:
            self.optimizer = optimizer
        if optimizer is not self.optimizer:
            return
        if self._sync is not None:
            self._sync()  # a GPU step ends when its kernels do, not when they were queued
        now = self._since_start()
        self.done += 1
        if self.done == 1 and not self.ddp:
            self._watch_params(optimizer)
        if self.done > self.warmup:
            buckets = self.buckets if self.ddp else self._param_buckets()
            self.measured.append({"step_s": now, "batch": self.batch,
                                  "eval": self.evaluated,
                                  "buckets": [[int(b), r, d] for b, r, d in buckets],
                                  "ddp": self.ddp})
        if self.done == self.warmup + self.steps:
            self._send()  # the minimum, in case the job ends before the extra steps
        if self.done == self.check_at:
            more = self._agree(self._extra_steps())  # until min_s is measured: an estimate,
            if more == 0:  # checked again when it is done
                self._finish()
            self.check_at += more
            self.extra = True
        self.buckets = []
        self.batch = 0
        self.evaluated = False
        self.overhead = 0.0
        self.t0 = time.perf_counter()

    # -- no DDP: DDP's buckets, emulated -------------------------------------------------------
    def _watch_params(self, optimizer: Any) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]
                  if p.requires_grad]
        cap, size, index = FIRST_BUCKET, 0, 0
        ready: dict[int, float] = {}
        for p in reversed(params):  # DDP buckets the parameters in reverse order
            self.params.append((p, index))
            size += p.numel() * p.element_size()
            if size >= cap:
                index, size, cap = index + 1, 0, BUCKET_CAP
        for p, i in self.params:
            p.register_post_accumulate_grad_hook(
                lambda _p, i=i: ready.__setitem__(i, time.perf_counter() - self.t0))
        self._ready = ready

    def _param_buckets(self) -> list[list[float]]:
        sizes: dict[int, int] = {}
        for p, i in self.params:
            if p.grad is not None:
                sizes[i] = sizes.get(i, 0) + p.numel() * p.element_size()
        out = [[float(sizes[i]), self._ready.get(i, 0.0), self._ready.get(i, 0.0)]
               for i in sorted(sizes)]
        self._ready.clear()
        return out

    def _extra_steps(self) -> int:
        """Steps to add so that the measured ones last ``min_s`` (a CPU quota's period is
        100 ms: a window of a few short steps would catch a throttled stretch, or none)."""
        train = [m["step_s"] for m in self.measured if not m["eval"]] or [1.0]
        elapsed = sum(m["step_s"] for m in self.measured)
        mean = sum(train[-self.steps:]) / len(train[-self.steps:])  # the latest: warmed up
        if elapsed >= self.min_s or mean <= 0 or len(self.measured) >= MAX_STEPS:
            return 0
        return min(MAX_STEPS - len(self.measured), int((self.min_s - elapsed) / mean) + 1)

    def _agree(self, extra: int) -> int:
        """Rank 0's ``extra`` on every rank (one broadcast, between two steps: outside the
        timed ones), so that every rank ends at the same step."""
        if self._broadcast is None:
            return extra
        box = [extra]
        self._broadcast(box)
        return int(box[0])

    def at_exit(self) -> None:
        """The program ends by itself (its interpreter's exit) before ``min_s`` was measured:
        the steps measured since the last record are sent, so that the head's figure is the
        mean of every step the job ran, not of the first ``steps`` (on a node under a CPU
        quota those may all fall in one period's unthrottled part: 3-4x too fast)."""
        if len(self.measured) > self.sent:
            self._send()

    def _send(self) -> None:
        self.sent = len(self.measured)
        if int(os.environ.get("RANK", "0")) == 0:
            for old in self.measured[:-KEEP_BUCKETS]:
                old["buckets"] = None  # the last steps' buckets are enough, and a record small
            record: PredictRecord = {
                "kind": "predict", "world_size": int(os.environ.get("WORLD_SIZE", "1")),
                "steps": self.measured}
            self.send(record)

    def _finish(self) -> None:
        if self.extra:
            self._send()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(0)


def install(config: str, send: Any) -> Probe:
    """Arm the hooks in this process (torch imported here); the probe."""
    import torch
    from torch.nn.modules.module import register_module_forward_pre_hook
    from torch.optim.optimizer import register_optimizer_step_post_hook

    cfg = json.loads(config)
    def sync() -> None:
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()

    def broadcast(box: list[int]) -> None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(box, src=0)

    probe = Probe(int(cfg["warmup"]), int(cfg["steps"]), send, torch.is_grad_enabled, sync,
                  float(cfg.get("min_s", 0.0)), broadcast)
    register_optimizer_step_post_hook(probe.after_step)
    atexit.register(probe.at_exit)
    leave = os._exit

    def _exit(status: int) -> NoReturn:  # a program that ends by os._exit runs no atexit
        probe.at_exit()  # (ptcluster.end_rank does: gloo's teardown can abort a rank)
        leave(status)

    os._exit = _exit
    register_module_forward_pre_hook(probe.forward_pre)
    ddp = torch.nn.parallel.DistributedDataParallel
    built = ddp.__init__

    def hook(state, bucket):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN202
        # (no annotations: DDP refuses a hook annotated with other types than its own)
        return probe.comm_hook(state, bucket)

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        built(self, *args, **kwargs)
        self.register_comm_hook(self.process_group, hook)

    ddp.__init__ = init  # type: ignore[method-assign]
    return probe
