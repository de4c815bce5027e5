"""Reference jobs that run under ``ptcluster run``."""
