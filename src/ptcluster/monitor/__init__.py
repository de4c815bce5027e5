"""`ptcluster monitor`: a live view of every node (GPU via NVML, CPU, RAM, network, jobs)."""
