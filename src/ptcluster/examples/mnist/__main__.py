import logging
import os
import sys

from ptcluster.examples.mnist.train import main

code = main()
if "RANK" in os.environ:
    # Under a launcher the process group is destroyed by now, every checkpoint is fsynced, and
    # only the interpreter's own teardown is left: skip it. With gloo it can abort the process
    # (SIGABRT, "terminate called without an active exception") after the work is done: gloo's
    # work objects still holding tensors are destroyed during finalization (pytorch PR 179291).
    # Seen here in about 1 of 10 two-rank runs with step checkpoints; a launcher would report
    # a finished rank as failed.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
sys.exit(code)
