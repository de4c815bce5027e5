"""Doctor: the facts of every node, checks across nodes, finish with a real all-reduce."""
