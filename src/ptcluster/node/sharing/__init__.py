"""Sharing a machine safely with its other users: files written without following a planted link
(``safefile``), the records every lease and head keeps (``records``: one reader and one rule for
them, on the node and the head) and the leases themselves (``leases``: GPUs, ports, a job's
place, held by ``flock``). Standard library only, shipped as the node programs' parts. This
``__init__`` is the head's (not shipped)."""
