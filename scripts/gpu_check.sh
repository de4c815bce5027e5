#!/usr/bin/env bash
# Every GPU path of ptcluster on this machine's GPUs (the local cluster), one line each:
#   ok: what was seen | FAIL: what went wrong (the log's tail follows) | skip: why not
# For the first time a GPU machine is at hand; on a machine without one every path says
# skip with the reason and the script exits 0. Exit 1 when a path failed.
#   bash scripts/gpu_check.sh            (PYTHON=... to use another interpreter)
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=$(command -v python3)
# absolute (some paths run from a temporary directory), but not resolved: a venv's python is a
# link to the base interpreter, and resolved it would run outside its venv (without torch)
case "$PY" in /*) ;; *) PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")" ;; esac
out=$(mktemp -d)
holder=""
cleanup() {
    if [ -n "$holder" ]; then kill "$holder" 2>/dev/null; wait "$holder" 2>/dev/null; fi
    rm -rf "$out"
}
trap cleanup EXIT
failed=0
say() { printf '%-26s %s\n' "$1" "$2"; }
fail() { say "$1" "FAIL: $2"; failed=1; [ -f "$3" ] && tail -n 15 "$3" | sed 's/^/    /'; }
PATHS="gpu-driver-health local-nproc doctor+nvml bench-nccl bench-predict monitor metrics-dcgm"
PATHS="$PATHS trainer-cuda-bf16 nccl-transport gpus-auto-busy slurm-gres checkpoint-cuda"

if ! command -v nvidia-smi >/dev/null 2>&1; then
    why="no NVIDIA GPU here (nvidia-smi not installed)"
elif ! nvidia-smi -L >"$out/smi" 2>&1 || ! grep -q '^GPU ' "$out/smi"; then
    why="no NVIDIA GPU here (nvidia-smi -L: $(head -n 1 "$out/smi"))"
else
    why=""
fi
if [ -n "$why" ]; then
    for p in $PATHS; do say "$p" "skip: $why"; done
    exit 0
fi
n=$(grep -c '^GPU ' "$out/smi")
say "gpus" "ok: $n ($(sed -n 's/^GPU 0: \([^(]*\).*/\1/p' "$out/smi" | sed 's/ *$//'))"

# check NAME CHECKER CMD...: CMD's JSON (stdout) judged by CHECKER (Python: argv[1] the JSON's
# file, argv[2] the GPU count), which prints the ok line or fails with what it saw
check() {
    local name=$1 checker=$2 code
    shift 2
    "$@" >"$out/$name.json" 2>"$out/$name.err"
    code=$?
    if [ $code -ne 0 ]; then fail "$name" "exit $code" "$out/$name.err"; return; fi
    if "$PY" -c "$checker" "$out/$name.json" "$n" >"$out/$name.line" 2>&1; then
        say "$name" "$(cat "$out/$name.line")"
    else
        fail "$name" "$(tail -n 1 "$out/$name.line")" "$out/$name.json"
    fi
}

# the local cluster: one rank per GPU by default (the head counts its GPUs with node.facts.accel)
check local-nproc '
import json, sys
(node,) = json.load(open(sys.argv[1])); n = int(sys.argv[2])
assert node["env"]["WORLD_SIZE"] == str(n), node["env"]
print(f"ok: {n} ranks by default")
' "$PY" -m ptcluster env --json

# doctor: facts through NVML (ctypes), every check, and the all-reduce over NCCL
# The health gate's GPU driver facts (node.facts.gpu_errors): NVML's counters and PCI addresses on a
# real GPU, checked against nvidia-smi's own; the gate's finding as the guard would give it.
check gpu-driver-health '
import json, sys
r = json.load(open(sys.argv[1])); n = int(sys.argv[2])
assert len(r["state"]) == n and sorted(r["pci"].values()) == list(range(n)), r
assert r["pci"] == r["smi"], (r["pci"], r["smi"])
assert r["finding"]["check"] == "gpu-driver", r["finding"]
s, f = r["state"][0], r["finding"]
ok, what = f["ok"], f["what"]
ecc, remap, pcie, slow = (s.get(k) for k in ("ecc_uncorrected", "remap_pending", "pcie",
                                                 "slowdowns"))
print(f"ok: {n} GPU(s) by PCI address; GPU 0: uncorrectable ECC {ecc}, remap pending {remap}, "
      f"PCIe (width, max, gen, max) {pcie}, slowdowns {slow}; gate ok={ok}: {what}")
' "$PY" -c '
import json, subprocess
from ptcluster.node.facts.gpu_errors import gpu_indices, nvml_state, smi_indices
from ptcluster.node.facts.health import check_gpu_driver
smi = subprocess.run(["nvidia-smi", "--query-gpu=index,pci.bus_id", "--format=csv,noheader"],
                     capture_output=True, text=True).stdout
found = check_gpu_driver({"slots": 1, "workdir": "."})
print(json.dumps({"state": nvml_state(), "pci": gpu_indices(), "smi": smi_indices(smi),
                  "finding": found}))
'

check doctor+nvml '
import json, sys
r = json.load(open(sys.argv[1])); n = int(sys.argv[2])
(node,) = r["nodes"].values()
g = node["facts"]["gpus"]
assert g["source"] == "nvml" and g["count"] == n, g
a = r["allreduce"] or {}
assert a.get("backend") == "nccl" and a.get("wrong") == 0, a
count, name, driver, cuda = g["count"], g["names"][0], g["driver"], g["cuda_driver"]
world, bw = a["world_size"], a["busbw_gbps"]
print(f"ok: NVML sees {count} ({name}, driver {driver}, CUDA {cuda}); all-reduce over NCCL "
      f"on {world} rank(s), 0 wrong, {bw} GB/s")
' "$PY" -m ptcluster doctor --json

# bench: every collective up to 1 GB over NCCL, results checked
check bench-nccl '
import json, sys
r = json.load(open(sys.argv[1]))
rows = r["rows"]
wrong = sum(int(x.get("wrong") or 0) for x in rows)
best = max((float(x.get("busbw") or 0) for x in rows), default=0.0)
assert rows and wrong == 0 and r.get("backend") == "nccl", (len(rows), wrong, r.get("backend"))
print(f"ok: {len(rows)} sizes x ops over NCCL, 0 wrong, best busbw {best:.1f} GB/s")
' "$PY" -m ptcluster bench --op all -e 1G --json

# bench --predict: the reference trainer on CUDA (DDP over NCCL with 2+ GPUs), its buckets and
# batch read by the rank-side probe, ended after 5+10 steps
check bench-predict '
import json, sys
r = json.load(open(sys.argv[1])); n = int(sys.argv[2])
(row,) = r["rows"]; m = r["measured"]
assert row["ranks"] == n and m["batch"] == 64 and m["grad_bytes"] == 407080, (row, m)
assert m["ddp"] is (n > 1) and row["step_s"] > 0, (row, m)
ms, sps, probe = row["step_s"] * 1000, row["samples_per_s"], r["seconds"]["probe"]
k = len(m["buckets"])
print(f"ok: {n} rank(s), {ms:.2f} ms a step, {sps:.0f} samples/s, {k} bucket(s), brief run "
      f"{probe:.1f} s")
' "$PY" -m ptcluster bench --predict --json --steps 10 -- -m ptcluster.examples.mnist \
    --dataset digits --no-download --checkpoint-dir "$out/predict-ckpt"

# monitor: one sample with every GPU's figures
check monitor '
import json, sys
r = json.load(open(sys.argv[1])); n = int(sys.argv[2])
(node,) = r["nodes"]
g = node["sample"]["gpus"]
assert len(g) == n, g
x = g[0]
used, total, util = x["mem_used"] / 1e9, x["mem_total"] / 1e9, x["util"]
power, temp = x.get("power_w"), x.get("temp_c")
print(f"ok: {len(g)} GPU(s): util {util}%, {used:.1f}/{total:.0f} GB, {power} W, {temp} C")
' "$PY" -m ptcluster monitor --once --json

# monitor --serve: every GPU under dcgm-exporter's names and labels, and the dashboard's GPU
# panels answered by a real Prometheus where one is installed (scripts/test.sh installs it)
if "$PY" scripts/gpu_metrics_check.py "$n" >"$out/metrics.log" 2>&1; then
    say "metrics-dcgm" "$(tail -n 1 "$out/metrics.log")"
else
    fail "metrics-dcgm" "$(tail -n 1 "$out/metrics.log")" "$out/metrics.log"
fi

# the reference trainer on CUDA, bf16 autocast, NCCL, one rank per GPU
(cd "$out" && "$PY" -m ptcluster run --run-dir runs -m ptcluster.examples.mnist --epochs 1 \
    --dataset digits --no-download --amp bf16) >"$out/train.log" 2>&1
code=$?
final=$(grep -o 'final .*' "$out/train.log" | head -n 1)
if [ $code -eq 0 ] && echo "$final" | grep -q 'backend=nccl'; then
    say "trainer-cuda-bf16" "ok: $final"
else
    fail "trainer-cuda-bf16" "exit $code, ${final:-no final line}" "$out/train.log"
fi

# what NCCL chose (issue 46): the summary.json of a job that makes one NCCL collective (torch
# starts NCCL at the first collective, and the trainer makes none at world size 1: its summary
# had no `nccl` on one H200) says the transport per node, read from the files NCCL wrote in the
# guard's job directory; NCCL's INFO lines stay off the console
cat >"$out/nccl_job.py" <<'EOF'
import os
import torch
import torch.distributed as dist
dist.init_process_group("nccl")
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
x = torch.ones(1024, device="cuda")
dist.all_reduce(x)
print(f"sum={x[0].item():.0f}", flush=True)
dist.destroy_process_group()
EOF
(cd "$out" && "$PY" -m ptcluster run --run-dir runs-nccl nccl_job.py) >"$out/nccl.log" 2>&1
summary=$(find "$out/runs-nccl" -name summary.json 2>/dev/null | head -n 1)
if [ -z "$summary" ]; then
    fail "nccl-transport" "no summary.json of the NCCL job" "$out/nccl.log"
elif grep -q 'NCCL INFO' "$out/nccl.log"; then
    fail "nccl-transport" "NCCL's INFO lines reached the console" "$out/nccl.log"
elif "$PY" -c '
import json, os, sys
r = json.load(open(sys.argv[1]))
(host, said), = r["nccl"].items()
assert said["transport"] in ("IB", "Socket"), said
hcas = os.listdir("/sys/class/infiniband") if os.path.isdir("/sys/class/infiniband") else []
(node,) = r["nodes"]
told = node.get("rdma")
print(f"ok: {host}: {said}; HCAs here: {hcas or None}; run set {told}")
' "$summary" >"$out/nccl.line" 2>&1; then
    say "nccl-transport" "$(cat "$out/nccl.line")"
else
    fail "nccl-transport" "$(tail -n 1 "$out/nccl.line")" "$out/nccl.log"
fi

# gpus: auto while another process holds GPU 0 (NVML shows it): with one GPU the job is
# refused naming that pid; with more, the ranks get another GPU
"$PY" -c "import time, torch; x = torch.ones(256, 1024, 1024, device='cuda:0'); \
print('held', flush=True); time.sleep(300)" >"$out/holder.log" 2>&1 &
holder=$!
for _ in $(seq 1 60); do grep -q held "$out/holder.log" && break; sleep 1; done
cat >"$out/cvd.py" <<'EOF'
import os
print("cvd=" + os.environ.get("CUDA_VISIBLE_DEVICES", "unset"), flush=True)
EOF
(cd "$out" && "$PY" -m ptcluster run --nproc 1 --run-dir runs-cvd cvd.py) >"$out/cvd.log" 2>&1
code=$?
if ! grep -q held "$out/holder.log"; then
    fail "gpus-auto-busy" "the process meant to hold GPU 0 did not start" "$out/holder.log"
elif [ "$n" -eq 1 ]; then
    if [ $code -ne 0 ] && grep -q "GPU 0 is in use by pid $holder" "$out/cvd.log"; then
        say "gpus-auto-busy" "ok: refused before launch: $(grep -o 'GPU 0 is in use by pid [^)]*)' "$out/cvd.log" | head -n 1)"
    else
        fail "gpus-auto-busy" "exit $code, pid $holder not named" "$out/cvd.log"
    fi
elif [ $code -eq 0 ] && grep -q 'cvd=1$' "$out/cvd.log"; then
    say "gpus-auto-busy" "ok: GPU 0 skipped (pid $holder), the rank got CUDA_VISIBLE_DEVICES=1"
else
    fail "gpus-auto-busy" "exit $code, $(grep -o 'cvd=.*' "$out/cvd.log" | head -n 1)" \
        "$out/cvd.log"
fi
kill "$holder" 2>/dev/null; wait "$holder" 2>/dev/null; holder=""  # GPU 0 free again
# setup --slurm: this machine's facts as setup's node program reads them (NVML, /dev/nvidiaN)
# make a gres.conf and the node's slurm.conf line with its GPUs (Slurm itself is not needed)
check slurm-gres '
import json, sys
r = json.load(open(sys.argv[1])); n = int(sys.argv[2])
assert r["nvml"] and f"AutoDetect=nvml Name=gpu Count={n}" in r["gres"], r
assert f"Gres=gpu:{n} " in r["line"], r
gres, files, line = r["gres"].splitlines()[1], r["files"], r["line"]
print(f"ok: gres.conf {gres!r}; {len(files)} /dev/nvidiaN; {line}")
' "$PY" -c '
import json, os
from ptcluster.cluster.model import SlurmSetupSpec
from ptcluster.node.facts import setup_facts as F
from ptcluster.setup.slurm import slurm_cluster
class Host:
    cfg, sudo_mode, ran = {}, None, {}
    def root_run(self, argv, data=None, timeout=30.0, env=None): return 1, "no root asked"
    def scrub(self, text): return text
facts = {"hostname": os.uname()[1], "gpu": F._gpu(), **F.slurm_fact(Host())}
sc = slurm_cluster(SlurmSetupSpec(controller="here"), {"here": facts}, {"here": "127.0.0.1"}, None)
line = next(x for x in sc.files["slurm.conf"].splitlines() if x.startswith("NodeName="))
print(json.dumps({"nvml": facts["slurm"]["nvml"], "files": facts["slurm"]["gpu_files"],
                  "gres": sc.files.get("gres.conf", ""), "line": line}))
'
# ptcluster.checkpoint with CUDA tensors under NCCL: save (host copy, background DCP write),
# wait, then load into zeroed parameters in place: equal, and still on the GPU
cat >"$out/ckpt_gpu.py" <<'EOF'
import os
import torch
import torch.distributed as dist
import ptcluster.checkpoint as ckpt
dist.init_process_group("nccl")
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
model = torch.nn.Linear(512, 512).cuda()
ckpt.save({"model": model.state_dict()}, 1, dir="ckpt-gpu")
ckpt.wait()
want = {k: v.clone() for k, v in model.state_dict().items()}
with torch.no_grad():
    for p in model.parameters():
        p.zero_()
step = ckpt.load({"model": model.state_dict()}, dir="ckpt-gpu")
now = model.state_dict()
ok = step == 1 and all(torch.equal(now[k], want[k]) and now[k].is_cuda for k in want)
print(f"ckpt step={step} equal_on_gpu={ok}", flush=True)
dist.barrier()
dist.destroy_process_group()
os._exit(0 if ok else 1)
EOF
(cd "$out" && "$PY" -m ptcluster run --nproc 1 --run-dir runs-ckpt ckpt_gpu.py) >"$out/ckpt.log" 2>&1
code=$?
if [ $code -eq 0 ] && grep -q "equal_on_gpu=True" "$out/ckpt.log"; then
    say "checkpoint-cuda" "ok: $(grep -o 'ckpt step=.*' "$out/ckpt.log" | head -n 1)"
else
    fail "checkpoint-cuda" "exit $code" "$out/ckpt.log"
fi
exit $failed
