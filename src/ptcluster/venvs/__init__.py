"""The project's own Python environment on every node (``requirements:``, ``ptcluster venvs``):
resolved once on the head (``resolve``, ``resolved``, ``store``), shipped and built on each node
(``ship``, ``nodes``; the node side is ``node.venv_agent``), used by ``run`` (``runenv``)."""
