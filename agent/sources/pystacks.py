"""Python stacks of parked threads, read without stopping the process.

The reader is py-spy (``py-spy dump --nonblocking --json``) run as a child: it reads the
target's memory and never attaches, so the target is not stopped and gets no signal, and a
child is killed at its timeout, a crash in it one line of the report. What the stacks show is
agent.analysis.stacks; this module only reads them, as agent.model's PyThread records.
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from ..model import (  # read here; defined beside the snapshot
    NAME_SHOWN_MAX,
    PyFrame,
    PyThread,
    StackRead,
    printable,
)
from . import confined
from .confined import FileLines, Target
from .procfs import ProcFS

READ_TIMEOUT_S = 3.0  # per process; py-spy reads a 100-thread process in tens of ms
MAX_FRAMES = 32  # per thread, innermost first: enough to reach the program's own code
MAX_OUTPUT = 32 << 20  # of one dump: ~1,500 threads of 100 frames (py-spy indents its JSON)
MAX_ERROR = 64 << 10  # bytes of py-spy's stderr kept: only matched against known words


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
    process read. Nothing is kept between reads: the rights are those fixed in the Target
    before its frames were read (a PID: taken now), and a PID reused by another tenant's
    process can never be shown the first one's files."""

    def __init__(
        self,
        proc: ProcFS,
        read: Callable[
            [int | Target, Mapping[str, Collection[int]], str], Mapping[str, FileLines]
        ] = confined.read_lines,
    ) -> None:
        self._root = proc.root
        self._read = read

    def of(self, target: int | Target, frames: Iterable[tuple[str, int]]) -> dict[str, FileLines]:
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
            out.update(self._read(target, wanted, self._root))
        return out


NOT_A_FILE = "not a file"


def short_of(path: str) -> str:
    """A short name with no file system to ask (the file gave nothing): its base name."""
    return path if path.startswith("<") else os.path.basename(path) or path


def _elements(text: str) -> Iterator[Any]:
    """The elements of a JSON array, decoded one at a time: only one thread's objects live
    at once, whatever the size of the dump (it is bounded in bytes, not in frames)."""
    decoder = json.JSONDecoder()
    i = len(text) - len(text.lstrip())
    if text[i : i + 1] != "[":
        raise ValueError("not a JSON array")
    i += 1
    while True:
        while text[i : i + 1].isspace():
            i += 1
        if text[i : i + 1] == "]":
            return
        item, i = decoder.raw_decode(text, i)
        yield item
        while text[i : i + 1].isspace():
            i += 1
        if text[i : i + 1] == ",":
            i += 1
        elif text[i : i + 1] != "]":
            raise ValueError(f"expected , or ] at {i}")


def parse_dump(
    target: int | Target, text: str, source: SourceLines | None = None
) -> dict[int, PyThread]:
    """py-spy's JSON (a list of threads) -> PyThread by OS thread id, each frame with its
    source line where ``source`` could read it as the target would (``target``: the PID, or
    the Target fixed before the dump was taken)."""
    raw: dict[int, tuple[object, bool, list[tuple[str, str, int]]]] = {}
    for t in _elements(text):
        tid = t.get("os_thread_id")
        if not isinstance(tid, int):
            continue
        listed = [
            (
                printable(str(f.get("name") or "?"), NAME_SHOWN_MAX),
                str(f.get("filename") or "?"),
                int(f.get("line") or 0),
            )
            for f in (t.get("frames") or [])[:MAX_FRAMES]
        ]
        raw[tid] = (t.get("thread_name"), bool(t.get("owns_gil")), listed)
    files = (
        source.of(target, {(path, line) for _, _, fs in raw.values() for _, path, line in fs})
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
                    file=printable(path, NAME_SHOWN_MAX),
                    short=printable(
                        got.short if got and got.short else short_of(path), NAME_SHOWN_MAX
                    ),
                    line=line,
                    code=printable(code, NAME_SHOWN_MAX) if code is not None else None,
                    code_withheld=(got.withheld or confined.NO_LINE)
                    if got and code is None
                    else None,
                )
            )
        out[tid] = PyThread(
            tid,
            printable(name, NAME_SHOWN_MAX) if isinstance(name, str) else None,
            gil,
            tuple(frames),
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


def _run_capped(argv: list[str], timeout_s: float) -> tuple[int, bytearray, bytes] | str:
    """Run the reader with its stdout streamed and capped: (status, stdout, stderr), or why
    there is none. Past MAX_OUTPUT bytes or ``timeout_s`` it is killed: what it wrote is
    never held whole beyond the cap, however much it writes."""
    try:
        child = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd="/",
            env=confined.CHILD_ENV,  # it reads none of ours
        )
    except OSError as e:
        return f"py-spy could not run: {e.strerror or e}"
    assert child.stdout is not None and child.stderr is not None
    out, err = bytearray(), bytearray()
    deadline = time.monotonic() + timeout_s
    why: str | None = None
    with child, selectors.DefaultSelector() as sel:
        sel.register(child.stdout, selectors.EVENT_READ, out)
        sel.register(child.stderr, selectors.EVENT_READ, err)
        while sel.get_map() and why is None:
            left = deadline - time.monotonic()
            if left <= 0:
                why = f"py-spy timed out after {timeout_s:g} s"
                break
            for key, _ in sel.select(left):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    sel.unregister(key.fileobj)
                elif key.data is out:
                    out += chunk
                    if len(out) > MAX_OUTPUT:
                        why = f"py-spy wrote over {MAX_OUTPUT >> 20} MiB"
                        break
                elif len(err) < MAX_ERROR:
                    err += chunk[: MAX_ERROR - len(err)]
        if why is not None:
            child.kill()
        try:
            status = child.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:  # closed its pipes but lingers: not waited for
            child.kill()
            status = child.wait()
            why = why or f"py-spy timed out after {timeout_s:g} s"
    if why is not None:
        return why
    return status, out, bytes(err)  # out not copied: it may be MAX_OUTPUT bytes


def read_stacks(
    pid: int,
    proc: ProcFS,
    timeout_s: float = READ_TIMEOUT_S,
    reader: str | None = None,
    source: SourceLines | None = None,
    start: int | None = None,
) -> StackRead | None:
    """The Python stacks of ``pid``, None when it runs no Python (as ``proc`` shows it). Never
    raises: a reader that is missing, fails or times out gives a StackRead with the reason;
    without ``source``, frames come without their source lines.

    The target's identity is fixed before py-spy reads it (agent.sources.confined.Target) and
    checked after: frames of a process that exec'd, or of another one that took its PID, are
    not shown, and the source lines are read with the rights fixed before the frames.
    ``start``: the start time (ticks) of the process meant, when known: another process
    that took its PID since is not read."""
    if not is_python(pid, proc):
        return None
    exe = reader or find_reader()
    if exe is None:
        return StackRead(pid, error="py-spy is not installed (pip install py-spy)")
    target = Target.take(pid, proc.root, start)
    if isinstance(target, str):
        return StackRead(pid, error=f"not read: {target}")
    with target:
        began = time.monotonic()
        # --full-filenames: py-spy would otherwise shorten names by testing for __init__.py
        # as root through /proc/PID/root (unconfined); SourceLines does it with the target's
        # view and rights instead.
        argv = [exe, "dump", "--nonblocking", "--json", "--full-filenames", "--pid", str(pid)]
        done = _run_capped(argv, timeout_s)
        took = time.monotonic() - began
        if isinstance(done, str):
            return StackRead(
                pid, error=done, seconds=took if "timed out" not in done else timeout_s
            )
        status, stdout, stderr = done
        del done
        if status != 0:
            return StackRead(pid, error=reader_error(stderr, status))
        changed = target.changed()
        if changed is not None:
            return StackRead(pid, error=f"not read: {changed}", seconds=took)
        text = stdout.decode(errors="replace")
        del stdout  # the bytes or the text, not both, while the threads are built
        try:
            threads = parse_dump(target, text, source)
        except (ValueError, TypeError, AttributeError) as e:
            return StackRead(pid, error=f"py-spy's output was not understood: {e}", seconds=took)
    return StackRead(pid, threads, seconds=took)


def read_many(
    pids: Iterable[int],
    budget_s: float,
    proc: ProcFS,
    source: SourceLines | None = None,
    starts: Mapping[int, int] | None = None,
) -> dict[int, StackRead]:
    """Stacks of several processes within ``budget_s`` in all: each read gets what is left
    (at most READ_TIMEOUT_S); those past the budget get a line saying so. ``source``: where
    their source lines are read (by default afresh, in ``proc``'s tree); ``starts``: the
    start time of each process as the caller saw it (a PID reused since is not read)."""
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
        read = read_stacks(
            pid,
            proc,
            timeout_s=min(READ_TIMEOUT_S, left),
            source=source,
            start=(starts or {}).get(pid),
        )
        if read is not None:
            out[pid] = read
    return out
