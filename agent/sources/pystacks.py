"""Python stacks of parked threads, read without stopping the process.

The reader is py-spy (``py-spy dump --nonblocking --json``), run as a child process: it reads
the target's memory with process_vm_readv and never attaches, so the target is not stopped
and gets no signal (a blocking dump ptrace-stops every thread while it reads). A child process
bounds what a reader can cost us: it is killed at its timeout, and a crash in it is one line
in the report, never the verdict or the daemon.

What the stacks show (threads grouped by the line of the program's own code where they wait)
is agent.analysis.stacks; this module only reads them, as agent.model's PyThread records.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from pathlib import Path

from ..model import PyFrame, PyThread, StackRead  # read here; defined beside the snapshot
from . import confined
from .confined import FileLines
from .procfs import ProcFS, printable

READ_TIMEOUT_S = 3.0  # per process; py-spy reads a 100-thread process in tens of ms
MAX_FRAMES = 32  # per thread, innermost first: enough to reach the program's own code
MAX_OUTPUT = 64 << 20  # bytes of JSON accepted from one dump (2,000 threads ~ 5 MiB)


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
