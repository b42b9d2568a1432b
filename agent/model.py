"""Plain snapshots of what was observed: the only thing the analysis layers see.

Everything here is immutable data. The sampler fills it from /proc and the
probe; the wait-for graph, the progress tracker and the classifier read it, so
they can be tested from synthetic snapshots without root or BPF.
"""

from __future__ import annotations

import builtins
import functools
import re
from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from .abi import HW

# Linux futex ABI (include/uapi/linux/futex.h): commands after masking the flags, as
# bpf/hangwatch.h declares them for both sides.
FUTEX_WAIT = HW["HW_FUTEX_WAIT"]
FUTEX_LOCK_PI = HW["HW_FUTEX_LOCK_PI"]
FUTEX_WAIT_BITSET = HW["HW_FUTEX_WAIT_BITSET"]
FUTEX_WAIT_REQUEUE_PI = HW["HW_FUTEX_WAIT_REQUEUE_PI"]
FUTEX_LOCK_PI2 = HW["HW_FUTEX_LOCK_PI2"]
FUTEX_CMD_MASK = HW["HW_FUTEX_CMD_MASK"]
# The lock word of a PI futex (not used by the BPF side): owner TID and the waiters bit.
FUTEX_TID_MASK = 0x3FFFFFFF
FUTEX_WAITERS = 0x80000000

WAIT_OPS = frozenset(
    {FUTEX_WAIT, FUTEX_WAIT_BITSET, FUTEX_LOCK_PI, FUTEX_LOCK_PI2, FUTEX_WAIT_REQUEUE_PI}
)
PI_LOCK_OPS = frozenset({FUTEX_LOCK_PI, FUTEX_LOCK_PI2})

OP_NAMES = {
    FUTEX_WAIT: "WAIT",
    FUTEX_LOCK_PI: "LOCK_PI",
    FUTEX_WAIT_BITSET: "WAIT_BITSET",
    FUTEX_WAIT_REQUEUE_PI: "WAIT_REQUEUE_PI",
    FUTEX_LOCK_PI2: "LOCK_PI2",
}


# The label that names a process's distributed job: agent.observe.jobkey makes its value from
# the process's environment, and `hangwatch job` groups a job's ranks by it in Prometheus.
JOB_KEY_LABEL = "job_key"

# The kernel's ceiling for kernel.pid_max (PID_MAX_LIMIT on 64-bit): no PID is larger.
PID_MAX_LIMIT = 1 << 22

# Letters of /proc/PID/task/TID/stat that mean the thread is not on a CPU nor runnable:
# sleeping (S), in uninterruptible sleep (D), an idle kernel thread (I), stopped (T) or
# stopped by a tracer (t). Z and X are dead, R runs or waits for a CPU.
BLOCKED_STATES = frozenset("SDITt")


def is_blocked(state: str) -> bool:
    return state in BLOCKED_STATES


def plural(n: int, noun: str, many: str | None = None) -> str:
    """'1 thread', '9 threads': reasons are read by people."""
    return f"{n} {noun if n == 1 else many or noun + 's'}"


def fd_name(target: str | None, fd: int) -> str:
    """An fd by its /proc/PID/fd link, as evidence names it: "a pipe (fd 3)", "the terminal
    /dev/pts/1", "/var/log/x.log (fd 3)"; a socket, whose peer the link does not say, as
    "a socket (fd 3)"."""
    if target is None:
        return f"fd {fd}"
    if target.startswith("socket:["):
        return f"a socket (fd {fd})"
    if target.startswith("pipe:"):
        return f"a pipe (fd {fd})"
    if target == "anon_inode:[eventfd]":
        return f"an eventfd (fd {fd})"
    if target == "anon_inode:[eventpoll]":
        return f"an epoll set (fd {fd})"
    if target.startswith("anon_inode:"):
        return f"{target[11:].strip('[]')} (fd {fd})"
    if target.startswith(("/dev/pts/", "/dev/tty")):
        return f"the terminal {target}"
    return f"{target} (fd {fd})"


# At most what a name a target chose takes when shown: a file name, a thread's, a function's,
# a socket's path, a line of its source.
NAME_SHOWN_MAX = 1024


def printable(text: str, limit: int | None) -> str:
    """Text a target or anyone but us controls (its comm, thread, file and function names, a
    socket's path, a label value, a server's error message), made safe to show: each character
    that is not printable (control characters, a newline, a bidirectional override: Unicode's
    categories C and Z but the space) as "?", and at most ``limit`` characters (None: the
    caller bounds it). Our report and our log are read in a terminal, and a name must not
    rewrite either (an escape sequence, a line that looks like ours)."""
    out = text if text.isprintable() else "".join(c if c.isprintable() else "?" for c in text)
    return out if limit is None or len(out) <= limit else out[: limit - 1] + "…"


@dataclass(frozen=True)
class SyscallLine:
    """/proc/PID/task/TID/syscall, parsed: the syscall a thread is blocked in and its raw
    arguments (agent.syscalls says what they mean)."""

    nr: int  # -1: blocked, but not in a syscall
    args: tuple[int, ...]
    sp: int | None = None  # user stack pointer
    pc: int | None = None  # user program counter: the instruction after the syscall


@dataclass(frozen=True)
class LockRead:
    """Words at a futex address, read from /proc/PID/mem when the snapshot was taken."""

    word: int
    owner_field: int | None = None  # int at +8: glibc pthread_mutex_t.__owner
    kind_field: int | None = None  # int at +16: glibc pthread_mutex_t.__kind
    users_field: int | None = None  # int at +12: glibc pthread_mutex_t.__nusers


@dataclass(frozen=True)
class FutexWait:
    """A thread blocked in a futex wait."""

    uaddr: int
    op: int  # futex command, flags stripped
    val: int  # the value the waiter expects the word to hold
    since_ns: int | None = None  # CLOCK_MONOTONIC start of the wait, when the probe saw it begin
    vector: bool = False  # futex_waitv: several words, never an owner edge
    source: str = "bpf"  # "bpf" (probe in-flight map) or "proc" (seeded from /proc)

    @property
    def op_name(self) -> str:
        return OP_NAMES.get(self.op, str(self.op))


@dataclass(frozen=True)
class Refusal:
    """A PI lock the kernel refused with EDEADLK: the thread really waits for it."""

    uaddr: int
    ts_ns: int
    lock: LockRead | None = None


@dataclass(frozen=True)
class ThreadSample:
    tid: int
    name: str
    state: str  # the state letter of /proc/PID/task/TID/stat
    cpu_ns: int  # schedstat sum_exec_runtime
    last_ran_ns: int | None = None  # CLOCK_MONOTONIC of se.exec_start: when it last ran
    syscall: int | None = None  # syscall it is blocked in; None when running or unknown
    # Its wait ends by itself (a timeout, a sleep): True; it has none: False; None: unknown
    # (agent.syscalls reads it from the syscall's arguments).
    timed: bool | None = None
    # Its futex wait is process-private (FUTEX_PRIVATE_FLAG): no other process can wake it.
    private_futex: bool | None = None
    wait: FutexWait | None = None
    lock: LockRead | None = None  # re-read at wait.uaddr
    refused: Refusal | None = None
    # The memory mapping that holds its stack pointer (blocked in a syscall): glibc puts a
    # thread's descriptor, whose TID word pthread_join waits on, in that same mapping.
    stack: tuple[int, int] | None = None

    @property
    def blocked(self) -> bool:
        return is_blocked(self.state)

    # When a wait began: two rules, on purpose. The probe dates a wait's start exactly;
    # se.exec_start (last_ran_ns) is the thread's last run, which may come before the wait
    # began (it ran, then waited) but never after, while it still waits.

    @property
    def wait_start_ns(self) -> int | None:
        """When its wait began, as the report gives it: the probe's start, or else (a wait
        seeded from /proc, begun before the probe attached) when the thread last ran."""
        if self.wait is not None and self.wait.since_ns:
            return self.wait.since_ns
        return self.last_ran_ns

    @property
    def quiet_since_ns(self) -> int | None:
        """The earliest that its current wait is known to reach back to: the earlier of the
        probe's start and its last run. A lower bound on how long it has done nothing, for
        park times and wait ages, which must never be overstated."""
        known = [ns for ns in (self.wait.since_ns if self.wait else None, self.last_ran_ns) if ns]
        return min(known) if known else None


# glibc pthread_mutex_t.__kind: type (0-3) | robust 16 | PI 32 | PP 64 | pshared 128 | elision 256/512
_MUTEX_KIND_BITS = 0x3 | 0x10 | 0x20 | 0x40 | 0x80 | 0x100 | 0x200
_GLIBC_CONTENDED = 2  # a glibc lock word with waiters; waiters sleep expecting exactly this


@dataclass(frozen=True)
class Candidate:
    """An owner a thread's lock words name, before the owner is known to be alive."""

    owner: int
    kind: str  # "mutex", "robust-mutex", "pi", "pi-refused", "join"
    uaddr: int


def _plausible_mutex_kind(lock: LockRead) -> bool:
    return lock.kind_field is not None and (lock.kind_field & ~_MUTEX_KIND_BITS) == 0


def owner_candidate(thread: ThreadSample) -> Candidate | None:
    """The owner the lock words name, if their shape is that of a lock with an owner.

    Here rather than in the wait-for graph because the sampler needs it too: it looks up the
    process of a named owner outside the watched ones (Snapshot.foreign_owners). Liveness of
    the named TID is checked by the caller; everything else is here.
    """
    if thread.refused is not None and thread.refused.lock is not None:
        owner = thread.refused.lock.word & FUTEX_TID_MASK
        return Candidate(owner, "pi-refused", thread.refused.uaddr) if owner else None
    wait, lock = thread.wait, thread.lock
    if wait is None or wait.vector or lock is None:
        return None
    if wait.op in PI_LOCK_OPS:
        owner = lock.word & FUTEX_TID_MASK
        return Candidate(owner, "pi", wait.uaddr) if owner else None
    if wait.op not in (FUTEX_WAIT, FUTEX_WAIT_BITSET):
        return None  # WAIT_REQUEUE_PI: a condvar wait; the PI mutex comes later
    if lock.word != wait.val:
        return None  # the word moved on: this waiter is being woken, not blocked by it
    word = lock.word
    if (
        word == _GLIBC_CONTENDED
        and lock.owner_field
        and lock.users_field  # a locked glibc mutex counts its user
        and _plausible_mutex_kind(lock)
    ):
        return Candidate(lock.owner_field, "mutex", wait.uaddr)
    tid_part = word & FUTEX_TID_MASK
    if tid_part and word & FUTEX_WAITERS and lock.owner_field == tid_part:
        return Candidate(tid_part, "robust-mutex", wait.uaddr)  # robust: the word is the TID
    if tid_part and word == tid_part and tid_part != thread.tid:
        # pthread_join waits on the TID word; the graph checks that the word lies in
        # the joined thread's own stack mapping, where glibc keeps its descriptor.
        return Candidate(tid_part, "join", wait.uaddr)
    return None


def candidates(threads: Sequence[ThreadSample]) -> tuple[tuple[int, Candidate], ...]:
    """(TID, the owner its lock words name) of each thread whose words name one."""
    return derived(
        threads,
        "candidates",
        lambda ts: tuple((t.tid, c) for t in ts if (c := owner_candidate(t)) is not None),
    )


@dataclass(frozen=True)
class Listener:
    """A listening TCP socket held by a process."""

    family: str  # "tcp" or "tcp6"
    address: str
    port: int
    queued: int  # connections waiting in the accept queue
    backlog: int


@dataclass(frozen=True)
class Connection:
    """An established TCP connection held by a process (/proc/PID/net/tcp{,6})."""

    local_address: str
    local_port: int
    remote_address: str
    remote_port: int
    inode: int
    rx_queue: int  # bytes received and not yet read
    tx_queue: int  # bytes sent and not yet acknowledged
    # From the kernel's tcp_info (inet_diag netlink, see agent/sources/tcpinfo.py); None when unknown:
    # not read (no connection to judge, another network namespace unreachable, no netlink).
    last_recv_ms: int | None = None  # since data was last received (at the snapshot)
    last_sent_ms: int | None = None  # since data was last sent
    bytes_received: int | None = None  # data bytes received in its life
    bytes_acked: int | None = None  # data bytes it sent that the peer acknowledged

    @property
    def local(self) -> tuple[str, int]:
        """This end, as endpoint() gives it."""
        return _unmapped(self.local_address), self.local_port

    @property
    def remote(self) -> tuple[str, int]:
        """The peer's end, as endpoint() gives it."""
        return _unmapped(self.remote_address), self.remote_port

    def with_times(self, last_recv_ms: int, last_sent_ms: int) -> Connection:
        """The same connection with its last-data times moved on. Copied, not built (a
        front-end's thousand idle connections, every tick): a third of the cost."""
        new = object.__new__(Connection)
        fields = new.__dict__
        fields.update(self.__dict__)
        fields["last_recv_ms"], fields["last_sent_ms"] = last_recv_ms, last_sent_ms
        return new

    def with_tcp_info(self, info: TcpInfo) -> Connection:
        # Built, not dataclasses.replace'd: a front-end's thousand connections, every tick.
        return Connection(
            self.local_address,
            self.local_port,
            self.remote_address,
            self.remote_port,
            self.inode,
            self.rx_queue,
            self.tx_queue,
            info.last_data_recv_ms,
            info.last_data_sent_ms,
            info.bytes_received,
            info.bytes_acked,
        )


@dataclass(frozen=True)
class TcpInfo:
    """What the kernel's tcp_info says of one socket (times in ms before the read; jiffy
    granular, 4 ms at HZ=250)."""

    last_data_recv_ms: int  # tcpi_last_data_recv
    last_data_sent_ms: int  # tcpi_last_data_sent
    bytes_received: int  # tcpi_bytes_received
    bytes_acked: int  # tcpi_bytes_acked


def endpoint(address: str, port: int) -> tuple[str, int]:
    """(address, port) of one end of a connection, IPv4-mapped IPv6 addresses as IPv4: one
    connection, two tables (a socket of tcp6 and its peer's of tcp)."""
    return _unmapped(address), port


@functools.lru_cache(maxsize=4096)
def _unmapped(address: str) -> str:
    # A front-end's thousand connections come from a few addresses, asked of every tick.
    if address.startswith("::ffff:") and "." in address:
        return address[len("::ffff:") :]
    return address


@dataclass(frozen=True)
class WrittenFd:
    """An fd a process holds open for writing to a file, a pipe or a terminal."""

    fd: int
    target: str  # its /proc/PID/fd link
    mtime: float  # wall-clock seconds: when what it points to was last modified


# The kernel's default start of net.ipv4.ip_local_port_range.
DEFAULT_EPHEMERAL_FROM = 32768


@dataclass(frozen=True)
class Plumbing:
    """What a process's environment and command line say about a distributed job's plumbing.

    Read once per process (its environment is the one it was exec'd with): ``MASTER_PORT``
    (the int only; nothing else of the environment is kept) and the ports a launcher's flags
    name (torchrun's ``--master-port``, ``--rdzv-endpoint``).
    """

    master_port: int | None = None  # MASTER_PORT in its environment: a torch.distributed rank
    launcher: str | None = None  # "torchrun" when it is torch's launcher (an elastic agent)
    flag_ports: tuple[tuple[str, int], ...] = ()  # (flag, port) named on its command line
    # Every port its command line names (``--port 8000``, ``--bind 0.0.0.0:8000``, a bare
    # ``8000``): the root's are ports asked for by number, which clients may know.
    named_ports: tuple[int, ...] = ()

    @property
    def ports(self) -> frozenset[int]:
        out = {port for _, port in self.flag_ports}
        if self.master_port is not None:
            out.add(self.master_port)
        return frozenset(out)

    @property
    def distributed(self) -> bool:
        """A rank or a launcher of a distributed job."""
        return self.master_port is not None or self.launcher is not None or bool(self.flag_ports)

    def why(self, port: int) -> str | None:
        """What names ``port`` as plumbing: 'MASTER_PORT', '--rdzv-endpoint', ..."""
        if port == self.master_port:
            return "MASTER_PORT"
        return next((flag for flag, p in self.flag_ports if p == port), None)


@dataclass(frozen=True)
class FrontDoorConfig:
    """What a target's config declares: ``ports`` are the front doors (empty: none)."""

    ports: frozenset[int] = frozenset()


D = TypeVar("D")
T = TypeVar("T")


class Threads(tuple):
    """A process's threads as a sample holds them: a tuple that keeps what is derived from
    it. A process none of whose threads ran is sampled again as the same Threads object
    (agent.observe.sampler), so what the analysis derives from its threads alone is derived
    once, however many ticks the process stays parked (see ``derived``)."""


class Connections(tuple):
    """A process's connections as a sample holds them: a tuple that keeps what is derived
    from it (see ``derived``). A new one each tick (their tcp_info ages), asked the same
    questions by several judges in it: a front-end's thousand are walked once per question."""


def derived(items: Sequence[T], key: Hashable, fn: Callable[[Sequence[T]], D]) -> D:
    """``fn(items)``, kept on ``items`` under ``key`` where they are a Threads or a
    Connections (else computed): ``fn`` must depend on the items alone and on what ``key``
    holds, and ``key`` name ``fn``."""
    memo = getattr(items, "__dict__", None)
    if memo is None:
        return fn(items)
    try:
        value: D = memo[key]
        return value
    except KeyError:
        value = memo[key] = fn(items)
        return value


def thread_ids(threads: Sequence[ThreadSample]) -> tuple[int, ...]:
    return derived(threads, "tids", lambda ts: tuple(t.tid for t in ts))


@dataclass(frozen=True)
class ProcessSample:
    pid: int
    ppid: int
    comm: str
    start_ticks: int  # /proc/PID/stat starttime: tells a reused PID from the old one
    threads: tuple[ThreadSample, ...]
    write_bytes: int | None = None  # /proc/PID/io wchar; None when unreadable
    listeners: tuple[Listener, ...] = ()
    # uaddr -> identity of the word across processes (shared mappings), see sampler
    word_ids: Mapping[int, tuple] = field(default_factory=dict)
    connections: tuple[Connection, ...] = ()  # its established TCP connections
    plumbing: Plumbing = field(default_factory=Plumbing)  # its distributed-job hints
    age_s: float | None = None  # how long ago it started (starttime against the boot clock)
    # Inodes of its sockets that a thread of it is blocked reading (a read or recv on that fd,
    # agent.syscalls.INPUT_READS): it has asked for more of their input and waits for it.
    reading: frozenset[int] = frozenset()
    # Read from storage since it started: /proc/PID/io read_bytes (block reads) and the
    # major faults of /proc/PID/stat (page-ins of mapped files); None when unreadable.
    read_bytes: int | None = None
    major_faults: int | None = None

    def thread(self, tid: int) -> ThreadSample | None:
        for t in self.threads:
            if t.tid == tid:
                return t
        return None


@dataclass(frozen=True)
class Snapshot:
    mono_ns: int  # CLOCK_MONOTONIC when taken
    wall: float  # time.time() when taken
    processes: Mapping[int, ProcessSample]
    gone: frozenset[int] = frozenset()  # watched pids that no longer exist
    # tid -> pid for live threads outside the watched processes that a lock names as owner
    foreign_owners: Mapping[int, int] = field(default_factory=dict)
    # The first port of net.ipv4.ip_local_port_range: ports the kernel hands out for bind(0)
    # and connect() start here.
    ephemeral_from: int = DEFAULT_EPHEMERAL_FROM

    def wall_of(self, mono_ns: int) -> float:
        """time.time() of a CLOCK_MONOTONIC instant, by this snapshot's pair of clocks."""
        return self.wall - (self.mono_ns - mono_ns) / 1e9

    def tid_to_pid(self) -> dict[int, int]:
        out = dict(self.foreign_owners)
        for p in self.processes.values():
            out.update(dict.fromkeys(thread_ids(p.threads), p.pid))
        return out


@dataclass(frozen=True)
class InflightWait:
    """One entry of the probe's in-flight map."""

    tid: int
    tgid: int
    wait: FutexWait


@dataclass(frozen=True)
class ProbeEvent:
    kind: str  # "long-wait" or "edeadlk"
    ts_ns: int
    tgid: int
    tid: int
    uaddr: int
    op: int
    duration_ns: int
    ret: int


@dataclass(frozen=True)
class SocketEvent:
    """A successful bind or listen, reported for every process (they are rare)."""

    kind: str  # "bind" or "listen"
    ts_ns: int  # CLOCK_MONOTONIC
    tgid: int
    tid: int
    fd: int
    family: int  # AF_INET / AF_INET6 (bind only; 0 for listen)
    port: int  # bind only; 0 for listen
    backlog: int  # listen only


@dataclass(frozen=True)
class ExecEvent:
    """An exec, of any process: discovery reads its command line again."""

    ts_ns: int  # CLOCK_MONOTONIC
    tgid: int


@dataclass(frozen=True)
class FdWrites:
    """Writes to one fd of a watched process since it was watched (write, writev, pwrite64,
    sendto, sendmsg, sendmmsg, sendfile, splice)."""

    fd: int
    bytes: int
    calls: int
    last_ns: int  # CLOCK_MONOTONIC of the last write
    # The last bytes of the last write (up to 16; empty where its buffer was not read): how
    # an HTTP answer on a socket ends (agent.analysis.answers).
    tail: builtins.bytes = b""  # (the field `bytes` above shadows the type)
    # Of ``bytes``, those written on TCP connections accepted at a port counted in
    # ProbeReading.door_writes: placed by that port, not by the fd's name.
    door_bytes: int = 0
    # Of ``bytes``, those the kernel saw written to a unix socket (plumbing, wherever the fd
    # went after): counted for processes that accepted a connection.
    unix_bytes: int = 0
    # Of ``bytes``, those written while it was a regular file, and the last one's inode
    # number (0: none): a file written and closed within a tick is still a named file.
    file_bytes: int = 0
    file_ino: int = 0


@dataclass(frozen=True)
class PortWrites:
    """TCP writes of a watched process on the connections it accepted at one local port,
    since it was watched: counted when written, so a connection closed at once still counts."""

    port: int
    bytes: int
    calls: int
    last_ns: int  # CLOCK_MONOTONIC of the last write; 0: none yet


@dataclass(frozen=True)
class ProbeShare:
    """What one watched process lost in the kernel beyond its share of the maps every
    process shares: its evidence is incomplete, and it alone paid for it."""

    entries_refused: int  # threads, fds written or refusals not kept: it held its share
    events_dropped: int  # long waits and EDEADLKs not sent: over its rate, or the ring full


@dataclass(frozen=True)
class ProgramStats:
    """One BPF program's cumulative run time and count (kernel.bpf_stats_enabled)."""

    run_seconds: float
    run_count: int


@dataclass(frozen=True)
class ProbeReading:
    """What the kernel side holds at one instant, as plain data."""

    inflight: Mapping[int, InflightWait] = field(default_factory=dict)  # tid -> wait
    refusals: Mapping[int, tuple[int, int, int]] = field(
        default_factory=dict
    )  # tid -> (tgid, uaddr, ts)
    events: tuple[ProbeEvent, ...] = ()  # drained from the ring buffer since the last read
    wait_histogram: Mapping[int, Mapping[int, int]] = field(
        default_factory=dict
    )  # tgid -> log2 slot -> n
    counters: Mapping[str, int] = field(default_factory=dict)  # summed over CPUs
    socket_events: tuple[SocketEvent, ...] = ()  # drained since the last read
    accepts: Mapping[int, int] = field(default_factory=dict)  # tgid -> accepts since watched
    # tgid -> fd -> writes since watched
    writes: Mapping[int, Mapping[int, FdWrites]] = field(default_factory=dict)
    # tgid -> local port it accepted a TCP connection on -> its writes on such connections
    door_writes: Mapping[int, Mapping[int, PortWrites]] = field(default_factory=dict)
    # TIDs the kernel keeps an entry for (watched processes): forget them once gone
    threads: frozenset[int] = frozenset()
    execs: tuple[ExecEvent, ...] = ()  # drained since the last read
    renamed: tuple[int, ...] = ()  # TIDs of tasks renamed since the last read (not exec'd)
    # tgid -> what each watched process holding entries or sending events lost (ProbeShare)
    shares: Mapping[int, ProbeShare] = field(default_factory=dict)
    # tgid -> (TID, start) of each in-flight wait with a start (from ``inflight``); None:
    # not given, derived from ``inflight`` (see waiting_by_process)
    waiting: Mapping[int, frozenset[tuple[int, int]]] | None = None
    # tgid -> bytes read from regular files since watched (read, pread64, readv, preadv*;
    # pseudo file systems left out): reads the block layer does not see (the page cache,
    # network and FUSE file systems). None: the probe cannot tell a regular file here.
    file_reads: Mapping[int, int] | None = None
    # TID -> polls that found nothing since its entry was made (poll, select, epoll_wait and
    # kin returning 0; a u32 that wraps), for threads of watched processes with an entry.
    # None: the probe does not count them here.
    empty_polls: Mapping[int, int] | None = None
    # TIDs whose futex wait, seen from /proc and begun before the process was watched, the
    # probe marked (ProbeSource.seed) and has not seen end: each is still in that wait.
    seeded: frozenset[int] = frozenset()

    def waiting_by_process(self) -> Mapping[int, frozenset[tuple[int, int]]]:
        if self.waiting is not None:
            return self.waiting
        out: dict[int, set[tuple[int, int]]] = {}
        for w in self.inflight.values():
            if w.wait.since_ns:
                out.setdefault(w.tgid, set()).add((w.tid, w.wait.since_ns))
        return {tgid: frozenset(v) for tgid, v in out.items()}


@dataclass(frozen=True)
class GpuDevice:
    index: int
    uuid: str
    name: str
    memory_total: int  # bytes
    memory_used: int  # bytes
    utilization: float | None  # 0..1, the device's busy share in the driver's last sample period


@dataclass(frozen=True)
class GpuProcessUse:
    """One process on one GPU."""

    gpu: int  # device index
    memory_bytes: int | None  # None: the driver does not say
    sm_utilization: float  # 0..1 over the last sampling window; 0 when it has no sample


@dataclass(frozen=True)
class GpuReading:
    """One read of NVML, as plain data. ``ok`` False: nothing here is evidence of anything."""

    ok: bool
    error: str | None = None  # why not ok, in words
    devices: tuple[GpuDevice, ...] = ()
    processes: Mapping[int, tuple[GpuProcessUse, ...]] = field(default_factory=dict)  # by pid
    errors_total: int = 0  # NVML errors since the source started
    duration_s: float = 0.0


# --- read at report time: Python stacks, fd waits, native callers, lock words --------------
# Not part of a tick's snapshot: agent.observe.enrich reads them once, when a report or the
# daemon's flight record is written, and the analysis and the report take them as data.

_STDLIB = re.compile(r"/lib(?:64)?/python3")


@dataclass(frozen=True)
class PyFrame:
    function: str
    file: str  # as the target sees it
    short: str  # py-spy's short name: "server.py", "uvicorn/server.py"
    line: int
    code: str | None = None  # the source line, when the target could read its file
    code_withheld: str | None = None  # why there is no line (agent.sources.confined's words)

    @property
    def stdlib(self) -> bool:
        """Standard library or interpreter internals: where every wait of a kind looks alike."""
        f = self.file
        if f.startswith("<"):  # <frozen importlib._bootstrap>, <string>
            return True
        # lib64 where sys.platlibdir says so (Fedora, RHEL, SUSE)
        return bool(_STDLIB.search(f)) and "-packages/" not in f


@dataclass(frozen=True)
class PyThread:
    tid: int
    name: str | None
    owns_gil: bool
    frames: tuple[PyFrame, ...]  # innermost first

    def site(self) -> tuple[str | None, PyFrame] | None:
        """(the function it called there, the frame) where the program's own code waits:
        the innermost frame outside the standard library, else the innermost frame."""
        if not self.frames:
            return None
        for i, f in enumerate(self.frames):
            if not f.stdlib:
                return (self.frames[i - 1].function if i else None), f
        return None, self.frames[0]


@dataclass(frozen=True)
class StackRead:
    """One process's Python threads by TID, or why they could not be read."""

    pid: int
    threads: Mapping[int, PyThread] = field(default_factory=dict)
    error: str | None = None
    seconds: float = 0.0


@dataclass(frozen=True)
class SocketPeer:
    """What a socket is, from the tables of its network namespace."""

    kind: str  # "listening" (port), "tcp" (address, port of the peer), "unix" (path)
    port: int = 0
    address: str = ""
    path: str = ""


@dataclass(frozen=True)
class FdLink:
    """One fd a thread waits on: its name from its /proc/PID/fd link, as evidence names fds
    (fd_name), and for a socket the namespace's tables know, its peer."""

    fd: int
    name: str  # "a pipe (fd 3)", "a socket (fd 7)", "fd 9" (the link could not be read)
    peer: SocketPeer | None = None


@dataclass(frozen=True)
class FdWait:
    """The fds of a thread's blocking read, accept, poll, select or epoll_wait: the first
    few, and how many more there are."""

    fds: tuple[FdLink, ...]
    more: int = 0


@dataclass(frozen=True)
class Wanted:
    """What a report asks to be read beyond its snapshot."""

    natives: Collection[tuple[int, int]] = ()  # (pid, tid): its first native caller
    words: Collection[tuple[int, int]] = ()  # (pid, address): what the memory there is
    fds: Collection[int] = ()  # pids whose threads blocked on fds are asked what they wait on


@dataclass(frozen=True)
class Enrichment:
    """Everything a report shows that the snapshot does not hold, read once at report time."""

    stacks: Mapping[int, StackRead] = field(default_factory=dict)  # by pid; absent: not read
    # (pid, tid) -> its first native caller outside libc and the interpreter, in its own
    # names ("`abba_ab` in libabba.so+0x11a9"), for the threads a report asked about
    natives: Mapping[tuple[int, int], str] = field(default_factory=dict)
    fds: Mapping[tuple[int, int], FdWait] = field(default_factory=dict)  # (pid, tid)
    # (pid, address) -> what a futex or lock word is ("`abba_a` in libabba.so+0x40a0")
    words: Mapping[tuple[int, int], str | None] = field(default_factory=dict)
