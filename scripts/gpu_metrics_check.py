"""`monitor --serve` on this machine's GPUs (scripts/gpu_check.sh's ``metrics-dcgm`` path): every
GPU under dcgm-exporter's names with its labels, and, where Prometheus is installed, every GPU
panel of monitoring/grafana-dashboard.json answering with data from a real Prometheus.

    .venv/bin/python scripts/gpu_metrics_check.py GPUS     (prints one line: "ok: ..." or exits 1)
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
DCGM = ("DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE",
        "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_GPU_TEMP")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as r:
        return bytes(r.read())


def scrape(port: int, timeout: float = 60.0) -> dict[str, list]:
    deadline = time.monotonic() + timeout
    while True:
        try:
            text = get(f"http://127.0.0.1:{port}/metrics").decode()
            got: dict[str, list] = {}
            for fam in text_string_to_metric_families(text):
                for s in fam.samples:
                    got.setdefault(s.name, []).append((s.labels, s.value))
            if got.get("ptcluster_node_up") and got["ptcluster_node_up"][0][1] == 1:
                return got
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"FAIL: no answering node on :{port} in {timeout:.0f} s")
        time.sleep(0.5)


def dashboard_gpu_queries() -> list[tuple[str, str]]:
    dash = json.loads((ROOT / "monitoring" / "grafana-dashboard.json").read_text())
    out = []
    for p in dash["panels"]:
        for t in p.get("targets", []):
            expr = t["expr"].replace("$node", ".*").replace("$job_id", ".*")
            if "DCGM_" in expr and "job_id" not in expr:  # (no job runs here)
                out.append((p["title"], expr))
    return out


def with_prometheus(port: int, tmp: Path) -> str:
    binary = shutil.which("prometheus")
    if binary is None:
        return "dashboard not checked (no prometheus here)"
    web = free_port()
    (tmp / "p.yml").write_text("global: {scrape_interval: 1s}\nscrape_configs:\n"
                               f"  - job_name: ptcluster\n    static_configs: "
                               f"[{{targets: ['127.0.0.1:{port}']}}]\n")
    proc = subprocess.Popen([binary, f"--config.file={tmp / 'p.yml'}",
                             f"--storage.tsdb.path={tmp / 'db'}",
                             f"--web.listen-address=127.0.0.1:{web}", "--log.level=warn"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        missing = dict(dashboard_gpu_queries())
        deadline = time.monotonic() + 60
        while missing and time.monotonic() < deadline:
            time.sleep(1)
            for title, expr in list(missing.items()):
                q = urllib.parse.urlencode({"query": expr})
                try:
                    answer = json.loads(get(f"http://127.0.0.1:{web}/api/v1/query?{q}"))
                except OSError:
                    break
                if answer.get("status") == "success" and answer["data"]["result"]:
                    del missing[title]
        if missing:
            raise SystemExit(f"FAIL: dashboard GPU panels without data: {sorted(missing)}")
        return f"{len(dashboard_gpu_queries())} dashboard GPU queries answered by Prometheus"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def main() -> None:
    gpus = int(sys.argv[1])
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        mon = subprocess.Popen([sys.executable, "-m", "ptcluster", "monitor", "--interval", "1",
                                "--serve", f"127.0.0.1:{port}"], cwd=tmp,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               start_new_session=True)
        try:
            got = scrape(port)
            for name in DCGM:
                seen = got.get(name) or []
                if len(seen) != gpus:
                    raise SystemExit(f"FAIL: {name}: {len(seen)} series for {gpus} GPU(s)")
            labels, util = got["DCGM_FI_DEV_GPU_UTIL"][0]
            if not labels.get("UUID", "").startswith("GPU-") or not labels.get("modelName"):
                raise SystemExit(f"FAIL: labels {labels}")
            used = got["DCGM_FI_DEV_FB_USED"][0][1]
            free = got["DCGM_FI_DEV_FB_FREE"][0][1]
            said = with_prometheus(port, Path(tmp))
            print(f"ok: {gpus} GPU(s) as dcgm-exporter names them ({labels['modelName']}, "
                  f"{labels['UUID'][:12]}…: util {util:.0f}%, {used:.0f}/{used + free:.0f} "
                  f"MiB); {said}")
        finally:
            os.killpg(mon.pid, signal.SIGINT)
            mon.wait(timeout=30)


if __name__ == "__main__":
    main()
