"""Build and run the fixture programs in ``tests/fixtures``.

Shared by ``tests/host/test_fixtures.py`` (the fixtures really do what they claim; no BPF),
``tests/privileged`` (the real tool diagnoses them), the benchmark's detection part and
``scripts/demo.py`` / ``scripts/soak.py``; it lives here so that none of those reaches into
``tests/`` for it. The sources stay in ``tests/fixtures``. A fixture prints one flushed
``TOKEN key=value ...`` line on stdout when it has reached its state; :class:`Fixture`
starts it in its own process group, waits for that line, and kills the whole group on exit.
"""

from __future__ import annotations

import contextlib
import os
import queue
import secrets
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any, Union

# A command run as an unprivileged tenant: uid and gid nobody, no supplementary groups.
AS_NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
SYSTEM_PYTHON = "/usr/bin/python3"  # what nobody may run: the repository's venv may be closed to it

REPO_ROOT = Path(__file__).resolve().parent.parent
FIXTURES_DIR = REPO_ROOT / "tests" / "fixtures"
BUILD_DIR = FIXTURES_DIR / "build"
CFLAGS = ("-O1", "-g", "-pthread", "-Wall", "-Werror")

SYS_FUTEX = 202  # x86-64 syscall numbers, as /proc/PID/task/TID/syscall shows them
SYS_WAIT4 = 61
SYS_ACCEPT = 43
SYS_ACCEPT4 = 288
FUTEX_CMD_MASK = 0x7F  # op without FUTEX_PRIVATE_FLAG (128) and FUTEX_CLOCK_REALTIME (256)
FUTEX_WAIT, FUTEX_WAIT_BITSET, FUTEX_LOCK_PI, FUTEX_LOCK_PI2 = 0, 9, 6, 13
FUTEX_TID_MASK = 0x3FFFFFFF
FUTEX_WAITERS = 0x80000000

Arg = Union[str, Path]


class FixtureError(RuntimeError):
    """A fixture failed to build, start, or reach its state."""


def build(name: str, *, src_dir: Path = FIXTURES_DIR, out_dir: Path = BUILD_DIR) -> Path:
    """Compile ``src_dir/NAME.c`` to ``out_dir/NAME`` unless the binary is up to date.

    Safe when several processes build at once: each compiles to its own temporary name and
    ``os.replace`` swaps the result in atomically.
    """
    src = src_dir / f"{name}.c"
    if not src.is_file():
        raise FixtureError(f"no fixture source {src}")
    out = out_dir / name
    # The shared header is a dependency of every fixture.
    newest = max(p.stat().st_mtime_ns for p in [src, *src_dir.glob("*.h")])
    try:
        if out.stat().st_mtime_ns >= newest:
            return out
    except FileNotFoundError:
        pass
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    cmd = [os.environ.get("CC", "gcc"), *CFLAGS, "-o", str(tmp), str(src)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise FixtureError(f"building {name} failed: {' '.join(cmd)}\n{proc.stderr}")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


class FixtureLine(dict):
    """The ``key=value`` pairs of one announced line; ``line`` keeps the raw text."""

    def __init__(self, line: str) -> None:
        token, *rest = line.split()
        super().__init__(kv.split("=", 1) for kv in rest if "=" in kv)
        self.token = token
        self.line = line

    def get_int(self, key: str) -> int:
        return int(self[key], 0)

    def get_ints(self, key: str) -> list[int]:
        """A comma-separated list of integers (decimal or 0x hex); empty value, empty list."""
        return [int(v, 0) for v in self[key].split(",") if v]


_EOF = None


class Fixture:
    """Run a fixture command in its own process group until a ``TOKEN ...`` line.

    >>> with Fixture.c("deadlock_mutex") as fx:
    ...     tids = fx.info.get_ints("tids")

    On exit (or failure) the whole process group gets SIGKILL and is reaped.
    """

    def __init__(
        self,
        argv: Sequence[Arg],
        *,
        ready: str | None = "READY",
        timeout: float = 10.0,
        env: dict[str, str] | None = None,
    ) -> None:
        self.argv = [str(a) for a in argv]
        self.ready = ready
        self.timeout = timeout
        self.env = env
        self.info: FixtureLine = FixtureLine("NONE")
        self.lines: list[str] = []  # every stdout line seen so far
        self._cursor = 0  # lines before this were consumed by wait_for
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._eof = False
        self.proc: subprocess.Popen[bytes] | None = None
        self._stderr: IO[bytes] | None = None

    @classmethod
    def c(cls, name: str, *args: Arg, **kwargs: Any) -> Fixture:
        """A C fixture, built first if needed."""
        return cls([build(name), *args], **kwargs)

    @classmethod
    def py(cls, name: str, *args: Arg, **kwargs: Any) -> Fixture:
        """A Python fixture, run by the interpreter that runs the tests."""
        return cls([sys.executable, FIXTURES_DIR / f"{name}.py", *args], **kwargs)

    @property
    def pid(self) -> int:
        assert self.proc is not None, "fixture not started"
        return self.proc.pid

    def start(self) -> Fixture:
        # stderr goes to a file: an unread pipe could fill up and block the fixture.
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 (closed by close())
        self.proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            start_new_session=True,  # own process group: killpg reaches forked children
            env=self.env,
        )
        threading.Thread(target=self._read_stdout, name="fixture-stdout", daemon=True).start()
        # Reap as soon as it exits: a zombie would still look present in /proc.
        threading.Thread(target=self.proc.wait, name="fixture-reaper", daemon=True).start()
        return self

    def _read_stdout(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for raw in iter(self.proc.stdout.readline, b""):
            self._queue.put(raw.decode(errors="replace").rstrip("\n"))
        self._queue.put(_EOF)

    def __enter__(self) -> Fixture:
        self.start()
        try:
            if self.ready:
                self.info = self.wait_for(self.ready)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _drain(self, block_s: float = 0.0) -> bool:
        """Move queued lines into ``self.lines``; False once stdout is closed."""
        try:
            item = self._queue.get(timeout=block_s) if block_s > 0 else self._queue.get_nowait()
            while True:
                if item is _EOF:
                    self._eof = True
                    return False
                self.lines.append(item)
                item = self._queue.get_nowait()
        except queue.Empty:
            return not self._eof

    def _find(self, token: str, start: int) -> int:
        for i in range(start, len(self.lines)):
            if self.lines[i].split(maxsplit=1)[:1] == [token]:
                return i
        return -1

    def wait_for(self, token: str, timeout: float | None = None) -> FixtureLine:
        """Wait for the next stdout line whose first word is ``token``; parse it."""
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            open_ = self._drain()
            i = self._find(token, self._cursor)
            if i >= 0:
                self._cursor = i + 1
                return FixtureLine(self.lines[i])
            if not open_:
                raise FixtureError(self.describe(f"stdout closed before a {token} line"))
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise FixtureError(self.describe(f"no {token} line within {timeout} s"))
            self._drain(block_s=min(remaining, 0.1))

    def seen(self, token: str) -> bool:
        """Whether a ``token`` line has arrived by now (consumed or not); never blocks."""
        self._drain()
        return self._find(token, 0) >= 0

    def send(self, line: str) -> None:
        """Write one line to the fixture's stdin."""
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()

    def wait_exit(self, timeout: float) -> int:
        """Wait for the fixture's main process to exit by itself; its exit status."""
        assert self.proc is not None
        return self.proc.wait(timeout=timeout)

    def stderr(self) -> str:
        if self._stderr is None or self._stderr.closed:
            return ""
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")

    def describe(self, what: str) -> str:
        rc = None if self.proc is None else self.proc.poll()
        self._drain()
        out = "\n".join(self.lines) or "(none)"
        return (
            f"fixture {' '.join(self.argv)}: {what}\n"
            f"exit status: {'still running' if rc is None else rc}\n"
            f"stdout:\n{out}\nstderr:\n{self.stderr() or '(none)'}"
        )

    def close(self) -> None:
        if self.proc is None:
            if self._stderr is not None:
                self._stderr.close()
            return
        with contextlib.suppress(ProcessLookupError):  # the whole group is already gone
            os.killpg(self.proc.pid, signal.SIGKILL)
        try:
            self.proc.wait(timeout=10)
        finally:
            for f in (self.proc.stdin, self.proc.stdout):
                # stdin may report EPIPE for data the dead fixture never read
                with contextlib.suppress(OSError):
                    if f is not None:
                        f.close()
            if self._stderr is not None:
                self._stderr.close()


# --- /proc helpers: what a thread is doing right now -------------------------------------


def tasks(pid: int) -> list[int]:
    """TIDs of the threads of ``pid`` (empty once it is gone)."""
    try:
        return sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
    except FileNotFoundError:
        return []


def _stat_fields(pid: int, tid: int) -> list[str]:
    """Fields of /proc/PID/task/TID/stat after ``comm``: [0] is the state (field 3)."""
    with open(f"/proc/{pid}/task/{tid}/stat") as f:
        return f.read().rpartition(")")[2].split()


def thread_state(pid: int, tid: int) -> str:
    """One letter (R, S, D, Z, ...), or ``-`` when the thread is gone."""
    try:
        return _stat_fields(pid, tid)[0]
    except (FileNotFoundError, ProcessLookupError):
        return "-"


def parent_pid(pid: int) -> int:
    return int(_stat_fields(pid, pid)[1])


def thread_cpu_ticks(pid: int, tid: int) -> int:
    """utime + stime of one thread, in clock ticks."""
    fields = _stat_fields(pid, tid)
    return int(fields[11]) + int(fields[12])  # stat fields 14 and 15


def thread_syscall(pid: int, tid: int) -> str:
    """The raw /proc/PID/task/TID/syscall line (``running``, ``-1 sp pc`` or ``NR args...``)."""
    with open(f"/proc/{pid}/task/{tid}/syscall") as f:
        return f.read().strip()


def futex_wait(pid: int, tid: int) -> tuple[int, int, int] | None:
    """``(uaddr, op, val)`` when the thread sleeps in futex(2), else None."""
    try:
        if thread_state(pid, tid) != "S":
            return None
        words = thread_syscall(pid, tid).split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    if len(words) < 4 or words[0] != str(SYS_FUTEX) or thread_state(pid, tid) != "S":
        return None
    return int(words[1], 16), int(words[2], 16), int(words[3], 16)


def blocked_in(pid: int, tid: int) -> int | None:
    """The syscall number a sleeping thread is blocked in, else None."""
    try:
        if thread_state(pid, tid) not in ("S", "D"):
            return None
        nr = thread_syscall(pid, tid).split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return int(nr) if nr.lstrip("-").isdigit() and int(nr) >= 0 else None


def read_u32(pid: int, addr: int, count: int = 1) -> list[int]:
    """``count`` native u32 at ``addr`` in ``pid``'s memory (needs ptrace access to it)."""
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as f:
        f.seek(addr)
        data = f.read(4 * count)
    return list(struct.unpack(f"={count}I", data))


def mutex_word_and_owner(pid: int, addr: int) -> tuple[int, int]:
    """glibc x86-64 ``pthread_mutex_t``: ``__lock`` at +0 and ``__owner`` (a TID) at +8."""
    lock, _count, owner = read_u32(pid, addr, 3)
    return lock, owner


def wait_until(
    predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.02
) -> object:
    """Poll ``predicate`` until it returns something truthy; AssertionError naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)
