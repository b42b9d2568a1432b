"""Python stacks of parked threads, read without stopping the process.

The reader is py-spy (``py-spy dump --nonblocking --json``), run as a child process: it reads
the target's memory with process_vm_readv and never attaches, so the target is not stopped
and gets no signal (a blocking dump ptrace-stops every thread while it reads). A child process
bounds what a reader can cost us: it is killed at its timeout, and a crash in it is one line
in the report, never the verdict or the daemon.

Threads with the same Python stack and the same wait form one group, told by the line where
the program's own code waits: the innermost frame outside the standard library ("at
`Queue.get` (scheduler.py:212) in `event_loop`"), not ``threading.py:320``, where every
condition wait looks alike.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..analysis import evidence as ev
from ..model import ProcessSample, ThreadSample
from ..syscalls import FUTEX, syscall_name, wait_kind
from . import confined
from .confined import FileLines
from .procfs import ProcFS, printable

READ_TIMEOUT_S = 3.0  # per process; py-spy reads a 100-thread process in tens of ms
MAX_FRAMES = 32  # per thread, innermost first: enough to reach the program's own code
MAX_OUTPUT = 64 << 20  # bytes of JSON accepted from one dump (2,000 threads ~ 5 MiB)


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


def find_reader() -> str | None:
    """py-spy next to our interpreter first (the venv's bin is often not on PATH under
    systemd), then on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("py-spy")


def is_python(pid: int, proc: ProcFS) -> bool:
    """Whether the process runs a CPython interpreter: its executable or a mapped library is
    named python (static builds map no libpython; embedded ones map no python binary)."""
    exe = proc.exe(pid)
    if exe is None:
        return False
    if os.path.basename(exe).startswith("python"):
        return True
    return any("libpython" in m.path for m in proc.maps(pid))


class SourceLines:
    """The source lines a dump's frames point at, read as the target would read them: inside
    its root (under ``proc``'s tree), with its rights (agent.sources.confined), one batch per
    process read. Nothing is kept between reads: rights are checked again each time, and a PID
    reused by another tenant's process can never be shown the first one's files."""

    def __init__(
        self,
        proc: ProcFS,
        read: Callable[[int, Mapping[str, Collection[int]], str], Mapping[str, FileLines]] = (
            confined.read_lines
        ),
    ) -> None:
        self._root = proc.root
        self._read = read

    def of(self, pid: int, frames: Iterable[tuple[str, int]]) -> dict[str, FileLines]:
        """(file, line) pairs -> what each file gave. Names that are not files at all
        (``<frozen importlib._bootstrap>``, ``<string>``) are not asked for."""
        wanted: dict[str, set[int]] = {}
        out: dict[str, FileLines] = {}
        for path, line in frames:
            if path.startswith("<"):
                out[path] = FileLines(withheld=NOT_A_FILE, short=path)
            else:
                wanted.setdefault(path, set()).add(line)
        if wanted:
            out.update(self._read(pid, wanted, self._root))
        return out


NOT_A_FILE = "not a file"


def short_of(path: str) -> str:
    """A short name with no file system to ask (the file gave nothing): its base name."""
    return path if path.startswith("<") else os.path.basename(path) or path


def parse_dump(pid: int, text: str, source: SourceLines | None = None) -> dict[int, PyThread]:
    """py-spy's JSON (a list of threads) -> PyThread by OS thread id, each frame with its
    source line where ``source`` could read it as the target would."""
    raw: dict[int, tuple[object, bool, list[tuple[str, str, int]]]] = {}
    for t in json.loads(text):
        tid = t.get("os_thread_id")
        if not isinstance(tid, int):
            continue
        listed = [
            (
                printable(str(f.get("name") or "?")),
                str(f.get("filename") or "?"),
                int(f.get("line") or 0),
            )
            for f in (t.get("frames") or [])[:MAX_FRAMES]
        ]
        raw[tid] = (t.get("thread_name"), bool(t.get("owns_gil")), listed)
    files = (
        source.of(pid, {(path, line) for _, _, fs in raw.values() for _, path, line in fs})
        if source
        else {}
    )
    out: dict[int, PyThread] = {}
    for tid, (name, gil, fs) in raw.items():
        frames: list[PyFrame] = []
        for function, path, line in fs:
            got = files.get(path)
            code = got.lines.get(line) if got else None
            frames.append(
                PyFrame(
                    function=function,
                    file=printable(path),
                    short=printable(got.short if got and got.short else short_of(path)),
                    line=line,
                    code=printable(code) if code is not None else None,
                    code_withheld=(got.withheld or confined.NO_LINE)
                    if got and code is None
                    else None,
                )
            )
        out[tid] = PyThread(
            tid, printable(name) if isinstance(name, str) else None, gil, tuple(frames)
        )
    return out


# py-spy's own words for the failures it is known to report, and ours for each. Anything
# else is told by its exit status alone: its messages can quote bytes of a file it opened by
# a name the target chose (an ELF header it could not parse), so they are never shown as is.
_READER_ERRORS = (
    ("permission denied", "permission denied"),
    ("operation not permitted", "operation not permitted"),
    ("no such process", "the process is gone"),
    ("failed to find python version", "no Python interpreter found in it"),
    ("failed to find a python interpreter", "no Python interpreter found in it"),
)


def reader_error(stderr: bytes, status: int) -> str:
    text = stderr.decode(errors="replace").lower()
    for needle, words in _READER_ERRORS:
        if needle in text:
            return f"py-spy failed: {words}"
    return f"py-spy failed with exit status {status}"


def read_stacks(
    pid: int,
    proc: ProcFS,
    timeout_s: float = READ_TIMEOUT_S,
    reader: str | None = None,
    source: SourceLines | None = None,
) -> StackRead | None:
    """The Python stacks of ``pid``, None when it runs no Python (as ``proc`` shows it). Never
    raises: a reader that is missing, fails or times out gives a StackRead with the reason;
    without ``source``, frames come without their source lines."""
    if not is_python(pid, proc):
        return None
    exe = reader or find_reader()
    if exe is None:
        return StackRead(pid, error="py-spy is not installed (pip install py-spy)")
    start = time.monotonic()
    try:
        done = subprocess.run(
            # --full-filenames: py-spy would otherwise shorten names by testing for
            # __init__.py as root through /proc/PID/root (unconfined); SourceLines does it
            # with the target's view and rights instead.
            [exe, "dump", "--nonblocking", "--json", "--full-filenames", "--pid", str(pid)],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=timeout_s,
            check=False,
            cwd="/",
            env=confined.CHILD_ENV,  # it reads none of ours
        )
    except subprocess.TimeoutExpired:
        return StackRead(pid, error=f"py-spy timed out after {timeout_s:g} s", seconds=timeout_s)
    except OSError as e:
        return StackRead(pid, error=f"py-spy could not run: {e.strerror or e}")
    took = time.monotonic() - start
    if done.returncode != 0:
        return StackRead(pid, error=reader_error(done.stderr, done.returncode))
    if len(done.stdout) > MAX_OUTPUT:
        return StackRead(pid, error=f"py-spy wrote over {MAX_OUTPUT >> 20} MiB", seconds=took)
    try:
        threads = parse_dump(pid, done.stdout.decode(errors="replace"), source)
    except (ValueError, TypeError, AttributeError) as e:
        return StackRead(pid, error=f"py-spy's output was not understood: {e}", seconds=took)
    return StackRead(pid, threads, seconds=took)


# --- groups ----------------------------------------------------------------------------------


def wait_words(t: ThreadSample | None) -> str:
    """What a thread waits in, in the words a group is keyed by (not the fd or the futex word:
    each waiter of a condition has its own)."""
    if t is None:
        return "gone"
    if not t.blocked:
        return "running"
    if t.syscall is None or t.syscall < 0:
        return "blocked"
    how = "" if t.timed is None else " with a timeout" if t.timed else " with no timeout"
    op = f" {t.wait.op_name}" if t.wait is not None and wait_kind(t.syscall) == FUTEX else ""
    return f"in {syscall_name(t.syscall)}{op}{how}"


@dataclass(frozen=True)
class StackGroup:
    """Threads of one process with the same Python stack and the same wait."""

    tids: tuple[int, ...]
    names: tuple[str, ...]
    wait: str
    thread: PyThread  # one of them: the stack they share
    gil: int | None = None  # the TID among them that holds the GIL


def group_stacks(
    sample: ProcessSample, stacks: Mapping[int, PyThread]
) -> tuple[list[StackGroup], list[int]]:
    """Groups, largest first, and the TIDs of the process py-spy did not show with frames
    (threads that run no Python: native helpers, zmq's I/O threads)."""
    by_tid = {t.tid: t for t in sample.threads}
    keyed: dict[tuple[object, ...], list[PyThread]] = {}
    for tid in sorted(stacks):
        py = stacks[tid]
        if not py.frames:  # listed without frames: told with the threads py-spy did not show
            continue
        key = (wait_words(by_tid.get(tid)), tuple((f.file, f.line) for f in py.frames))
        keyed.setdefault(key, []).append(py)
    groups = []
    for (wait, _), members in keyed.items():
        gil = next((m.tid for m in members if m.owns_gil), None)
        groups.append(
            StackGroup(
                tids=tuple(m.tid for m in members),
                names=tuple(
                    m.name or (by_tid[m.tid].name if m.tid in by_tid else "?") for m in members
                ),
                wait=str(wait),
                thread=members[0],
                gil=gil,
            )
        )
    # The GIL holder first (everyone else may wait for it), then the largest groups.
    groups.sort(key=lambda g: (g.gil is None, -len(g.tids), g.tids[0]))
    shown = {tid for tid, py in stacks.items() if py.frames}
    return groups, sorted(set(by_tid) - shown)


# --- hints -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class LockWaiter:
    tid: int
    frame: PyFrame  # the line that takes the lock
    word: int
    last_ran_ns: int


def _takes_a_lock(f: PyFrame) -> bool:
    """The source line acquires a lock: ``with x:`` or ``x.acquire(...)``. Python locks are
    semaphores that record no owner, so the line is the only witness of what is held."""
    code = f.code or ""
    return code.startswith(("with ", "async with ")) or ".acquire(" in code


def lock_waiters(sample: ProcessSample, stacks: Mapping[int, PyThread]) -> list[LockWaiter]:
    """Threads parked, with no timeout, in a futex wait taken straight from a line of the
    program's own code that acquires a lock."""
    out = []
    for t in sample.threads:
        py = stacks.get(t.tid)
        if (
            py is None
            or not py.frames
            or not t.blocked
            or wait_kind(t.syscall) != FUTEX
            or t.timed is not False
            or t.wait is None
            or t.last_ran_ns is None
        ):
            continue
        inner = py.frames[0]
        if inner.stdlib or not _takes_a_lock(inner):
            continue
        out.append(LockWaiter(t.tid, inner, t.wait.uaddr, t.last_ran_ns))
    return out


def lock_cycle_hint(waiters: Sequence[LockWaiter]) -> list[LockWaiter]:
    """The waiters, when they wait on two or more distinct lock words: the shape of a lock
    cycle, not a proof of one (Python locks have no owner to draw the cycle with). Empty
    otherwise. Their waits need not begin together: on a real server one side of a cycle
    was seen to reach its second lock seconds after the other (it waited for the GIL)."""
    return list(waiters) if len({w.word for w in waiters}) >= 2 else []


def read_many(
    pids: Iterable[int], budget_s: float, proc: ProcFS, source: SourceLines | None = None
) -> dict[int, StackRead]:
    """Stacks of several processes within ``budget_s`` in all: each read gets what is left
    (at most READ_TIMEOUT_S); those past the budget get a line saying so. ``source``: where
    their source lines are read (by default afresh, in ``proc``'s tree)."""
    out: dict[int, StackRead] = {}
    source = source or SourceLines(proc)
    deadline = time.monotonic() + budget_s
    for pid in pids:
        left = deadline - time.monotonic()
        if left < 0.05:
            out[pid] = StackRead(
                pid, error=f"not read: the {budget_s:g} s budget for stacks was spent"
            )
            continue
        read = read_stacks(pid, proc, timeout_s=min(READ_TIMEOUT_S, left), source=source)
        if read is not None:
            out[pid] = read
    return out


# --- as evidence -----------------------------------------------------------------------------

MAX_GROUPS = 12  # per process in words; --json has them all
NATIVE_PER_GROUP = 8  # threads of a group whose native caller is read (a stack scan each)


def stack_facts(
    sample: ProcessSample,
    read: StackRead,
    wall: float,
    mono_ns: int,
    max_groups: int = MAX_GROUPS,
    native: Callable[[int, int], str | None] | None = None,
    on: Mapping[tuple[int, int], str] | None = None,
) -> list[ev.Fact]:
    """What the stacks of one process show, as records for agent.report.sentences: the groups (GIL
    holder and largest first), the threads with no Python frames, and a lock-cycle hint.
    ``native``: (pid, tid) -> its first native caller outside libc, asked of a few threads
    of each group that waits in futex (a C extension's lock says where it is only there).
    ``on``: (pid, tid) -> the fds it waits on (fdwords.waits_on), told for a group whose
    threads all wait on the same."""
    if read.error is not None:
        return [ev.StacksUnread(read.pid, read.error)]
    groups, bare = group_stacks(sample, read.threads)
    facts: list[ev.Fact] = []
    for g in groups[:max_groups]:
        site = g.thread.site()
        if site is None:
            continue
        callee, frame = site
        facts.append(
            ev.StackGroup(
                pid=sample.pid,
                threads=len(g.tids),
                tids=g.tids,
                wait=g.wait,
                function=frame.function,
                file=frame.short,
                line=frame.line,
                callee=callee,
                code=frame.code,
                gil=g.gil,
                names=g.names,
                native=_natives(sample.pid, g, native),
                on=_same_fds(sample.pid, g, on),
            )
        )
    rest = groups[max_groups:]
    if rest:
        facts.append(ev.MoreStackGroups(len(rest), sum(len(g.tids) for g in rest)))
    if bare:
        by_tid = {t.tid: t for t in sample.threads}
        waits: dict[str, int] = {}
        for tid in bare:
            w = wait_words(by_tid.get(tid))
            waits[w] = waits.get(w, 0) + 1
        facts.append(ev.NoPythonStack(sample.pid, len(bare), tuple(sorted(waits.items()))))
    cycle = lock_cycle_hint(lock_waiters(sample, read.threads))
    if cycle:
        last = max(w.last_ran_ns for w in cycle)  # since then, all of them wait
        facts.append(
            ev.PyLockHint(
                pid=sample.pid,
                waits=tuple(
                    ev.LockAt(w.tid, w.frame.function, w.frame.short, w.frame.line, w.frame.code)
                    for w in cycle
                ),
                words=len({w.word for w in cycle}),
                since_wall=wall - (mono_ns - last) / 1e9,
            )
        )
    return facts


def _natives(
    pid: int, g: StackGroup, native: Callable[[int, int], str | None] | None
) -> str | None:
    """The distinct native callers of a few of the group's threads (threads with one Python
    stack can sit in different C functions: two ctypes calls from one Thread.run)."""
    if native is None or not g.wait.startswith("in futex"):
        return None
    seen = [c for c in dict.fromkeys(native(pid, t) for t in g.tids[:NATIVE_PER_GROUP]) if c]
    return "; ".join(seen) or None


def _same_fds(pid: int, g: StackGroup, on: Mapping[tuple[int, int], str] | None) -> str | None:
    if on is None:
        return None
    seen = {on.get((pid, t)) for t in g.tids[:NATIVE_PER_GROUP]}
    return seen.pop() if len(seen) == 1 else None


def stacks_json(sample: ProcessSample, read: StackRead) -> dict[str, object]:
    """--json: every group with its whole stack (innermost first), and how the read went."""
    if read.error is not None:
        return {"error": read.error, "seconds": round(read.seconds, 3)}
    groups, native = group_stacks(sample, read.threads)
    return {
        "seconds": round(read.seconds, 3),
        "groups": [
            {
                "tids": list(g.tids),
                "wait": g.wait,
                "gil": g.gil,
                "frames": [
                    {
                        "function": f.function,
                        "file": f.file,
                        "line": f.line,
                        "code": f.code,
                        **({"code_withheld": f.code_withheld} if f.code is None else {}),
                    }
                    for f in g.thread.frames
                ],
            }
            for g in groups
        ],
        "no_python_frames": native,
        # Threads at lock lines on two or more words: a Python lock cycle's shape (a hint)
        "lock_hint": [
            {"tid": w.tid, "function": w.frame.function, "file": w.frame.file, "line": w.frame.line}
            for w in lock_cycle_hint(lock_waiters(sample, read.threads))
        ],
    }
