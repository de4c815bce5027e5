"""The door other terminals use to reach a running head (``ptcluster stacks``, ``kill``,
``monitor``): its request protocol and server (``protocol``), the user's registry of running heads
(``registry``), and ending a job through its head (``kill``)."""
