from ptcluster.examples.mnist.train import run

run()
