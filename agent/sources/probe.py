"""The only module that talks to bcc: compile bpf/*.bpf.c, attach, read maps.

Everything it returns is plain data (agent.model.ProbeReading, agent.model.ProgramStats), so
nothing above this module needs root, bcc or a kernel to be tested.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import platform
import re
import struct
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from ..abi import BPF_DIR, HEADER, header_defines
from ..errors import KernelFeatureError
from ..model import (
    ExecEvent,
    FdWrites,
    FutexWait,
    InflightWait,
    PortWrites,
    ProbeEvent,
    ProbeReading,
    ProbeShare,
    ProgramStats,
    SocketEvent,
)
from ..settings import LONG_WAIT_S
from .btf import fd_walk_flags
from .procfs import ProcFS

FALLBACK_HEADERS = "/usr/src/hangwatch-kernel-headers"

# The one BPF object, in this order: maps and helpers first, then the program files that use
# them. Joined as one text rather than #included, because bcc rewrites map calls
# (watched.lookup(...)) only in its main file; see bpf/maps.bpf.h.
BPF_SOURCES = ("maps.bpf.h", "futex.bpf.c", "io.bpf.c", "exec.bpf.c")

# Tracepoints compiled in only where the kernel has them: syscall -> -D flag.
OPTIONAL_SYSCALLS = {
    "futex_wait": "HAVE_FUTEX_WAIT",
    "futex_waitv": "HAVE_FUTEX_WAITV",
    "bind": "HAVE_BIND",
    "listen": "HAVE_LISTEN",
    "accept": "HAVE_ACCEPT",
    "accept4": "HAVE_ACCEPT4",
    "write": "HAVE_WRITE",
    "writev": "HAVE_WRITEV",
    "pwrite64": "HAVE_PWRITE64",
    # Answers sent without write(2): Python's socket.send/sendall, asyncio's transports.
    "sendto": "HAVE_SENDTO",
    "sendmsg": "HAVE_SENDMSG",
    "sendmmsg": "HAVE_SENDMMSG",
    "sendfile64": "HAVE_SENDFILE64",
    "splice": "HAVE_SPLICE",
    # Reads of regular files (compiled in with the offsets of FD_WALK only).
    "read": "HAVE_READ",
    "pread64": "HAVE_PREAD64",
    "readv": "HAVE_READV",
    "preadv": "HAVE_PREADV",
    "preadv2": "HAVE_PREADV2",
    # Polls that found nothing (their exits only): a poll loop's spin, told from work.
    "poll": "HAVE_POLL",
    "ppoll": "HAVE_PPOLL",
    "select": "HAVE_SELECT",
    "pselect6": "HAVE_PSELECT6",
    "epoll_wait": "HAVE_EPOLL_WAIT",
    "epoll_pwait": "HAVE_EPOLL_PWAIT",
    "epoll_pwait2": "HAVE_EPOLL_PWAIT2",
}
# Other tracepoints compiled in only where the kernel has them: (category, name) -> -D flag.
OPTIONAL_TRACEPOINTS = {
    ("sched", "sched_process_exec"): "HAVE_SCHED_PROCESS_EXEC",
    ("task", "task_rename"): "HAVE_TASK_RENAME",
}

STATS_SYSCTL = Path("/proc/sys/kernel/bpf_stats_enabled")
# Ring-buffer records held in memory between two reads; beyond, they count as dropped.
MAX_PENDING_EVENTS = 65536
# bpf(2) BPF_ENABLE_STATS (Linux 5.8): stats stay on while the returned fd is open.
SYS_BPF = {"x86_64": 321, "aarch64": 280}
BPF_ENABLE_STATS = 32
BPF_STATS_RUN_TIME = 0


def bpf_text(bpf_dir: Path | None = None) -> str:
    """BPF_SOURCES as one program; #line keeps compiler errors naming the real file.

    (Line numbers after a TRACEPOINT_PROBE run a few lines late: bcc inserts the
    tracepoint's argument struct above it before compiling.)
    """
    parts = []
    for name in BPF_SOURCES:
        path = (bpf_dir or BPF_DIR) / name
        parts.append(f'#line 1 "{path}"\n{path.read_text()}')
    return "\n".join(parts)


def kernel_headers() -> str | None:
    """Where bcc finds kernel headers: explicit, the running kernel's, or setup's merged tree."""
    explicit = os.environ.get("BCC_KERNEL_SOURCE")
    if explicit:
        if not os.path.isdir(explicit):
            raise KernelFeatureError(
                f"no kernel headers at BCC_KERNEL_SOURCE={explicit}",
                "point it at a kernel header tree, or unset it to use the running kernel's",
            )
        return explicit
    own = f"/lib/modules/{os.uname().release}/build"
    if os.path.isdir(own):
        return own
    return FALLBACK_HEADERS if os.path.isdir(FALLBACK_HEADERS) else None


def _program_name(func_name: bytes) -> str:
    """b"tracepoint__syscalls__sys_enter_futex" -> "sys_enter_futex": what it attaches to."""
    return func_name.decode().rsplit("__", 1)[-1]


def watched_words(pid_max: int) -> int:
    """Words of the watched-process bitmap: one bit per possible PID (64-bit words)."""
    return pid_max // 64 + 1


def _by_tid(table: Any) -> list[tuple[int, Any]]:
    """(TID, value) for every entry of a map keyed by u32, in batches where the kernel
    allows it (5.6+), else one by one (two syscalls per entry: slow with many threads)."""
    try:
        return [(int(k), v) for k, v in table.items_lookup_batch()]
    except Exception:  # bcc raises bare Exception when the kernel refuses batch ops
        return [(k.value, v) for k, v in table.items()]


# The fields read of each map keyed by TID, in their order in bpf/hangwatch.h.
THREAD_FIELDS = {
    "threads": ("start_ns", "uaddr", "tgid", "op", "val", "syscall", "flags", "empty_polls"),
    "pi_ops": ("start_ns", "uaddr", "refused_ns", "tgid", "op"),
    "refusals": ("ts_ns", "uaddr", "tgid"),
}

# struct module codes of the ctypes scalars the maps' fields are made of
_CODES = {
    ctypes.c_uint8: "B", ctypes.c_uint16: "H", ctypes.c_uint32: "I", ctypes.c_uint64: "Q",
    ctypes.c_int8: "b", ctypes.c_int16: "h", ctypes.c_int32: "i", ctypes.c_int64: "q",
    ctypes.c_ulong: "Q", ctypes.c_long: "q", ctypes.c_uint: "I", ctypes.c_int: "i",
}  # fmt: skip


def _layout(ctype: Any, fields: tuple[str, ...]) -> struct.Struct:
    """A struct that unpacks ``fields`` (in that order) of one ``ctype`` (a bcc map's key
    or leaf), skipping the rest: built from ctypes' own offsets, so it follows the C."""
    if not fields:  # a scalar key or leaf
        return struct.Struct("=" + _CODES[ctype])
    types = dict(ctype._fields_)
    placed = sorted((getattr(ctype, name).offset, name) for name in fields)
    if [name for _, name in placed] != list(fields):
        raise ValueError(f"fields {fields} not in their order in the struct")
    fmt, pos = "=", 0
    for offset, name in placed:
        code = _CODES[types[name]]
        fmt += f"{offset - pos}x{code}"
        pos = offset + struct.calcsize("=" + code)
    return struct.Struct(fmt + f"{ctypes.sizeof(ctype) - pos}x")


class BatchReader:
    """Every entry of a hash map, as tuples of plain ints: BPF_MAP_LOOKUP_BATCH into buffers
    allocated once, decoded by one struct per entry. bcc's items_lookup_batch allocates
    and zeroes buffers for the map's whole capacity on each call (3 MiB for 65,536 threads)
    and yields a ctypes object per field read; the daemon reads the thread map every tick."""

    CHUNK = 4096  # entries per batch call

    def __init__(self, table: Any, leaf_fields: tuple[str, ...]):
        from bcc.libbcc import lib  # bcc's own binding of libbpf's bpf_map_lookup_batch

        self._lib = lib
        self._fd = table.map_fd
        self._keys = (table.Key * self.CHUNK)()
        self._leaves = (table.Leaf * self.CHUNK)()
        self._key = _layout(table.Key, ())
        self._leaf = _layout(table.Leaf, leaf_fields)
        if (
            self._key.size != ctypes.sizeof(table.Key)
            or len(self._key.unpack(bytes(self._key.size))) != 1
        ):
            raise ValueError("a scalar key only")
        self._raw: list[bytes] = []  # the last call's buffers, to tell an unchanged map
        self._rows: list[tuple[int, tuple[int, ...]]] = []

    def rows(self) -> list[tuple[int, tuple[int, ...]]]:
        """(the key, as an int, the leaf's fields) of every entry now, for a map with a
        scalar key; the very list of the last call where not a byte of the map changed (a
        pool parked since the last tick). OSError if the kernel refuses."""
        raw: list[bytes] = []
        batch, count = ctypes.c_uint32(0), ctypes.c_uint32(0)
        first = True
        keys = memoryview(self._keys).cast("B")
        leaves = memoryview(self._leaves).cast("B")
        while True:
            count.value = self.CHUNK
            res = self._lib.bpf_lookup_batch(
                self._fd,
                None if first else ctypes.byref(batch),
                ctypes.byref(batch),
                ctypes.byref(self._keys),
                ctypes.byref(self._leaves),
                ctypes.byref(count),
            )
            err = ctypes.get_errno()
            n = count.value
            if n:
                raw += (bytes(keys[: n * self._key.size]), bytes(leaves[: n * self._leaf.size]))
            if res != 0:
                if err != errno.ENOENT:
                    raise OSError(err, os.strerror(err))
                break  # the last batch
            first = False
        if raw == self._raw:
            return self._rows
        out: list[tuple[int, tuple[int, ...]]] = []
        for k, v in zip(raw[::2], raw[1::2]):
            out.extend(
                zip(
                    (key for (key,) in self._key.iter_unpack(k)),
                    self._leaf.iter_unpack(v),
                )
            )
        self._raw, self._rows = raw, out
        return out


def _enable_stats_fd() -> int | None:
    """BPF_ENABLE_STATS: an fd that keeps run-time stats on; the kernel undoes it on close,
    even if we die without cleaning up. None where the syscall is unknown or refused."""
    nr = SYS_BPF.get(platform.machine())
    if nr is None:
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    attr = ctypes.c_uint32(BPF_STATS_RUN_TIME)  # union bpf_attr { struct { __u32 type; } }
    fd = libc.syscall(nr, BPF_ENABLE_STATS, ctypes.byref(attr), ctypes.sizeof(attr))
    return fd if fd >= 0 else None


# Mappings of the compiler bcc links in: used only to build the object, then dead weight.
COMPILER_LIBS = ("libLLVM", "libclang")
MADV_PAGEOUT = 21  # Linux 5.4


def release_compiler_memory(proc: ProcFS) -> None:
    """Give back what compiling the programs left behind: the heap LLVM freed (malloc_trim)
    and the compiler's code pages (MADV_PAGEOUT: dropped, read back from the library file
    if ever needed again). Compiling leaves the daemon at ~140 MB RSS, ~100 MB of it this;
    where the kernel or libc lacks either call, nothing happens."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.malloc_trim(0)
        madvise = libc.madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    except (OSError, AttributeError):
        return
    for m in proc.maps("self"):
        if any(lib in m.path for lib in COMPILER_LIBS):
            madvise(m.start, m.end - m.start, MADV_PAGEOUT)  # EINVAL before 5.4: harmless


def _once(undo: Callable[[], object]) -> Callable[[], None]:
    """``undo`` on the first call only: closing the stats fd twice could close another fd."""
    done = False

    def run() -> None:
        nonlocal done
        if not done:
            done = True
            undo()

    return run


def _check_map_sizes(map_sizes: dict[str, int]) -> None:
    for name, size in map_sizes.items():
        if not re.fullmatch(r"MAX_[A-Z_]+", name) or not 0 < size <= 1 << 24:
            raise ValueError(f"bad map size {name}={size}")


def _bcc() -> Any:
    """bcc's BPF class, with the kernel headers it compiles against set (BCC_KERNEL_SOURCE)."""
    try:
        from bcc import BPF  # only this module imports bcc
    except ImportError as e:
        raise KernelFeatureError(
            "bcc is not importable",
            "install the distribution's python3-bpfcc (make setup does), and run with a "
            "Python that sees system site packages",
        ) from e
    headers = kernel_headers()
    if headers is None:
        raise KernelFeatureError(
            f"no kernel headers for {os.uname().release}",
            f"install linux-headers-{os.uname().release}, or run `make setup` to build the "
            f"merged fallback at {FALLBACK_HEADERS}",
        )
    os.environ["BCC_KERNEL_SOURCE"] = headers
    return BPF


def optional_flags(bpf_class: Any) -> list[str]:
    """The -D flags of the optional tracepoints this kernel has (the others are left out)."""
    flags = []
    for name, flag in OPTIONAL_SYSCALLS.items():
        if all(
            bpf_class.tracepoint_exists("syscalls", f"sys_{side}_{name}")
            for side in ("enter", "exit")
        ):
            flags.append(f"-D{flag}")
    for (category, event), flag in OPTIONAL_TRACEPOINTS.items():
        if bpf_class.tracepoint_exists(category, event):
            flags.append(f"-D{flag}")
    return flags


class KernelProbes:
    """All of hangwatch's BPF programs in one object, attached for as long as it lives
    (use as a context manager): futex waits, bind/listen, accepts and writes."""

    def __init__(
        self,
        long_wait_s: float = LONG_WAIT_S,
        ringbuf_pages: int = 64,
        host_ringbuf_pages: int = 64,
        bpf_dir: Path | None = None,
        map_sizes: dict[str, int] | None = None,
        proc: ProcFS | None = None,
    ) -> None:
        """``long_wait_s``: waits longer than this go through the ring buffer (compiled in as
        LONG_WAIT_NS); ``ringbuf_pages`` sizes their ring buffer, ``host_ringbuf_pages`` that
        of binds and listens. ``map_sizes`` overrides the entry limits of bpf/maps.bpf.h by name
        (``{"MAX_THREADS": 8}``): how tests fill a map on purpose. ``proc`` is where
        pid_max, thread liveness and the programs' fdinfo are read."""
        bpf_dir = bpf_dir or BPF_DIR
        self._proc = proc or ProcFS()
        _check_map_sizes(map_sizes or {})
        bpf_class = _bcc()
        self._defs = header_defines(bpf_dir / HEADER)
        settings = [
            f"-I{bpf_dir}",
            f"-DLONG_WAIT_NS={int(long_wait_s * 1e9)}ULL",
            f"-DRINGBUF_PAGES={ringbuf_pages}",
            f"-DHOST_RINGBUF_PAGES={host_ringbuf_pages}",
            f"-DWATCHED_WORDS={watched_words(self._proc.pid_max())}",
            *(f"-D{name}={size}" for name, size in (map_sizes or {}).items()),
        ]
        optional = optional_flags(bpf_class)
        walk = fd_walk_flags()
        # Else ProbeReading.file_reads is None: reads of files are not counted here.
        self.counts_file_reads = "-DHAVE_FD_WALK" in walk and "-DHAVE_READ" in optional
        # Else ProbeReading.empty_polls is None: no thread is told spinning.
        self.counts_polls = {"-DHAVE_POLL", "-DHAVE_EPOLL_WAIT"} <= set(optional)
        optional += walk
        # Every exec and rename is an event only with both tracepoints: see take_execs.
        self._all_renames = {"-DHAVE_SCHED_PROCESS_EXEC", "-DHAVE_TASK_RENAME"} <= set(optional)
        self._bpf = self._load(bpf_class, bpf_dir, [*settings, *optional])
        release_compiler_memory(self._proc)
        self.programs = self._bpf.num_open_tracepoints()
        self._open_maps()
        self._open_events()

    def _load(self, bpf_class: Any, bpf_dir: Path, cflags: list[str]) -> Any:
        """Compile, load and attach the programs (bcc attaches TRACEPOINT_PROBEs as it loads)."""
        t0 = time.monotonic()
        try:
            loaded = bpf_class(text=bpf_text(bpf_dir).encode(), cflags=cflags)
        except Exception as e:  # bcc raises bare Exception for compile and load failures
            raise KernelFeatureError(
                f"the kernel refused the BPF programs ({e})",
                "check that the kernel has BPF, syscall tracepoints and tracefs mounted",
            ) from e
        self.load_seconds = time.monotonic() - t0
        return loaded

    def _open_maps(self) -> None:
        self._watched = self._bpf[b"watched"]
        self._threads = self._bpf[b"threads"]
        self._pi_ops = self._bpf[b"pi_ops"]
        self._refusals = self._bpf[b"refusals"]
        self._hist = self._bpf[b"wait_hist"]
        self._counters = self._bpf[b"counters"]
        self._accepts = self._bpf[b"accepts"]
        self._file_reads = self._bpf[b"file_reads"]
        self._fd_writes = self._bpf[b"fd_writes"]
        self._door_writes = self._bpf[b"door_writes"]
        self._shares = self._bpf[b"shares"]
        self._released = self._bpf[b"released"]
        self._changes = self._bpf[b"changes"]
        # tid -> (tgid, uaddr, ts) of refusals of threads unwatched then (pi_ops), at the last read
        self._pi_refusals: dict[int, tuple[int, int, int]] = {}
        self._watching: set[int] = set()
        self._readers: dict[str, BatchReader | None] = {}
        for name, fields in THREAD_FIELDS.items():
            try:
                self._readers[name] = BatchReader(self._bpf[name.encode()], fields)
            except (ImportError, AttributeError, KeyError, ValueError):
                self._readers[name] = None  # bcc without the binding: one by one
        # tid -> (its threads-map row, the InflightWait built from it) at the last read
        self._built: dict[int, tuple[tuple[int, ...], InflightWait]] = {}
        # The threads map's rows at the last read, the watched set then, and the answer
        self._threads_rows: list[tuple[int, tuple[int, ...]]] | None = None
        self._threads_watching: set[int] = set()
        self._threads_answer: tuple[Mapping[int, InflightWait], frozenset[int], frozenset[int]] = (
            {},
            frozenset(),
            frozenset(),
        )
        # tid -> tgid of the entries user space inserted (seed): no share of the process's
        # was claimed for them, so none is given back when they go
        self._inserted: dict[int, int] = {}
        self._seeded: frozenset[int] = frozenset()  # the last read's marked TIDs
        # (the rows, the watched set, the empty polls built from them) at the last read
        self._polls_of: tuple[Any, frozenset[int], dict[int, int]] | None = None
        self._threads_waiting: Mapping[int, frozenset[tuple[int, int]]] = {}
        self._waiting: Mapping[int, frozenset[tuple[int, int]]] = {}  # the last read's

    def _open_events(self) -> None:
        """The two ring buffers (watched processes' futex events; any process's binds and
        listens), and what their records are kept in until the next read."""
        self._events: list[ProbeEvent] = []
        self._socket_events: list[SocketEvent] = []
        self._execs: list[ExecEvent] = []
        self._renamed: list[int] = []
        self._event_kinds = {
            self._defs["HW_EVENT_LONG_WAIT"]: "long-wait",
            self._defs["HW_EVENT_EDEADLK"]: "edeadlk",
            self._defs["HW_EVENT_BIND"]: "bind",
            self._defs["HW_EVENT_LISTEN"]: "listen",
        }
        self._overflow = 0  # futex records dropped here because nobody read them: see drain()
        self._host_overflow = 0  # the same for bind and listen records
        self._changes_lost_seen = 0  # execs and renames lost (changes map full) at take_execs
        self._ring = self._bpf[b"events"]
        self._ring.open_ring_buffer(self._on_event)
        self._host_ring = self._bpf[b"host_events"]
        self._host_ring.open_ring_buffer(self._on_host_event)

    def _on_event(self, _ctx: object, data: int, _size: int) -> None:
        if len(self._events) >= MAX_PENDING_EVENTS:
            self._overflow += 1
            return
        e = self._ring.event(data)
        kind = self._event_kinds.get(e.kind, str(e.kind))
        self._events.append(
            ProbeEvent(kind, e.ts_ns, e.tgid, e.tid, e.uaddr, e.op, e.duration_ns, e.ret)
        )

    def _on_host_event(self, _ctx: object, data: int, _size: int) -> None:
        if len(self._socket_events) >= MAX_PENDING_EVENTS:
            self._host_overflow += 1
            return
        e = self._host_ring.event(data)
        kind = self._event_kinds.get(e.kind, str(e.kind))
        self._socket_events.append(
            SocketEvent(kind, e.ts_ns, e.tgid, e.tid, e.fd, e.family, e.port, e.backlog)
        )

    def _take_changes(self) -> None:
        """Move the changes map's execs and renames into memory, emptying it: each entry is
        read and deleted at once, so a change after the read marks it afresh. Any change
        before the delete is seen by discovery's read of /proc, which comes after it."""
        exec_bit = self._defs["HW_CHANGE_EXEC"]
        try:
            batch = list(self._changes.items_lookup_and_delete_batch())
        except Exception:  # bcc raises bare Exception when the kernel refuses batch ops
            batch = []
            for k in list(self._changes.keys()):
                with contextlib.suppress(KeyError):
                    v = self._changes[k]
                    del self._changes[k]
                    batch.append((k.value, v))
        taken = [(int(k), v.ts_ns, v.kinds) for k, v in batch]
        for key, ts_ns, kinds in taken:
            if kinds & exec_bit:
                self._execs.append(ExecEvent(ts_ns, key))
            else:
                self._renamed.append(key)

    def watch(self, tgids: Iterable[int]) -> None:
        """Make the watched set exactly ``tgids`` (PIDs beyond the bitmap cannot be watched)."""
        want = {t for t in tgids if 0 < t < self._watched.max_entries * 64}
        # Only the words holding a PID that came or went; each one's bits differ by that PID.
        for word in {t // 64 for t in want ^ self._watching}:
            bits = sum(1 << (t % 64) for t in range(word * 64, word * 64 + 64) if t in want)
            self._watched[ctypes.c_int(word)] = ctypes.c_uint64(bits)
        self._watching = want

    def seed(self, threads: Mapping[int, int]) -> set[int]:
        """Mark the waits /proc showed (``threads``: TID -> tgid, each in a futex wait the
        probe did not see begin) in the threads map, so that the thread's next futex
        sys_exit clears the mark (bpf/futex.bpf.c): while it stays, the thread has not left
        that wait. Only threads without an entry are marked (an insert that fails if the
        kernel made one meanwhile), at most an eighth of the map in all (a process's share:
        the marks take the room of one more process at its share, at most), so that they
        never take much of the room of the kernel's own entries.
        Returns the TIDs marked; the caller checks that each was still in its wait when
        marked (it did not run between its read and the mark)."""
        from bcc.libbcc import lib

        per_process = self._threads.max_entries // 8
        room = per_process - len(self._inserted)
        held: dict[int, int] = {}
        for tgid in self._inserted.values():
            held[tgid] = held.get(tgid, 0) + 1
        seeded = self._defs["HW_THREAD_SEEDED"]
        marked = set()
        for tid, tgid in threads.items():
            if room <= 0:
                break
            if held.get(tgid, 0) >= per_process or tgid not in self._watching:
                continue
            key = ctypes.c_uint32(tid)
            leaf = self._threads.Leaf()
            leaf.tgid, leaf.flags, leaf.write_fd = tgid, seeded, -1
            at = ctypes.cast(ctypes.byref(key), ctypes.c_void_p)
            value = ctypes.cast(ctypes.byref(leaf), ctypes.c_void_p)
            if lib.bpf_update_elem(self._threads.map_fd, at, value, 1):
                continue  # BPF_NOEXIST refused: the kernel made the thread's entry
            self._inserted[tid] = tgid
            held[tgid] = held.get(tgid, 0) + 1
            room -= 1
            marked.add(tid)
        return marked

    def forget(self, tids: Iterable[int]) -> None:
        """Drop what is kept for threads that are gone (a thread that dies in a wait never
        reaches sys_exit; a thread's entry outlives its calls), and give the entries back
        to their process's share (hw_released: user space is its only writer)."""
        released: dict[int, list[int]] = {}  # tgid -> [threads, refusals] deleted
        for tid in tids:
            key = ctypes.c_uint32(tid)
            inserted = self._inserted.pop(tid, None) is not None  # claimed by no one
            for i, table in enumerate((self._threads, self._refusals)):
                with contextlib.suppress(KeyError):
                    tgid = table[key].tgid
                    del table[key]
                    if not (i == 0 and inserted):
                        released.setdefault(tgid, [0, 0])[i] += 1
            with contextlib.suppress(KeyError):
                del self._pi_ops[key]
        for tgid, (threads, refusals) in released.items():
            key = ctypes.c_uint32(tgid)
            old = self._released.get(key)
            leaf = self._released.Leaf(
                (old.threads if old else 0) + threads, (old.refusals if old else 0) + refusals
            )
            with contextlib.suppress(OSError):  # the map full: the process keeps a smaller share
                self._released[key] = leaf

    def forget_processes(self, tgids: Iterable[int]) -> None:
        """Delete everything kept per process for ``tgids`` (gone, or no longer watched), so
        the maps stay bounded as processes come and go."""
        gone = set(tgids)
        if not gone:
            return
        self._inserted = {t: g for t, g in self._inserted.items() if g not in gone}
        doomed = [
            (self._hist, [k for k in self._hist if k.tgid in gone]),
            (self._fd_writes, [k for k in self._fd_writes if k.tgid in gone]),
            (self._door_writes, [k for k in self._door_writes if k.tgid in gone]),
            (self._accepts, [ctypes.c_uint32(t) for t in gone]),
            (self._file_reads, [ctypes.c_uint32(t) for t in gone]),
            (self._shares, [ctypes.c_uint32(t) for t in gone]),
            (self._released, [ctypes.c_uint32(t) for t in gone]),
        ]
        for table in (self._threads, self._refusals, self._pi_ops):  # keyed by TID
            doomed.append(
                (table, [ctypes.c_uint32(k) for k, v in _by_tid(table) if v.tgid in gone])
            )
        for table, keys in doomed:
            for key in keys:
                with contextlib.suppress(KeyError):  # the kernel side may have deleted it
                    del table[key]

    def _rows(self, name: str) -> list[tuple[int, tuple[int, ...]]]:
        """(TID, the fields of THREAD_FIELDS[name]) for every entry of a map keyed by TID."""
        reader = self._readers.get(name)
        if reader is not None:
            try:
                return reader.rows()
            except OSError:  # the kernel refuses batch lookups: one by one from now on
                self._readers[name] = None
        fields = THREAD_FIELDS[name]
        table = self._bpf[name.encode()]
        return [(tid, tuple(getattr(v, f) for f in fields)) for tid, v in _by_tid(table)]

    def _threads_waits(
        self, rows: list[tuple[int, tuple[int, ...]]], watching: set[int], vector: int, waiting: int
    ) -> tuple[dict[int, InflightWait], set[int], frozenset[int]]:
        """The in-flight waits, the TIDs with an entry, and those whose entry still carries
        the mark of seed() (not in a wait of the probe's since), from the threads map's rows."""
        inflight: dict[int, InflightWait] = {}
        tracked: set[int] = set()
        seeded = self._defs["HW_THREAD_SEEDED"]
        marked = set()
        built = self._built
        self._built = {}
        for tid, row in rows:
            start_ns, uaddr, tgid, op, val, syscall, flags, _ = row
            if tgid not in watching:
                continue  # unwatched since: forget_processes deletes it
            tracked.add(tid)
            if flags & seeded and not flags & waiting:
                marked.add(tid)
            if flags & waiting:
                # The same wait as at the last read: the same objects (most threads of a
                # parked pool, every tick).
                known = built.get(tid)
                if known is not None and known[0] == row:
                    self._built[tid] = known
                    inflight[tid] = known[1]
                    continue
                wait = FutexWait(
                    uaddr=uaddr,
                    op=op,
                    val=val,
                    since_ns=start_ns,
                    vector=syscall == vector,
                    source="bpf",
                )
                inflight[tid] = InflightWait(tid, tgid, wait)
                self._built[tid] = (row, inflight[tid])
        return inflight, tracked, frozenset(marked)

    def _waits(self) -> tuple[Mapping[int, InflightWait], frozenset[int], list[int]]:
        """In-flight waits of watched processes, the TIDs with an entry, and dead TIDs. The
        same objects as the last read's where nothing changed (read-only, as a reading is):
        a node's thousands of parked threads are not copied every tick."""
        vector = self._defs["HW_SYSCALL_FUTEX_WAITV"]
        waiting = self._defs["HW_THREAD_WAITING"]
        watching = self._watching
        rows = self._rows("threads")
        if rows is self._threads_rows and self._threads_watching == watching:
            # Not a byte of the map changed, nor what is watched: the same answer.
            inflight, tracked, self._seeded = self._threads_answer
        else:
            built, found, self._seeded = self._threads_waits(rows, watching, vector, waiting)
            self._threads_rows, self._threads_watching = rows, set(watching)
            self._threads_answer = (built, frozenset(found), self._seeded)
            inflight, tracked = built, self._threads_answer[1]
            self._threads_waiting = ProbeReading(inflight).waiting_by_process()
        # A PI lock entered before the process was watched: its thread has no entry yet.
        # The entry is the thread's last PI operation, which may have ended; the sampler
        # keeps it only where /proc shows the thread still blocked on that word.
        pi_locks = (self._defs["HW_FUTEX_LOCK_PI"], self._defs["HW_FUTEX_LOCK_PI2"])
        dead = []
        pi_waits: list[InflightWait] = []
        self._pi_refusals = {}
        for tid, (start_ns, uaddr, refused_ns, tgid, op) in self._rows("pi_ops"):
            if tgid not in watching or tid in tracked or op not in pi_locks:
                continue
            if not self._proc.thread_exists(tgid, tid):
                dead.append(tid)
                continue
            if refused_ns:  # refused while unwatched: parked on a word of its own since
                self._pi_refusals[tid] = (tgid, uaddr, refused_ns)
                continue
            wait = FutexWait(uaddr=uaddr, op=op, val=0, since_ns=start_ns, source="bpf")
            pi_waits.append(InflightWait(tid, tgid, wait))
        self._waiting = self._threads_waiting
        if pi_waits:  # rare (PI locks entered before the process was watched)
            inflight = {**inflight, **{w.tid: w for w in pi_waits}}
            extra = ProbeReading({w.tid: w for w in pi_waits}).waiting_by_process()
            self._waiting = dict(self._waiting)
            for tgid, pairs in extra.items():
                self._waiting[tgid] = self._waiting.get(tgid, frozenset()) | pairs
        return inflight, tracked, dead

    def drain(self, seconds: float) -> None:
        """Move ring-buffer records into memory, waiting up to ``seconds`` for the first
        (returns early once some came). Between reads, so that a burst of events does not
        overflow the ring buffer before the next read."""
        self._bpf.ring_buffer_poll(max(0, int(seconds * 1000)))
        self._bpf.ring_buffer_consume()  # records submitted without a wakeup (execs) too

    def take_execs(self) -> list[int] | None:
        """The PIDs that exec'd or were renamed since the last call (or read()), taken out
        of the next reading; None where some may be missing: a tracepoint this kernel lacks,
        or changes lost to a full changes map since the last call. Cheap: the changes map
        and one counter."""
        self._take_changes()
        execs, self._execs = self._execs, []
        renamed, self._renamed = self._renamed, []
        lost = sum(c.changes_overflowed for per_cpu in self._counters.values() for c in per_cpu)
        complete = self._all_renames and lost == self._changes_lost_seen
        self._changes_lost_seen = lost
        return [e.tgid for e in execs] + renamed if complete else None

    def read(self) -> ProbeReading:
        self._bpf.ring_buffer_consume()  # every record, woken for or not
        self._take_changes()
        events, self._events = tuple(self._events), []
        sockets, self._socket_events = tuple(self._socket_events), []
        execs, self._execs = tuple(self._execs), []
        renamed, self._renamed = tuple(self._renamed), []
        inflight, tracked, dead = self._waits()
        # Refusals of unwatched processes are not the caller's business until the process is
        # watched; they are dropped here once their thread is gone, since no caller would
        # ever name them in forget().
        refusals = {}
        for tid, (ts_ns, uaddr, tgid) in self._rows("refusals"):
            if tgid in self._watching:
                refusals[tid] = (tgid, uaddr, ts_ns)
            elif not self._proc.thread_exists(tgid, tid):
                dead.append(tid)
        # Refused before the process was watched: kept in pi_ops only (bpf/futex.bpf.c).
        for tid, refusal in self._pi_refusals.items():
            refusals.setdefault(tid, refusal)
        if dead:
            self.forget(dead)
        hist: dict[int, dict[int, int]] = {}
        for k, n in self._hist.items():
            hist.setdefault(k.tgid, {})[k.slot] = n.value
        accepts = {k.value: n.value for k, n in self._accepts.items()}
        file_reads = (
            {k.value: n.value for k, n in self._file_reads.items()}
            if self.counts_file_reads
            else None
        )
        polls = None
        if self.counts_polls:
            # Built again only where the rows or the watched set changed (a pool parked for
            # hours: every tick the same rows)
            key = (self._threads_rows, frozenset(self._watching))
            if (
                self._polls_of is None
                or self._polls_of[0] is not key[0]
                or self._polls_of[1] != key[1]
            ):
                built = {
                    tid: row[7]
                    for tid, row in self._threads_rows or ()
                    if row[7] and row[2] in self._watching
                }
                self._polls_of = (key[0], key[1], built)
            polls = dict(self._polls_of[2])
        writes: dict[int, dict[int, FdWrites]] = {}
        for k, v in self._fd_writes.items():
            tail = bytes(v.tail)[: min(v.tail_len, len(v.tail))]
            writes.setdefault(k.tgid, {})[k.fd] = FdWrites(
                k.fd,
                v.bytes,
                v.calls,
                v.last_ns,
                tail,
                v.door_bytes,
                v.unix_bytes,
                v.file_bytes,
                v.file_ino,
            )
        door_writes: dict[int, dict[int, PortWrites]] = {}
        for k, v in self._door_writes.items():
            door_writes.setdefault(k.tgid, {})[k.port] = PortWrites(
                k.port, v.bytes, v.calls, v.last_ns
            )
        counters: dict[str, int] = {}
        for per_cpu in self._counters.values():
            for c in per_cpu:
                for name, _ in c._fields_:
                    counters[name] = counters.get(name, 0) + getattr(c, name)
        counters["events_dropped"] = counters.get("events_dropped", 0) + self._overflow
        counters["host_events_dropped"] = (
            counters.get("host_events_dropped", 0) + self._host_overflow
        )
        # Every share, so that the daemon forgets those of processes gone or unwatched.
        shares = {k.value: ProbeShare(v.refused, v.events_dropped) for k, v in self._shares.items()}
        return ProbeReading(
            inflight,
            refusals,
            events,
            hist,
            counters,
            socket_events=sockets,
            accepts=accepts,
            writes=writes,
            door_writes=door_writes,
            threads=frozenset(tracked),
            execs=execs,
            renamed=renamed,
            shares=shares,
            waiting=self._waiting,
            file_reads=file_reads,
            empty_polls=polls,
            seeded=self._seeded,
        )

    def tracepoints(self) -> list[str]:
        """The syscall tracepoints attached (``sys_enter_futex``, ...)."""
        return sorted(_program_name(name) for name in self._bpf.funcs if b"__syscalls__" in name)

    def program_stats(self) -> dict[str, ProgramStats]:
        """Cumulative run time and count per attached program, named by its tracepoint
        (``sys_enter_futex``). All zero unless stats are on: see ``enable_stats``."""
        out = {}
        for func_name, fn in self._bpf.funcs.items():
            info = self._proc.fdinfo("self", fn.fd)
            out[_program_name(func_name)] = ProgramStats(
                run_seconds=int(info.get("run_time_ns", "0")) / 1e9,
                run_count=int(info.get("run_cnt", "0")),
            )
        return out

    def enable_stats(self) -> Callable[[], None] | None:
        """Turn on the kernel's per-program run-time accounting (``kernel.bpf_stats_enabled``;
        it costs every BPF program on the host two clock reads per run, so it is off by
        default). Returns the function that turns it back off, or None when it could not be
        turned on (not root)."""
        fd = _enable_stats_fd()
        if fd is not None:
            return _once(lambda: os.close(fd))
        # No such syscall here: the sysctl itself, restored to its old value on the way out.
        try:
            old = STATS_SYSCTL.read_text().strip()
            STATS_SYSCTL.write_text("1\n")
        except OSError:
            return None
        return _once(lambda: STATS_SYSCTL.write_text(f"{old}\n"))

    def close(self) -> None:
        self._bpf.cleanup()

    def __enter__(self) -> KernelProbes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
