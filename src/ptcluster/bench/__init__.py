"""`ptcluster bench`: an nccl-tests-style collective sweep on every rank, and a node-pair
matrix."""
