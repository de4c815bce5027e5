"""The job's pure decision core: events in, actions out, on a clock it is given.

``Supervisor.on_event(event, now)`` / ``on_tick(now)`` decide every node's and rank's state
(``states``), restarts (``restart``), hangs (``hang``), stragglers (``straggler``) and the root
cause (``verdict``); the runner performs the ``actions`` and reads the job's state through the
supervisor's own read-only properties (``states.JobState``). Nothing here does I/O, starts a
thread, opens a socket or reads the wall clock: ``tests/unit/test_purity.py`` enforces it. What it
may import: pure standard-library modules (data structures, typing, text; of ``signal`` only its
constants) and, from ptcluster, only ``launch.plan``, ``launch.options``, ``launch.result``,
``node.wire`` and ``node.rank_wire`` (data types and protocol constants), and of those only
names whose own code is pure.
"""
