"""Warm interpreters (``run --warm``): ``protocol`` (the guard<->pool boundary: a pool's key, its
files, the messages and the descriptors they carry), ``pool`` (the pool program the guard hands
on: torch imported, ranks forked on request), ``become`` (what a forked rank does to equal a cold
one) and ``pools`` (this user's pools on a node: listed for ``ps``, ended by ``warm stop``).

Shipped with the guard and as their programs; this ``__init__`` is not."""
