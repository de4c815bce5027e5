from ptcluster.cli import main

main()
