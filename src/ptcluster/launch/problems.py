"""Every ``run.*`` problem the head declares, in one table (the reference docs' and the tests'):
the decision core's own (``supervise.verdict``: it may import nothing outside its boundary,
``tests/unit/test_purity.py``), and those of the run's files and reports beside it."""

from ptcluster.launch.lost import TABLE as LOST
from ptcluster.launch.nccl_report import ON_SOCKETS
from ptcluster.launch.runlogs import OPEN_FILES_LIMIT
from ptcluster.launch.supervise.machine_view import TABLE as MACHINE
from ptcluster.launch.supervise.restart import GAVE_UP
from ptcluster.launch.supervise.verdict import TABLE as CORE
from ptcluster.node.guard.warm_ranks import TABLE as WARM
from ptcluster.rundir import RUN_DIR_EXISTS, RUN_DIR_UNWRITABLE

TABLE = (*CORE, *MACHINE, *WARM, *LOST, *GAVE_UP, OPEN_FILES_LIMIT, RUN_DIR_EXISTS,
         RUN_DIR_UNWRITABLE, ON_SOCKETS)
