"""Doctor: probe every node, check across nodes, finish with a real all-reduce."""
