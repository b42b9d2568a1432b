"""Real software for the tests: the cached venv and the PyTorch jobs of ``tests/realsw``.

``scripts/setup.sh`` installs ``tests/realsw/requirements.txt`` (torch, a serving stack) into a
venv outside the checkout, ``$HANGWATCH_REALSW_VENV`` (default ``/var/cache/hangwatch/realsw``),
and writes the file's sha256 into it as a stamp. This module finds that venv's python and
torchrun, says what is missing, and starts ``tests/realsw/torch_jobs.py`` in its shapes as a
:class:`Job`: a :class:`~scripts.fixturelib.Fixture` that also kills the processes that left its
process group (torchrun starts every worker in a session of its own, so killing the launcher's
group alone would leave the ranks running).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from scripts.daemonproc import free_port
from scripts.fixturelib import REPO_ROOT, Arg, Fixture, FixtureError, FixtureLine

DEFAULT_VENV = Path("/var/cache/hangwatch/realsw")
REQUIREMENTS = REPO_ROOT / "tests" / "realsw" / "requirements.txt"
TORCH_JOBS = REPO_ROOT / "tests" / "realsw" / "torch_jobs.py"
STAMP_NAME = ".hangwatch-realsw-stamp"  # same name as in scripts/setup.sh
START_TIMEOUT = 120.0  # importing torch takes 2-4 s per process; 3 of them share 2 cores here

# What a job must not inherit from whoever runs the tests: it would change the rendezvous.
_SCRUBBED = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "VIRTUAL_ENV",
    "PYTHONPATH",
    "PYTHONHOME",
)


def venv() -> Path:
    return Path(os.environ.get("HANGWATCH_REALSW_VENV") or DEFAULT_VENV)


def python() -> Path:
    return venv() / "bin" / "python"


def torchrun() -> Path:
    return venv() / "bin" / "torchrun"


def missing() -> str | None:
    """Why the real-software jobs cannot run here, or None when they can."""
    where = venv()
    for exe in (python(), torchrun()):
        if not os.access(exe, os.X_OK):
            return f"no {exe}: the real-software venv is not installed; run `make setup-tests`"
    try:
        stamp = (where / STAMP_NAME).read_text().strip()
    except OSError:
        return (
            f"{where} has no {STAMP_NAME} (an install that did not finish?); run `make setup-tests`"
        )
    want = hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()
    if stamp != want:
        return f"{where} was installed from another {REQUIREMENTS.name}; run `make setup-tests`"
    return None


def scratch_env(run_dir: Path) -> dict[str, str]:
    """What a real engine started by a test writes of its own accord (temporary files and
    unix sockets by TMPDIR, caches under ~/.cache by XDG_CACHE_HOME, or by HOME where an
    engine names ~/.cache itself, byte-code beside the modules a test puts on its path) goes
    under ``run_dir``, not into /tmp, the home directory or the checkout, where a SIGKILLed
    engine would leave it. Short names: an engine's unix sockets under TMPDIR must fit the
    107 bytes of sun_path."""
    tmp, cache = run_dir / "t", run_dir / "c"
    tmp.mkdir(parents=True, exist_ok=True)
    cache.mkdir(exist_ok=True)
    return {
        "TMPDIR": str(tmp),
        "XDG_CACHE_HOME": str(cache),
        "HOME": str(run_dir),
        "PYTHONDONTWRITEBYTECODE": "1",
    }


def job_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _SCRUBBED}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


# --- process trees -------------------------------------------------------------------------


def _ppids() -> dict[int, int]:
    """PID -> parent PID for every process now."""
    out: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                out[int(name)] = int(f.read().rpartition(")")[2].split()[1])
        except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
            continue
    return out


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children first, then theirs)."""
    children: dict[int, list[int]] = {}
    for child, parent in _ppids().items():
        children.setdefault(parent, []).append(child)
    out: list[int] = []
    todo = [pid]
    while todo:
        for child in sorted(children.get(todo.pop(0), [])):
            out.append(child)
            todo.append(child)
    return out


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


SHM = "/dev/shm/"


def shm_held(pids: list[int]) -> set[str]:
    """The /dev/shm names ``pids`` map or hold open (POSIX shared memory and semaphores); not
    those already unlinked."""
    names: set[str] = set()
    for pid in pids:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as f:
            for line in f:
                at = line.find(SHM)
                if at >= 0:
                    names.add(line[at:].rstrip("\n"))
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    names.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return {
        n[len(SHM) :]
        for n in names
        if n.startswith(SHM) and not n.endswith(" (deleted)") and "/" not in n[len(SHM) :]
    }


def kill_tree(pid: int, timeout: float = 10.0) -> None:
    """SIGKILL ``pid`` and all its descendants, wherever their process groups are, and unlink
    what of /dev/shm they held and nobody else does (an engine's shared memory and semaphores,
    which a SIGKILL leaves and no environment variable moves).

    Stops the tree first, top down, until a scan finds nobody new: a stopped process cannot
    fork, and a process killed before its children were found would orphan them to init.
    """
    stopped: list[int] = []
    _signal(pid, signal.SIGSTOP)
    stopped.append(pid)
    while True:
        new = [p for p in descendants(pid) if p not in stopped]
        if not new:
            break
        for p in new:
            _signal(p, signal.SIGSTOP)
        stopped.extend(new)
    held = shm_held(stopped)
    for p in stopped:
        _signal(p, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    for p in stopped[1:]:  # the root is reaped by its Popen; the rest by their parents or init
        while alive(p) and time.monotonic() < deadline:
            time.sleep(0.01)
    if held:
        gone = set(stopped)
        others = [int(n) for n in os.listdir("/proc") if n.isdigit() and int(n) not in gone]
        for name in held - shm_held(others):
            with contextlib.suppress(OSError):
                os.unlink(SHM + name)


def alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def cmdline(pid: int) -> str:
    """The command line (as setproctitle may have rewritten it), spaces for NULs; empty when
    gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def cpu_ticks(pid: int) -> int:
    """utime + stime of the whole process, in clock ticks (0 once gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0
    return int(fields[11]) + int(fields[12])


def listening(port: int) -> bool:
    """Whether a TCP socket listens on ``port`` (any address, IPv4 or IPv6) in this netns."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for row in f:
                    local, state = row.split()[1], row.split()[3]
                    if state == "0A" and int(local.rpartition(":")[2], 16) == port:
                        return True
        except FileNotFoundError:
            continue
    return False


# --- jobs ------------------------------------------------------------------------------------


class Job(Fixture):
    """A real-software job: a :class:`Fixture` whose ``close`` kills its whole process tree."""

    def __init__(self, argv: Sequence[Arg], *, shape: str, port: int, **kwargs: Any) -> None:
        kwargs.setdefault("timeout", START_TIMEOUT)
        # a directory of its own for what the job writes unasked (torchrun's logs under
        # TMPDIR/torchelastic_*, left by the SIGKILL that ends it), removed on close
        self.scratch = Path(tempfile.mkdtemp(prefix="hw-job-"))
        kwargs["env"] = {**kwargs.get("env", job_env()), **scratch_env(self.scratch)}
        super().__init__(argv, **kwargs)
        self.shape = shape
        self.port = port

    def __enter__(self) -> Job:
        super().__enter__()
        return self

    def ready_lines(self, count: int, timeout: float | None = None) -> list[FixtureLine]:
        """The next ``count`` READY lines (one per process that reached its state)."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        return [
            self.wait_for("READY", timeout=max(0.0, deadline - time.monotonic()))
            for _ in range(count)
        ]

    def ranks(self, count: int = 2, timeout: float | None = None) -> dict[int, FixtureLine]:
        """READY lines of ``count`` ranks, by rank."""
        lines = self.ready_lines(count, timeout)
        by_rank = {line.get_int("rank"): line for line in lines}
        if len(by_rank) != count:
            raise FixtureError(self.describe(f"READY lines of {count} distinct ranks expected"))
        return by_rank

    def close(self) -> None:
        if self.proc is not None:
            kill_tree(self.proc.pid)
        super().close()
        shutil.rmtree(self.scratch, ignore_errors=True)


def torchrun_job(shape: str, *args: Arg, nproc: int = 2, **kwargs: Any) -> Job:
    """``torchrun --nproc_per_node=NPROC`` on one node, a free port, ``torch_jobs.py --shape``."""
    port = free_port()
    argv: list[Arg] = [
        torchrun(),
        f"--nproc_per_node={nproc}",
        "--master_addr=127.0.0.1",
        f"--master_port={port}",
        TORCH_JOBS,
        "--shape",
        shape,
        *args,
    ]
    return Job(argv, shape=shape, port=port, ready=None, **kwargs)


def node_jobs(
    shape: str, run_id: str | None, *args: Arg, master_addr: str = "127.0.0.1", **kwargs: Any
) -> tuple[Job, Job]:
    """One job over two "nodes" of this machine: ``torchrun --nnodes=2 --nproc_per_node=2``
    twice, node 0 hosting the store, with static rendezvous at ``master_addr`` (node 0 has
    ranks 0 and 1, node 1 ranks 2 and 3). With ``run_id``, ``--rdzv_id=RUN_ID``
    (TORCHELASTIC_RUN_ID); without, the default invocation, whose ranks share only the
    rendezvous endpoint. Not started: enter node 0 first."""
    port = free_port()

    def node(rank: int) -> Job:
        argv: list[Arg] = [
            torchrun(),
            "--nnodes=2",
            f"--node_rank={rank}",
            "--nproc_per_node=2",
            f"--master_addr={master_addr}",
            f"--master_port={port}",
            *([f"--rdzv_id={run_id}"] if run_id is not None else []),
            TORCH_JOBS,
            "--shape",
            shape,
            *args,
        ]
        return Job(argv, shape=shape, port=port, ready=None, **kwargs)

    return node(0), node(1)


def routable_address() -> str:
    """An address of this machine that is not loopback (what another host would reach it at),
    or 127.0.0.1 where it has none."""
    try:
        out = subprocess.run(
            ["ip", "-j", "-4", "addr", "show", "scope", "global"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
        for link in json.loads(out):
            for addr in link.get("addr_info", []):
                if addr.get("local"):
                    return str(addr["local"])
    except (OSError, subprocess.SubprocessError, ValueError):
        pass
    return "127.0.0.1"


def direct_job(shape: str, *args: Arg, **kwargs: Any) -> Job:
    """``torch_jobs.py --shape`` run by the venv's python, no torchrun; MASTER_PORT is free."""
    port = free_port()
    argv: list[Arg] = [python(), TORCH_JOBS, "--shape", shape, *args]
    env = job_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return Job(argv, shape=shape, port=port, ready=None, env=env, **kwargs)


def missing_node_job(**kwargs: Any) -> Job:
    """``torchrun --nnodes=2`` as node 0 of 2, the second node never started.

    Its agent hosts the rendezvous store and waits there for the other node's agent; no worker
    (and so no ``torch_jobs.py``) ever starts, so there is no READY line: wait for
    :func:`listening` on ``job.port`` instead.
    """
    port = free_port()
    argv: list[Arg] = [
        torchrun(),
        "--nnodes=2",
        "--node_rank=0",
        "--nproc_per_node=1",
        "--master_addr=127.0.0.1",
        f"--master_port={port}",
        TORCH_JOBS,
        "--shape",
        "training_loop",
    ]
    return Job(argv, shape="rendezvous_node_missing", port=port, ready=None, **kwargs)


def main_thread_in(pid: int, nr: int) -> bool:
    """Whether the process's main thread is blocked in syscall ``nr`` now (/proc)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/syscall") as f:
            words = f.read().split()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return bool(words) and words[0] == str(nr)


def ptrace_stop(pid: int, seconds: float) -> None:
    """What a blocking stack dumper (py-spy dump, gdb -p) does to its target: ptrace-attach
    every thread (each stops, leaving its wait), hold them ``seconds``, detach. Done from a
    process of its own, as a dumper is: the target is our child, and a thread of ours waiting
    to reap it (fixturelib's reaper) would take the attach's stop report from a tracer in
    this process, leaving the tracer's own wait for it hanging (seen once in a test run)."""
    subprocess.run(
        [sys.executable, "-c", _PTRACE_STOP, str(pid), str(seconds)],
        check=True,
        timeout=seconds + 30,
    )


# Run by ptrace_stop, in a process of its own: attach each thread, wait for it to stop,
# hold, detach.
_PTRACE_STOP = """
import ctypes, os, sys, time
PTRACE_ATTACH, PTRACE_DETACH, WALL = 16, 17, 0x40000000
pid, seconds = int(sys.argv[1]), float(sys.argv[2])
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
attached = []
try:
    for tid in sorted(int(t) for t in os.listdir(f"/proc/{pid}/task")):
        if libc.ptrace(PTRACE_ATTACH, tid, None, None) == 0:
            attached.append(tid)
            os.waitpid(tid, WALL)  # until it has stopped
    time.sleep(seconds)
finally:
    for tid in attached:
        libc.ptrace(PTRACE_DETACH, tid, None, None)
"""
