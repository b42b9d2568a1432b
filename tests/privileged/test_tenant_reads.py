"""Attacks on the rights and memory of the reads hangwatch makes on a target's behalf.

* **The exec race.** A target run as ``nobody`` parks threads in frames compiled under the
  name of a root-only file, and a second process of the same tenant watches for the py-spy
  that reads it. When that py-spy exits, the target execs ``su`` (setuid root, waiting for a
  password on a pipe): from then on /proc/PID/status says fsuid 0. A reader that takes the
  target's credentials when it reads the source lines, after the frames, reads the file as
  root. No byte of it may appear in ``diagnose --json`` or in the daemon's log.
* **The symbol-table bomb.** A target run as ``nobody`` deadlocks on two mutexes that live in
  a library whose .symtab holds two million function symbols (48 MB). The daemon names the
  lock words from it when it writes the flight record: its peak memory must stay under the
  shipped unit's ``MemoryMax=512M``.
* **A non-dumpable target.** A process that dropped root by itself: no file is read on its
  behalf, not even its own.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from scripts.elfbomb import symbol_bomb
from scripts.fixturelib import Fixture
from tests.limits import HANG_S
from tests.privileged.daemonlib import INTERVAL, free_port, running_daemon
from tests.privileged.harness import RunningDiagnose, diagnose_argv
from tests.privileged.test_confinement import NOBODY, PYTHON, parked, stack_frames
from tests.realsw.serving.native import build_abba

# one worker: its daemons select their targets by a mark the module shares
pytestmark = pytest.mark.xdist_group("privileged-tenant-reads")

MARK = "hangwatch-tenant-reads-target"
MEMORY_MAX = 512 << 20  # deploy/systemd/hangwatch.service
SU = "/usr/bin/su"

THREADS, DEPTH = 50, 100  # the attack: 50 threads of 100 frames
# Each frame at line 2 of the file it is compiled under.
PARK = "def park(lock, n):\n    return park(lock, n - 1) if n else lock.acquire()\n"
RACER = f"""
# {MARK}
import ctypes, mmap, os, sys, threading
secret, word_path, threads, depth = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
ns = {{}}
exec(compile({PARK!r}, secret, "exec"), ns)
for _ in range(threads):
    lock = threading.Lock()
    lock.acquire()
    threading.Thread(target=ns["park"], args=(lock, depth), daemon=True).start()
word = mmap.mmap(os.open(word_path, os.O_RDWR), 4096)
addr = ctypes.addressof(ctypes.c_int.from_buffer(word))
libc = ctypes.CDLL(None)
r, w = os.pipe()  # su's stdin: the password never comes

def swap():
    while word[0] == 0:  # FUTEX_WAIT on a shared word: the watcher wakes it
        libc.syscall(202, ctypes.c_void_p(addr), 0, 0, None)
    os.dup2(r, 0)
    os.execv({SU!r}, ["su", "root", "-c", "true"])

t = threading.Thread(target=swap)
t.start()
print("READY", flush=True)
t.join()
"""
# The same tenant's other process: lets the first ``skip`` py-spy reads of the target pass,
# waits for the next one to exit, then wakes the target's swap thread (one futex wake: the
# exec follows within microseconds). Counted, not timed: a slow start must not race another read.
WATCHER = """
import ctypes, mmap, os, select, sys, time
target, word_path, skip = sys.argv[1], sys.argv[2], int(sys.argv[3])
needle = b"--pid\\0" + target.encode() + b"\\0"
word = mmap.mmap(os.open(word_path, os.O_RDWR), 4096)
addr = ctypes.addressof(ctypes.c_int.from_buffer(word))
libc = ctypes.CDLL(None)
seen = set()

def kthread(pid):
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[1] in (b"0", b"2")
    except (OSError, IndexError):
        return False

print("READY", flush=True)
while True:
    for name in os.listdir("/proc"):
        if not name.isdigit() or name in seen:
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                argv = f.read()
            pidfd = os.pidfd_open(int(name))
        except OSError:
            continue
        if not argv.split(b"\\0", 1)[0].endswith(b"py-spy") or needle not in argv:
            # A Python process may be a fork about to exec py-spy, and one mid-exec reads as
            # an empty command line: look again. Kernel threads (empty too) are children of 2.
            if (argv and b"python" not in argv) or (not argv and kthread(name)):
                seen.add(name)
            os.close(pidfd)
            continue
        seen.add(name)
        if skip > 0:  # a read let pass: not the one raced
            skip -= 1
            os.close(pidfd)
            continue
        select.select([pidfd], [], [])  # readable when it exits
        word[0] = 1
        libc.syscall(202, ctypes.c_void_p(addr), 1, 1)  # FUTEX_WAKE
        sys.exit(0)
    time.sleep(0.0005)
"""


class Race:
    """The protected file, and a target that execs su once the py-spy that read it exits."""

    def __init__(self, private: Path, shared: Path) -> None:
        self.token = secrets.token_hex(8)
        self.secret = private / "secret"  # root only: 0600 in a 0700 directory
        self.secret.write_text(f"SECRET-1-{self.token}\n    lock.acquire() SECRET-2-{self.token}\n")
        self.secret.chmod(0o600)
        self.word = shared / "word"
        self.word.write_bytes(bytes(4096))
        self.word.chmod(0o666)

    def target(self) -> Fixture:
        argv = [PYTHON, "-c", RACER, str(self.secret), str(self.word), str(THREADS), str(DEPTH)]
        return Fixture([*NOBODY, *argv], timeout=30)

    def watcher(self, pid: int, skip: int = 0) -> Fixture:
        """Races the py-spy that reads ``pid`` after the first ``skip`` of them."""
        argv = [PYTHON, "-c", WATCHER, str(pid), str(self.word), str(skip)]
        return Fixture([*NOBODY, *argv], timeout=30)

    def leaked(self, text: str) -> bool:
        return self.token in text or "SECRET-" in text


def exe_of(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return None


def raced(pid: int, timeout: float = 30, log: Callable[[], str] = str) -> None:
    """Wait until the target has exec'd su: the attack ran (else the test proves nothing)."""
    assert exec_seen(pid, timeout), f"{pid} never exec'd su: no race run\n{log()}"


def exec_seen(pid: int, within: float) -> bool:
    """Whether the target execs su within ``within`` seconds."""
    deadline = time.monotonic() + within
    while exe_of(pid) != SU:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


# diagnose runs until the watcher catches its py-spy: one that lives a few milliseconds can
# start and exit between two of the watcher's scans of /proc when the host runs the suite
# side by side (hundreds of processes to scan), and then no race was run.
RACE_TRIES = 6


@pytest.fixture
def race(tmp_path: Path) -> Iterator[Race]:
    shared = Path(tempfile.mkdtemp(prefix="hangwatch-race-"))
    shared.chmod(0o755)
    try:
        yield Race(tmp_path, shared)
    finally:
        shutil.rmtree(shared, ignore_errors=True)


@pytest.mark.skipif(not os.path.exists(SU), reason="needs su")
def test_an_exec_between_the_frames_and_the_lines_reads_nothing_as_root(race: Race) -> None:
    with race.target() as target:
        parked(target.pid, THREADS + 2)  # the parked threads, the swap thread, main in join
        with race.watcher(target.pid):
            runs = []
            for _ in range(RACE_TRIES):
                run = RunningDiagnose(diagnose_argv([target.pid], threshold=1, duration=2))
                runs.append(run.finish(timeout=HANG_S))
                if exec_seen(target.pid, 5):
                    break
            raced(target.pid, timeout=0)
    for got in runs:
        assert got.returncode == 0, got.explain("diagnose failed")
        assert not race.leaked(got.stdout + got.stderr), got.explain("the protected file leaked")


@pytest.mark.skipif(not os.path.exists(SU), reason="needs su")
def test_an_exec_between_the_reads_of_the_flight_record_reads_nothing_as_root(
    race: Race, tmp_path: Path
) -> None:
    """The daemon reads the stacks twice in a park: for the site, at half the threshold
    (no source lines), and for the flight record, at the change to stalled. The watcher lets
    the first pass and races the second."""
    port = free_port()
    threshold = 6
    cfg = tmp_path / "hangwatch.yaml"
    cfg.write_text(
        f'listen: "127.0.0.1:{port}"\ninterval_seconds: {INTERVAL}\n'
        f"park_threshold_seconds: {threshold}\n"
        f"targets:\n  - name: racer\n    cmdline: {MARK!r}\n"
    )
    with running_daemon(cfg, port) as d, race.target() as target:
        parked(target.pid, THREADS + 2)
        with race.watcher(target.pid, skip=1):
            raced(target.pid, timeout=HANG_S, log=d.output)
            stalled = f"pid {target.pid}: progressing -> stalled"
            deadline = time.monotonic() + 20  # the flight record follows the change's line
            while f"process {target.pid}: " not in d.output() and time.monotonic() < deadline:
                time.sleep(0.2)
        log = d.output()
    assert not race.leaked(log), log
    assert stalled in log and f"process {target.pid}: " in log, log


# --- the symbol-table bomb -----------------------------------------------------------------

BOMB_SYMBOLS = 2_000_000
BOMBED = f"""
# {MARK}
import ctypes, sys, threading
lib = ctypes.CDLL(sys.argv[1])
assert lib.abba_init() == 0
threads = [threading.Thread(target=getattr(lib, n)) for n in ("abba_ab", "abba_ba")]
for t in threads:
    t.start()
print("READY", flush=True)
for t in threads:
    t.join()
"""


def peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for {pid}")


def test_a_symbol_table_bomb_keeps_the_daemon_under_its_memory_limit(tmp_path: Path) -> None:
    shared = Path(tempfile.mkdtemp(prefix="hangwatch-bomb-"))
    try:
        shared.chmod(0o755)
        bomb = shared / "libbomb.so"
        symbol_bomb(build_abba(tmp_path / "abba"), bomb, BOMB_SYMBOLS)
        bomb.chmod(0o755)
        port = free_port()
        cfg = tmp_path / "hangwatch.yaml"
        cfg.write_text(
            f'listen: "127.0.0.1:{port}"\ninterval_seconds: {INTERVAL}\n'
            f"park_threshold_seconds: 2\ntargets:\n  - name: bomb\n    cmdline: {MARK!r}\n"
        )
        target = Fixture([*NOBODY, PYTHON, "-c", BOMBED, str(bomb)], timeout=30)
        with running_daemon(cfg, port) as d, target:
            parked(target.pid, 3)
            deadline = time.monotonic() + 90
            while "in libbomb.so" not in d.output() and time.monotonic() < deadline:
                assert d.running(), d.output()
                time.sleep(0.2)
            peak = peak_rss(d.pid)
            log = d.output()
    finally:
        shutil.rmtree(shared, ignore_errors=True)
    assert "`abba_a` in libbomb.so" in log, log  # the lock words named from the bomb itself
    assert peak < MEMORY_MAX, f"daemon peak RSS {peak >> 20} MiB\n{log}"


# --- a target the kernel made non-dumpable -----------------------------------------------------

DROPPED = f"""
# {MARK}
import os, sys, threading
own = sys.argv[1]
os.setgroups([])
os.setgid(65534)
os.setuid(65534)  # root dropped to nobody: the kernel makes it non-dumpable
ns = {{}}
exec(compile({PARK!r}, own, "exec"), ns)
lock = threading.Lock()
lock.acquire()
t = threading.Thread(target=ns["park"], args=(lock, 3))
t.start()
print("READY", flush=True)
t.join()
"""


def test_a_target_that_changed_its_credentials_is_not_read_for(tmp_path: Path) -> None:
    """A process that dropped root by itself (a service's `--user`) is non-dumpable: even its
    own user may not read its memory, and its rights are not simply its ids. No file is read
    on its behalf, not even one its user may read; its frames are still shown."""
    shared = Path(tempfile.mkdtemp(prefix="hangwatch-dropped-"))
    try:
        shared.chmod(0o755)
        own = shared / "own.py"
        own.write_text(PARK)
        own.chmod(0o644)
        with Fixture([PYTHON, "-c", DROPPED, str(own)], timeout=30) as target:
            parked(target.pid, 2)
            got = RunningDiagnose(diagnose_argv([target.pid], threshold=1, duration=2)).finish(
                timeout=HANG_S
            )
    finally:
        shutil.rmtree(shared, ignore_errors=True)
    assert got.returncode == 0, got.explain("diagnose failed")
    frames = stack_frames(got.report or {}, target.pid)
    assert str(own) in frames, got.explain("no frame in the target's own file")
    f = frames[str(own)]
    assert f["code"] is None and f["code_withheld"] == "the target is not dumpable", got.explain(
        "the line of a non-dumpable target"
    )
