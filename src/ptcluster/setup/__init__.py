"""``ptcluster setup``: from nodes that take a password to a working cluster, idempotently.

facts (``node.py``, on each node) -> plan (``plan.py``, pure) -> apply (``apply.py``) -> facts
again; the torch build (``torch_choice.py``), the head's wheelhouse (``wheels.py``) and the
password's handling (``secret.py``) are modules of their own.
"""
