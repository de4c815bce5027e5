"""What a node is (pyinfra's "facts"): its GPUs (NVML), their errors (Xids), its kernel log,
interfaces and addresses, firewall, RDMA devices, NCCL's log, the health gate's checks, and the
facts setup and Slurm read. Read by the node programs (the guard, doctor's and setup's agents,
the sampler, the probe); standard library only, shipped as the programs' parts. This
``__init__`` is the head's (not shipped)."""
