"""The job's pure decision core: events in, actions out, on a clock it is given.

``Supervisor.on_event(event, now)`` / ``on_tick(now)`` decide every node's and rank's state
(``states``), restarts (``restart``), hangs (``hang``), stragglers (``straggler``) and the root
cause (``verdict``); the runner performs the ``actions``. Nothing here does I/O, starts a thread,
opens a socket or reads the wall clock: ``tests/test_purity.py`` enforces it.
"""
