"""Runs on every rank (shipped as ``-c`` code through the launch path, after
``launch/rank_setup.py``, which defines ``init_distributed`` and ``device_sync``).

argv[1] is a JSON config from the head. Rank 0 reports one record per result
(``rank_setup.report``, never printed).
Timing: warm-ups, then timed iterations between device synchronisations, the time averaged
over ranks. Correctness: a separate pass whose inputs are small integers (exact in every float
type), compared with the exact expected result; mismatches are summed over ranks.
"""

import json
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

# init_distributed, device_sync and report come from launch/rank_setup.py, prepended when
# shipped.


def main() -> int:
    cfg = json.loads(sys.argv[1])
    rank, n, device, backend = init_distributed(cfg.get("timeout", 300))  # type: ignore[name-defined]  # noqa: F821
    dtype = getattr(torch, cfg["dtype"])
    elem = torch.tensor([], dtype=dtype).element_size()

    def sync() -> None:
        device_sync(device)  # type: ignore[name-defined]  # noqa: F821

    def emit(kind: str, data: dict[str, Any]) -> None:
        if rank == 0:
            report(kind, data)  # type: ignore[name-defined]  # noqa: F821

    def pattern(count: int, r: int, offset: int = 0) -> torch.Tensor:
        # small integers: their sums over ranks stay exact in fp16/bf16
        idx = torch.arange(offset, offset + count, device=device)
        return ((idx + r) % 4).to(dtype)

    emit("start", {"world_size": n, "backend": backend, "device": device.type})
    for op in cfg["ops"]:
        if op == "sendrecv" and n < 2:
            emit("skip", {"op": op, "why": "sendrecv needs 2 ranks"})
            continue
        for size in cfg["sizes"]:
            if op in ("all_gather", "reduce_scatter"):
                count = size // (elem * n)
            else:
                count = size // elem
            if count < 1:
                continue
            big = count * n if op in ("all_gather", "reduce_scatter") else count
            send = torch.zeros(big if op == "reduce_scatter" else count, dtype=dtype,
                               device=device)
            recv = torch.zeros(big if op == "all_gather" else count, dtype=dtype, device=device)
            prev, nxt = (rank - 1) % n, (rank + 1) % n

            def run(op: str = op, send: torch.Tensor = send, recv: torch.Tensor = recv,
                    prev: int = prev, nxt: int = nxt) -> None:
                run_op(op, send, recv, prev, nxt)

            for _ in range(cfg["warmup"]):
                run()
            sync()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(cfg["iters"]):
                run()
            sync()
            elapsed = torch.tensor([(time.perf_counter() - t0) / cfg["iters"]],
                                   dtype=torch.float64, device=device)
            dist.all_reduce(elapsed)
            seconds = elapsed.item() / n

            wrong = 0
            for _ in range(cfg["check"]):
                wrong += check(op, send, recv, count, rank, n, pattern, run, cfg.get("corrupt"))
            bad = torch.tensor([wrong], dtype=torch.int64, device=device)
            dist.all_reduce(bad)
            emit("row", {"op": op, "count": count, "type": cfg["dtype"],
                         "redop": "sum" if op in ("all_reduce", "reduce_scatter") else "none",
                         "root": 0 if op == "broadcast" else -1, "seconds": seconds,
                         "wrong": int(bad.item())})

    if cfg.get("pairs"):
        pair_matrix(cfg, rank, device, dtype, elem, sync, emit)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def run_op(op: str, send: torch.Tensor, recv: torch.Tensor, prev: int, nxt: int) -> None:
    if op == "all_reduce":
        dist.all_reduce(send)
    elif op == "all_gather":
        dist.all_gather_into_tensor(recv, send)
    elif op == "reduce_scatter":
        dist.reduce_scatter_tensor(recv, send)
    elif op == "broadcast":
        dist.broadcast(send, src=0)
    else:
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, nxt),
                                       dist.P2POp(dist.irecv, recv, prev)])
        for req in reqs:
            req.wait()


def check(op: str, send: torch.Tensor, recv: torch.Tensor, count: int, rank: int, n: int,
          pattern: Callable[..., torch.Tensor], run: Callable[[], None],
          corrupt: bool | None) -> int:
    """One verified run: returns this rank's number of wrong elements."""
    if op == "all_reduce":
        send.copy_(pattern(count, rank))
        expected = torch.stack([pattern(count, r).double() for r in range(n)]).sum(0)
        run()
        got = send
    elif op == "all_gather":
        send.copy_(pattern(count, rank))
        expected = torch.cat([pattern(count, r).double() for r in range(n)])
        run()
        got = recv
    elif op == "reduce_scatter":
        send.copy_(pattern(count * n, rank))
        expected = torch.stack([pattern(count, r, offset=rank * count).double()
                                for r in range(n)]).sum(0)
        run()
        got = recv
    elif op == "broadcast":
        send.copy_(pattern(count, rank))
        expected = pattern(count, 0).double()
        run()
        got = send
    else:
        send.copy_(pattern(count, rank))
        expected = pattern(count, (rank - 1) % n).double()
        run()
        got = recv
    if corrupt and rank == 0:  # test-only hook: prove #wrong counts real mismatches
        expected = expected.clone()
        expected[0] += 1
    return int((got.double() != expected).sum().item())


def pair_matrix(cfg: dict[str, Any], rank: int, device: torch.device, dtype: torch.dtype,
                elem: int, sync: Callable[[], None],
                emit: Callable[[str, dict[str, Any]], None]) -> None:
    """Ping-pong between the first ranks of every pair of nodes; others wait at the barrier."""
    count = max(1, cfg["pair_size"] // elem)
    buf = torch.ones(count, dtype=dtype, device=device)
    for a, b in cfg["pairs"]:
        dist.barrier()
        if rank not in (a, b):
            continue
        peer = b if rank == a else a
        for i in range(cfg["warmup"] + cfg["iters"]):
            if i == cfg["warmup"]:
                sync()
                t0 = time.perf_counter()
            if rank == a:
                dist.send(buf, peer)
                dist.recv(buf, peer)
            else:
                dist.recv(buf, peer)
                dist.send(buf, peer)
        sync()
        seconds = (time.perf_counter() - t0) / cfg["iters"]
        if rank == a:
            report("pair", {"a": a, "b": b, "bytes": count * elem,  # type: ignore[name-defined]  # noqa: F821
                            "seconds": seconds})


if __name__ == "__main__":
    sys.exit(main())
