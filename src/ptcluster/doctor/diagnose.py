"""The doctor, end to end: probe every node -> checks -> a real all-reduce -> report."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ptcluster.cluster.model import ClusterSpec
from ptcluster.doctor import findings as F
from ptcluster.doctor.checks import FAIL, OK, SKIP, Finding, run_checks
from ptcluster.doctor.collect import collect_facts
from ptcluster.doctor.compute import compute_findings
from ptcluster.doctor.health_checks import check_gpu_warnings, check_health
from ptcluster.doctor.node_report import NodeReport
from ptcluster.doctor.rdma_checks import check_rdma
from ptcluster.doctor.slurm_checks import slurm_checks
from ptcluster.launch.api import run_rank_program
from ptcluster.launch.options import RunOptions
from ptcluster.launch.port import resolve_port
from ptcluster.node import ALLREDUCE
from ptcluster.remote.connect import transports
from ptcluster.venvs.runenv import findings as environment_problems
from ptcluster.venvs.ship import Choose


@dataclass(kw_only=True)
class DoctorReport:
    findings: list[Finding]
    probes: dict[str, NodeReport]
    allreduce: dict[str, Any] | None = None
    duration: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def failed(self) -> list[Finding]:
        return [f for f in self.findings if f.status == FAIL]

    @property
    def ok(self) -> bool:
        return not self.failed

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok, "duration_s": round(self.duration, 3),
            "findings": [f.to_json() for f in self.findings],
            "allreduce": self.allreduce,
            "nodes": {h: {"ok": p.ok, "ssh_s": p.ssh_s, "clock_offset_s": p.clock_offset,
                          "problem": None if p.problem is None else p.problem.what,
                          "code": None if p.problem is None else p.problem.code,
                          "facts": p.facts, "connects": p.connects}
                      for h, p in self.probes.items()},
        }


def check_environment(spec: ClusterSpec, choose: Choose) -> list[Finding]:
    """``environment``: every node's project environment against the one resolved for it, by
    every file's hash (``venvs.runenv.findings``): node, package and both versions."""
    problems = environment_problems(spec, choose)
    out = [F.ENVIRONMENT_DIFFERS.of(p) for p in problems]
    bad = {p.who for p in problems}
    return out + [Finding.plain("environment", n.host, OK, "matches the lock, file by file")
                  for n in spec.nodes if n.host not in bad]


def preflight(spec: ClusterSpec, port: int | None = None, timeout: float = 60.0,
              environment: Choose | None = None) -> DoctorReport:
    """The fast checks (everything but the all-reduce); with ``environment``, the project
    environment's full check too."""
    t0 = time.monotonic()
    master_port = resolve_port(spec, port)
    probes = collect_facts(spec, transports(spec), master_port=master_port, timeout=timeout)
    findings = run_checks(spec, probes) + check_health(spec, probes) + \
        check_gpu_warnings(spec, probes)
    findings += check_rdma(spec, probes)
    if spec.slurm_job is not None:
        findings += slurm_checks(spec, probes)
    if environment is not None:
        findings += check_environment(spec, environment)
    return DoctorReport(findings=findings, probes=probes, duration=time.monotonic() - t0)


def diagnose(spec: ClusterSpec, *, port: int | None = None, skip_allreduce: bool = False,
             allreduce_timeout: float = 60.0, probe_timeout: float = 60.0,
             environment: Choose | None = None) -> DoctorReport:
    t0 = time.monotonic()
    report = preflight(spec, port, probe_timeout, environment)
    if not skip_allreduce:
        if report.ok:
            result, finding = run_allreduce(spec, port, allreduce_timeout)
            report.allreduce = result
            report.findings.append(finding)
            if result is not None:
                report.findings += compute_findings(spec, result.get("compute_s") or [])
        else:
            report.findings.append(Finding.plain("all-reduce", spec.nodes[0].host, SKIP,
                                           "skipped: fix the failures above first"))
    report.duration = time.monotonic() - t0
    return report


def run_allreduce(spec: ClusterSpec, port: int | None,
                  timeout: float) -> tuple[dict[str, Any] | None, Finding]:
    """All ranks, the configured backend, through the same launch path as `ptcluster run`."""
    captured: list[dict[str, Any]] = []

    def on_data(host: str, rank: int, data: dict[str, Any]) -> None:
        if data.get("kind") == "allreduce":
            captured.append(data)

    result = run_rank_program(spec, ALLREDUCE, (str(int(timeout / 2)),),
                              port=port, on_data=on_data,
                              options=RunOptions(deadline=timeout, ready_timeout=timeout))
    host = spec.nodes[0].host
    if result.ok and captured:
        data = captured[-1]
        return data, Finding.plain("all-reduce", host, OK,
                             f"{data['world_size']} ranks over {data['backend']}: result "
                             f"verified, {data['bytes'] >> 20} MiB in {data['time_ms']:.1f} ms "
                             f"(busbw {data['busbw_gbps']:.2f} GB/s)")
    rc = result.root_cause
    failed_data = captured[-1] if captured else None
    if failed_data and failed_data.get("wrong"):
        return failed_data, F.ALLREDUCE_WRONG.at(host, wrong=failed_data["wrong"])
    detail = rc.headline() if rc else "the all-reduce did not finish"
    return failed_data, F.ALLREDUCE_FAILED.at(rc.host if rc else host, detail=detail,
                                              run_dir=result.run_dir)
