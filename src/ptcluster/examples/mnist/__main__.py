import sys

from ptcluster.examples.mnist.train import main

sys.exit(main())
