"""Run's node agent, one folder of its concerns: ``agent`` (the program: its link to the head,
prechecks, starting torchrun, teardown), ``rank_server`` (its ranks' output and records),
``outbox`` (its frames to the head), ``progress`` (each rank's progress and stacks, for the head's
hang rule), ``schedstat`` (each rank's time, for the head's straggler rule), ``proctree``,
``prechecks`` and ``gpus`` (the node's resources a job holds while its guard lives).

Shipped (``ptcluster.node.GUARD``); this ``__init__`` is not."""
