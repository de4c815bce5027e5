"""The framing every node channel speaks, both ways: one frame per line, ``KIND PAYLOAD``.

Standard library only, and shipped with every program that runs on a node
(``remote.bootstrap``), so the head and its node programs always agree on it. Two shapes of frame:

* control frames: ``KIND JSON`` (``hello``, ``ready``, ``exit``, ``hb``, ``go``, ``stop``, ...);
* text frames for output, cheap at high line rates: ``o RANK TEXT`` and ``e RANK TEXT`` (a
  rank's stdout / stderr line) and ``a TEXT`` (a line of the node program's own child, e.g.
  torchrun's agent). A text frame's payload is never parsed as JSON, so nothing a job prints can
  pass for a control frame.

The first frame of a node program is ``hello {"v": VERSION, "program": ..., "pid": ...,
"time": ...}``; the head refuses a version it does not speak.
"""

import json
import time
from typing import TypedDict

VERSION = 2


class Kind:
    """Every frame kind, both ways, of every node program: the one place they are spelled (a test
    fails on a frame kind written as a bare literal elsewhere)."""

    # every node program
    HELLO = "hello"
    """Node -> head, first: ``{v, program, pid, time}`` (``hello()``)."""
    HB = "hb"
    """Both ways: a heartbeat (the guard's carries ``{t, idle}``)."""
    STOP = "stop"
    """Head -> node: stop what you do and end (the guard tears its job down)."""
    ERROR = "error"
    """Node -> head: the program refused, ``{problem, fix, busy}`` (a guard's also
    ``unhealthy``, ``environment``: one of :data:`ENV_NOT_READY` or "")."""
    EXIT = "exit"
    """Node -> head, last: ``{code, reason}``; the guard's with ``error`` when torchrun itself
    failed (what its ``@record`` wrote: ``TYPE: TEXT``)."""
    # the guard (run's agent)
    READY = "ready"
    """Guard -> head: its prechecks passed; the payload is its ``ReadyFacts``."""
    GO = "go"
    """Head -> guard: start torchrun (``{master_addr, master_port}``)."""
    STARTED = "started"
    """Guard -> head: torchrun started, ``{pid}``."""
    STACKS = "stacks"
    """Head -> guard ``{id, why}``: every rank's stacks; guard -> head ``{id, ranks}``: them."""
    STOPPING = "stopping"
    """Guard -> head: it tears its job down, ``{reason, t, signal, killed_by}``."""
    OUT, ERR, AGENT = "o", "e", "a"
    """Guard -> head, text frames: a rank's stdout and stderr line (``o RANK TEXT``), a line of
    the guard's own child (``a TEXT``: torchrun's agent)."""
    RSTART, REXIT, RERROR, RDATA = "rstart", "rexit", "rerror", "rdata"
    """Guard -> head: a rank's records (``node.rank_wire``)."""
    TIMING = "timing"
    """Guard -> head, every ``timing_every`` s while ranks run: ``{t, ranks, node}``, per rank its
    main thread's ``{span, run, delay, collectives}`` since the last frame and the node's
    ``{mem_available, gpu_util, cpu_throttled}`` (``node.guard.schedstat``; the head's
    ``launch.supervise.straggler`` decides)."""
    XID = "xid"
    """Guard -> head, when the GPU driver wrote an Xid while ranks ran: its ``XidFacts``."""
    # the doctor's facts program
    CONNECT = "connect"
    """Head -> facts: connect to ``{host, port}``; facts -> head: the outcome."""
    BYE = "bye"
    """Head -> facts or setup: finish what was asked, then end."""
    # the monitor's sampler
    SAMPLE = "sample"
    """Sampler -> head: one sample of the node."""
    # setup's agent
    FACTS = "facts"
    """Head -> setup ``{only}``: read these fact sections; setup -> head: the facts. The
    environment's agent sends its platform so, unasked, after ``hello``."""
    RUN = "run"
    """Head -> setup: run one step's command."""
    SUDO = "sudo"
    """Head -> setup: the sudo password (piped to ``sudo -S``; never on a command line)."""
    DONE = "done"
    """Setup -> head: a step's outcome."""
    # the probe of a lost node
    BOOT = "boot"
    """Probe -> head, once: ``{boot_id, uptime, time, guard_alive, kernel}`` (``node.probe``)."""
    # collect's node program
    CKPT = "ckpt"
    """Ckpt-list -> head, once: ``{root, steps, missing?}``, what the node's disk holds of a
    checkpoint directory (``node.ckpt_list``)."""
    # kill's node program
    RESULT = "result"
    """Kill -> head: what was signalled."""
    # the environment's agent (``node.venv_agent``): each asked and answered with its kind
    HAVE = "have"
    """Which of these wheels the node's store holds; whether the environment is there, whole."""
    BLOB = "blob"
    """Head -> venvs ``{sha256, size}`` (push: ``{sha256, size, path, mtime}``), then exactly
    ``size`` raw bytes: one wheel (one data file)."""
    BUILD = "build"
    """Build the environment where it is missing or changed; the outcome."""
    CHECK = "check"
    """The full check (every file's hash, the packages): ``{findings}``."""
    VENVS = "venvs"
    """The user's environments on the node."""
    PRUNE = "prune"
    """Remove the environments no job uses beyond the most recent N and a size cap."""
    # push's agent (``node.data_agent``): ``have`` (which files differ), ``blob``s, then
    RELAY = "relay"
    """Head -> push ``{bind, secret, peer}``: listen for the relay's upstream node; push ->
    head ``{port}`` (or ``{problem}``)."""
    LINK = "link"
    """Head -> push ``{addr, port, secret}``: pass every file on to that node; push -> head
    ``{ok}`` (or ``{problem}``)."""
    STORED = "stored"
    """Head -> push ``{delete}``; push -> head: every file's sha256 as stored now, the files
    that failed (``{files, failed, deleted}``)."""


KILLED_BY = "ended by `ptcluster kill` from {host} ({user})"
"""A guard's ``stopping`` ``killed_by``: who left the kill note it found (``node.sharing.leases``:
only the job's user or root may leave one); the head accepts nothing else there
(``launch.supervise.events``)."""
RANK_FRAMES = {"start": Kind.RSTART, "exit": Kind.REXIT, "error": Kind.RERROR,
               "data": Kind.RDATA}
"""The frame for each rank record kind (``rank_wire.START``, ``EXIT``, ``ERROR``, ``REPORT``)."""
HEARTBEAT_EVERY = 1.0
"""Seconds between a guard's heartbeats on clusters of up to 512 nodes (``GuardConfig``)."""
HEARTBEAT_TIMEOUT = 15.0
"""Seconds a guard waits without a byte from the head before it ends its part of the job."""
STOP_GRACE = 4.0
"""Seconds a guard gives torchrun to end its workers after SIGTERM before SIGKILL."""
MAX_FRAME = 4 << 20
"""The longest frame (one line, in bytes) either end accepts: the head closes a channel whose
node sends a longer one. The largest a node program sends is a guard's ``stacks`` reply, which
it fits under this (``guard.progress.fit_stacks``); the rest are far smaller (setup's step
output is cut at 4000 characters, a rank's output line at 64 KiB)."""


ENV_NOT_READY = ("missing", "changed")
"""A guard's ``error {environment}``: the project's environment the head expected is not there,
or fails the cheap check (``venv_store.env_state``'s words): the head ships and builds it."""

PRIVATE_CWD = "private"
"""``GuardConfig.target["cwd"]`` of shipped code: its ranks start in a private directory."""


JOB_POOL_WITHIN = 60.0
"""Seconds a job's warm pool (``--max-restarts``) waits for the next attempt's guard after the
guard that held it ended with restarts left (``GuardConfig.warm``)."""


class Target(TypedDict, total=False):
    """``GuardConfig.target``: what the ranks run, checked by the guard before the job starts;
    one of the three."""

    script: str
    module: str
    cwd: str
    """``PRIVATE_CWD`` (shipped code: ptcluster's own rank programs): the ranks start in a
    private directory of the guard's, removed with it (SECURITY-REVIEW M3)."""


class WarmConfig(TypedDict, total=False):
    """``GuardConfig.warm`` (``launch.plan.NodePlan.warm_config``)."""

    idle: float
    """The pool's idle seconds (a job's pool: how long it waits for the next attempt)."""
    imports: list[str]
    """``warm_imports``: what the pool imports before it forks."""
    world: int
    """The job's world size."""
    job: str
    """The node's host: the ranks come from the job's own pool (``--max-restarts``)."""


class GuardConfig(TypedDict, total=False):
    """What the head tells a guard (its config line; ``launch.plan.NodePlan.guard_config``)."""

    job_id: str
    argv: list[str]
    """torchrun's command line on this node."""
    env: dict[str, str]
    """The ranks' environment on this node (the head's plan)."""
    env_defaults: dict[str, str]
    """Set where the node has no value of its own."""
    workdir: str
    target: Target
    check_port: int | str | None
    """The master's rendezvous port to lease (``"auto"``: take a free one); None elsewhere."""
    head: str
    command: str
    ranks: list[int]
    """``[first, last]`` global rank on this node."""
    slots: int
    gpus: list[int] | str | None
    interface: str | None
    detect_interface_for: str | None
    """The master's address: the interface is the one routing to it (no ``interface`` set)."""
    heartbeat_timeout: float
    heartbeat_every: float
    grace: float
    output_hold: float
    """Seconds the guard may hold its ranks' output to write it in one go (``guard.outbox``)."""
    leases: bool
    environment: dict[str, str]
    """``{digest, root, torch}``: the project's environment the ranks run in (argv's interpreter is
    its python), checked by the guard before anything starts; absent without one."""
    warm: WarmConfig
    """``run --warm``: the ranks come from this user's warm pool (``node.guard.warm_ranks``);
    with ``job`` (``--max-restarts`` without ``--warm``): from the job's own pool on the node,
    the guard's child, when one is ready (``node.guard.job_pool``); absent: torchrun starts
    them."""
    checkpoints: list[str]
    """Where the job saved its last checkpoint on this node in an earlier attempt: the health
    gate checks that disk as it does the workdir's."""
    """False: the user opted out of leases (``run --no-leases``, unsafe); absent or True: the
    job is refused where the node's lease directory is missing or not root's."""


class GpuClaim(TypedDict, total=False):
    """The GPUs a guard's job holds on its node (``guard.gpus.claim``); {} on a CPU node where
    none was asked for."""

    indices: list[int]
    """Those leased (absent: CUDA_VISIBLE_DEVICES was set already)."""
    visible: str
    """The ranks' CUDA_VISIBLE_DEVICES."""
    why: str
    """How they were chosen."""
    by: str
    """``preset`` (CUDA_VISIBLE_DEVICES was set: nothing leased), ``listed`` (the cluster
    file's ``gpus:``) or ``auto``."""
    skipped: dict[str, str]
    """Auto: the GPUs passed over, as spans, -> who holds them."""
    nvml: bool
    """NVML's compute processes were read."""
    leased: bool
    """False with ``run --no-leases`` (or preset)."""


class ReadyFacts(TypedDict, total=False):
    """What a guard found in its prechecks (its ``ready`` frame), kept per node by the head and
    written to ``summary.json``."""

    hostname: str
    pid: int
    python: str
    time: float
    workdir: str
    subreaper: bool
    subreaper_error: str
    leases_off: str
    """Why this node's leases are off (only ``run --no-leases``); absent when on."""
    master_port: int
    """The master's leased rendezvous port."""
    gpus: GpuClaim
    """The GPUs the job holds here (``guard.gpus.claim``)."""
    interface: str | None
    interface_source: str
    address: str | None
    """This node's address on ``interface``: where peers reach it."""
    torchrun_pid: int
    """Added by the head from the ``started`` frame."""
    warm: bool
    """Added by the head from the ``started`` frame: the node's ranks came from a warm pool."""
    pool: bool
    """Present where the job asks for warm ranks (``run --warm``, a restart's own pool): the
    node has a warm pool for its ranks (a job's own held by this guard; a user's found
    listening, its idle timer not paused). The head's ``go`` says ``warm`` only where every
    node has one (pooled ranks and torchrun's rendezvous do not meet)."""
    rdma: dict[str, str]
    """``NCCL_IB_HCA`` / ``NCCL_IB_GID_INDEX`` as this node's RDMA devices call for them
    (``node.facts.rdma.rdma_env``); the ranks get each one ``env:`` and the node leave unset."""
    torch: str
    nccl: str
    """The versions of torch and of NCCL's wheel in the node's python (absent: not installed);
    the head names it when they differ between nodes."""
    boot_id: str
    """``/proc/sys/kernel/random/boot_id`` at ready: another one after a loss means a reboot."""
    uptime: float
    """Seconds since this node booted, at ready (``time``)."""


class OomVictim(TypedDict, total=False):
    """One process the kernel's OOM killer killed, as its log line says (``guard.machine``)."""

    pid: int
    comm: str
    """Its command name (torch's processes: ``pt_main_thread``)."""
    rss: int
    """Bytes resident when it was killed (anon + file + shmem)."""
    constraint: str
    """``CONSTRAINT_MEMCG``: its memory group's limit; ``CONSTRAINT_NONE``: the node's memory."""
    memcg: str
    """The memory group whose limit was hit (for ``CONSTRAINT_MEMCG``)."""
    main: bool
    """It was the rank's program itself (not one of its children: a DataLoader worker)."""
    tied: str
    """How it was tied to the rank: ``tree`` (the guard saw it among the rank's processes) or
    ``group`` (no look saw it: the same user and the rank's memory group, by the kernel's
    record; less sure)."""


class OomFacts(TypedDict, total=False):
    """What a guard found when a rank failed while the kernel's OOM killer ran (in the rank's
    ``rexit``, ``oom``; ``guard.machine.MachineWatch.after_exit``)."""

    node_kills: int
    """How much the node's OOM-kill count (``/proc/vmstat``) rose since the job started."""
    group_kills: int
    """How much the rank's memory group's count rose since the guard first saw it."""
    group: str
    """That group's folder; ``group_limit``: its limit in bytes (absent: none)."""
    group_limit: int
    log: str
    """Where the guard read the kernel's log (``/dev/kmsg``, ``journalctl -k``); "": nowhere."""
    victims: list[OomVictim]
    """The kernel's victims that were processes of the rank's tree (matched by pid)."""
    oomd: dict[str, str]
    """systemd-oomd killed the rank's control group (or one above it): ``{group, why}`` from
    its journal (no kernel counter rises then)."""
    mem_available: int
    """The node's available and total memory in bytes, at the guard's last look."""
    mem_total: int


class XidFacts(TypedDict, total=False):
    """One Xid the NVIDIA driver wrote while a job ran (``guard.machine``,
    ``node.facts.gpu_errors``): in a ``xid`` frame, and in a failed rank's ``rexit`` (``xids``)
    when it was its own."""

    pci: str
    """The GPU's PCI address (``0000:3b:00``); ``gpu``: its index (absent: not known)."""
    gpu: int | None
    xid: int
    pid: int
    """The process the driver blamed (0: it did not say), its name, and its rank where it was a
    process of one (None: no rank's)."""
    name: str
    rank: int | None
    text: str
    """The driver's own words after the pid and name."""
    meaning: str
    action: str
    """``gpu_errors.ACT_*``: job, watch, reset, reboot, hardware; ``fix``: what to do, in words."""
    fix: str
    fatal: bool
    """It keeps the node out of jobs until the GPU is reset (``gpu_errors.XIDS``)."""
    at: float
    """When (the node's wall clock); ``clock``: the same as HH:MM:SS there."""
    clock: str
    jobs_gpu: bool
    """The GPU is one the job was given on that node."""


class DiskFacts(TypedDict, total=False):
    """The filesystem of a file a rank could not write (ENOSPC, EDQUOT: in its ``rerror``,
    ``disk``; ``guard.disk.disk_facts``)."""

    path: str
    mount: str
    fstype: str
    source: str
    free: int
    """Bytes free for the rank's user, and the size (bytes)."""
    total: int
    full: list["DiskFacts"]
    """No file was named: the node's nearly full filesystems."""


TIMING_EVERY = 2.0
"""Seconds between two ``timing`` frames of a guard that beats every second."""


def timing_every(heartbeat_every: float) -> float:
    """Seconds between two ``timing`` frames of a guard that beats every ``heartbeat_every`` s
    (the head's config: longer on large clusters): one with every second heartbeat."""
    return max(TIMING_EVERY, 2 * heartbeat_every)


def encode(kind: str, payload: object = None) -> bytes:
    """A control frame: ``kind`` plus its JSON payload (``{}`` when None)."""
    body = json.dumps({} if payload is None else payload, separators=(",", ":"))
    return f"{kind} {body}\n".encode()


def encode_text(kind: str, rank: int | None, line: bytes) -> bytes:
    """A text frame for one output line (``line`` without its newline)."""
    if rank is None:
        return kind.encode() + b" " + line + b"\n"
    return f"{kind} {rank} ".encode() + line + b"\n"


def hello(program: str) -> bytes:
    import os

    return encode(Kind.HELLO, {"v": VERSION, "program": program, "pid": os.getpid(),
                            "time": time.time()})


def split(line: str) -> tuple[str, str]:
    """``(kind, payload)`` of one received frame (its newline already removed)."""
    kind, _, payload = line.partition(" ")
    return kind, payload


def control(payload: str) -> dict:
    """The JSON object of a control frame; ``{}`` for an empty payload.

    Raises ``ValueError`` for a payload that is not a JSON object.
    """
    if not payload:
        return {}
    value = json.loads(payload)
    if not isinstance(value, dict):
        raise ValueError(f"control frame payload is not an object: {payload[:80]!r}")
    return value


class Beat(TypedDict, total=False):
    """A guard's heartbeat (``hb``, every ``heartbeat_every`` s; ``guard.link``)."""

    t: float
    """The node's clock."""
    idle: dict[str, float]
    """While ranks run: per rank (as text), seconds since its last progress
    (``guard.progress``); absent where not measured."""


class RankStacks(TypedDict, total=False):
    """One rank in a guard's ``stacks`` frame (``guard.progress.StackProbes.collect``), as
    ``launch.stacks`` parses it."""

    pid: int
    how: str
    """``probe thread`` or ``signal (faulthandler)``."""
    text: str
    """The Python stacks (faulthandler's or the probe thread's)."""
    fr: dict[str, object]
    """The flight recorder's entries (``{cut: why}`` where the frame was too long for them)."""
    ms: float | None
    """Milliseconds the rank took to answer."""
    note: str
    error: str
    """Why no stack came (no probe, not signalled)."""
    pyspy: str
    """py-spy's dump, native frames too (where installed)."""
    pyspy_error: str


class RankTiming(TypedDict):
    """One rank's main thread in a ``timing`` frame (``guard.schedstat.SchedstatMeter.sample``):
    seconds since the guard's last frame."""

    span: float
    run: float
    """On a CPU."""
    delay: float
    """Waiting for a CPU."""
    collectives: int | None
    """Completed meanwhile (None: not known)."""


class NodeTiming(TypedDict, total=False):
    """The node in a ``timing`` frame (``SchedstatMeter.node``): each only when read."""

    mem_available: float | None
    """Share of memory available (0-1)."""
    gpu_util: float | None
    """Mean GPU utilization (%)."""
    cpu_throttled: float | None
    """Highest share of periods a CPU quota throttled the ranks' groups in."""


class NcclChoice(TypedDict, total=False):
    """What NCCL chose on a node (``facts.nccl_log.merge``): the guard's ``exit`` frame's ``nccl``
    (``guard.spawn.nccl_said`` adds ``hcas`` and ``cause``), kept by the head
    (``launch.supervise.events.nccl_chosen``) and said by ``launch.nccl_report``. Where the
    ranks differ, every value seen joined by ``+``."""

    transport: str | None
    hca: str | None
    link: str | None
    sockets: str | None
    gid_index: int | str | None
    """One index; text where the ranks used several."""
    ranks: int | None
    """The ranks that said."""
    hcas: list[str] | None
    """The node's RDMA devices, where NCCL used none of them (the head: None where not said,
    as every key)."""
    cause: str | None
    """Why it likely used sockets (``facts.rdma.fallback_cause``)."""


class GpuSample(TypedDict):
    """One GPU in a sample (``node.sampler``'s ``Gpus.sample``)."""

    index: int
    name: str
    uuid: str | None
    util: float
    mem_used: int
    mem_total: int
    """Bytes."""
    power_w: float | None
    power_limit_w: float | None
    temp_c: float | None


class JobSample(TypedDict):
    """A ptcluster job on the node, any user's, from its leases (``node.sampler.jobs``)."""

    user: str | None
    ranks: int
    gpus: list[int]


class LeaseOwner(TypedDict, total=False):
    """Who takes a lease (a guard, for its job: ``node.guard.prechecks``), kept in its record."""

    job_id: str | None
    head: str | None
    """The head's host."""
    command: str | None
    """What the job runs (``python train.py``)."""
    ranks: list[int] | None
    """``[first, last]`` global rank on the node (its ``job-ID`` lease)."""


class LeaseRecord(LeaseOwner, total=False):
    """A held lease's record as every reader takes it (``node.sharing.leases``' ``take`` writes
    it, ``held_all`` and ``holder`` read it; the sampler sends it, ``ps``, ``kill``, the monitor
    and the metrics read it): :func:`records.well_formed` is its one check, and
    ``records.lease_of`` / ``rank_count`` its one reading. A lease held with no record believed
    is ``{resource, node, unknown: true}`` only (``records.sampled``)."""

    resource: str
    """``job-ID``, ``gpu-3``, ``port-29500``."""
    node: str
    """The hostname of the node that holds it (a lock directory may be shared)."""
    pid: int
    uid: int
    user: str
    """The holder's user name, as the node reads its uid."""
    since: float
    """Seconds since 1970."""
    unknown: bool


class PoolInfo(TypedDict):
    """One warm pool of the sampler's user (``node.warm.pools.listed``), as ``ps`` shows it."""

    pid: int
    rss: int
    """Bytes."""
    idle_since: float | None
    """None: ranks of it run now, or a guard holds it for a run's ranks (``warm.protocol.HOLD``)."""
    ranks: int
    idle: float | None
    """Seconds it stays idle before it ends."""
    torch: str
    python: str
    started: float | None
    job: str | None
    """``JOB@HOST``: the job whose restarts it is kept for; None: the user's own
    (``run --warm``)."""


class PoolStopped(TypedDict):
    """A pool ``warm stop`` signalled (``node.warm.pools.stop``)."""

    pid: int
    gone: bool
    ranks: int


class WarmAnswer(TypedDict):
    """The ``warm`` program's ``result`` (``node.warm.pools.main``): the pools listed, or (with
    ``stop``) those it stopped."""

    pools: list[PoolInfo]
    stopped: list[PoolStopped]


class Sample(TypedDict):
    """What a node's sampler sends every interval (``monitor``, ``ps``, ``monitor --serve``),
    as the head keeps it once checked (``remote.replies.sample_reply``: every key there)."""

    hostname: str
    time: float
    cpu_percent: float
    cpus: int | None
    mem: dict[str, int]
    """``{used, total}`` bytes."""
    net: dict[str, float]
    """``{rx_bps, tx_bps}``: bytes a second over the interval."""
    gpus: list[GpuSample]
    gpu_error: str | None
    leases: list[LeaseRecord]
    """The lease records held on the node (``node.sharing.records``; bad ones dropped)."""
    jobs: dict[str, JobSample]
    user: str
    """The user the sampler runs as."""
    pools: list[PoolInfo]
    """That user's warm pools on the node (``node.warm.pools.listed``)."""
