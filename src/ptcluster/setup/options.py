"""``ptcluster setup``'s inputs beyond the cluster file (the CLI's flags): one frozen dataclass."""

from __future__ import annotations

from dataclasses import dataclass

from ptcluster.setup.wheels import DEFAULT_WHEELHOUSE


@dataclass(frozen=True, kw_only=True)
class SetupOptions:
    dry_run: bool = False
    """Facts and plan only: nothing changes on any node."""
    accept_new_host_keys: bool = False
    """Trust a node's host key the first time it is seen (ssh's accept-new); never a changed one."""
    torch_backend: str = "auto"
    """``auto`` (from the nodes' GPUs and drivers), ``cpu`` or ``cuXYZ``."""
    wheelhouse: str = DEFAULT_WHEELHOUSE
    """Where the head keeps the wheels it downloads for the nodes."""
    timeout: float = 60.0
    """Seconds for a node to answer (connect, facts); commands have their own (long) limits."""
    slurm: bool = False
    """``--slurm``: make the nodes a Slurm cluster (as the cluster file's ``slurm:`` does)."""
    slurm_proof: str = "trainer"
    """``srun`` (sinfo idle, ``srun -N<all>``) or ``trainer`` (that, then the reference trainer
    through ``ptcluster submit``)."""
