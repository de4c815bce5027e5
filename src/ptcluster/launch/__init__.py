"""Run one job from the head: cluster spec -> :class:`LaunchPlan` -> runner -> result.

``options`` (the knobs) and ``plan`` (pure: per node its argv, env and guard config; a
restart's plan) are the inputs; ``api`` the library's entry points (``prepare``,
``run_rank_program``); ``runner`` runs every attempt (``--wait``, restarts), ``attempt`` one
of them (the event loop); ``runlogs`` the run directory's logs (its layout:
``ptcluster.rundir``); ``result`` the outputs. ``supervise/`` is the pure decision core,
``stacks/`` the stacks reports.
"""

from __future__ import annotations

from ptcluster.launch.plan import LaunchPlan, NodePlan, Target, new_job_id, plan_launch

__all__ = ["LaunchPlan", "NodePlan", "Target", "new_job_id", "plan_launch"]
