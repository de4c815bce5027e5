"""Spec -> LaunchPlan -> runner: start, stream, log, tear down, summarise."""

from __future__ import annotations

from ptcluster.launch.plan import LaunchPlan, NodePlan, Target, new_job_id, plan_launch

__all__ = ["LaunchPlan", "NodePlan", "Target", "new_job_id", "plan_launch"]
