"""`ptcluster bench`: an nccl-tests-style collective sweep on every rank, plus a node-pair matrix."""
