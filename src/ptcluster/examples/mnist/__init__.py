"""The reference DDP trainer: ``ptcluster run -m ptcluster.examples.mnist``."""
