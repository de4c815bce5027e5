"""Run's node agent, one folder of its concerns: ``agent`` (the program: its lifecycle from hello
to exit), ``link`` (its link to the head: frames in, heartbeats and reports out, the stop state),
``prechecks`` (the ready facts, and the leases the job takes: with ``gpus`` and ``refusal``),
``spawn`` (starting torchrun: its environment, the programs handed to the ranks), ``teardown``,
``rank_server`` (its ranks' output and records), ``outbox`` (its frames to the head),
``progress`` (each rank's progress and stacks, for the head's hang rule), ``schedstat`` (each
rank's time, for the head's straggler rule), ``tmpdirs`` (each job's private directory, under a
parent that is the user's alone) and ``proctree``.

Shipped (``ptcluster.node.GUARD``); this ``__init__`` is not."""
