"""``ptcluster push``: a folder of the head's to every node (incremental by content, verified)."""
