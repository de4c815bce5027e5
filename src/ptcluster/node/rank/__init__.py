"""With torch: inside a rank (the shim around the user's program, its stack probe, the rank-side
API, the rank programs), and torchrun's agent program that the guard runs."""
