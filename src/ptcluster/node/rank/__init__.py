"""Inside a rank: the shim around the user's program, its stack probe, the rank-side API."""
