"""Real Ray (``ray[serve]``) for the tests: its venv, and ``ray_jobs.py`` in its shapes.

Ray lives in a venv of its own outside the checkout, ``$HANGWATCH_RAY_VENV`` (default
``/var/cache/hangwatch/ray``, ``pip install "ray[serve]"``), never in the project's ``.venv``
and not in the torch venv of ``scripts/realsw.py``. This module needs only the standard
library and ``scripts/``: it finds that venv, says what is missing (:func:`missing`, skipped
locally but failed under ``CI=true`` by :func:`require`), and starts ``ray_jobs.py --shape NAME``
as a :class:`RayJob`, a :class:`~scripts.fixturelib.Fixture` whose ``close`` kills the whole
Ray cluster the driver started.

Killing a Ray cluster: the driver starts ``gcs_server``, ``raylet`` and the autoscaler monitor
as its children, and the raylet starts the runtime-env agent and the workers (each actor and
Serve replica is a worker; several call ``setsid``). Ray's processes rewrite their command line
and environment (setproctitle, ``ray::ServeReplica:...``), so nothing but parent links ties
them to the test. ``close`` kills the tree by parent links (``realsw.kill_tree``, which stops
it top down first), then sweeps every process that still has a file open, or its cwd, under
the job's Ray temp dir: Ray redirects every process's stdout and stderr to a log file there, so
a process the raylet started and that was reparented to init is still found.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from scripts import realsw
from scripts.daemonproc import free_port
from scripts.fixturelib import REPO_ROOT, Arg, Fixture, FixtureError
from scripts.realsw import cmdline, cpu_ticks
from tests import gate

DEFAULT_VENV = Path("/var/cache/hangwatch/ray")
RAY_JOBS = REPO_ROOT / "tests" / "realsw" / "ray_jobs.py"
START_TIMEOUT = 180.0  # ray.init + serve.run on a busy 2-CPU machine: 10-40 s
# What ray.init raises when its raylet did not register within Ray's own fixed 30 s; a start
# that failed so is tried again, this many times in all.
NODE_START_TIMEOUT = "The current node timed out during startup"
NODE_START_TRIES = 2
# Ray puts unix sockets at TEMP/session_YYYY-MM-DD_HH-MM-SS_UUUUUU_PID/sockets/plasma_store:
# 41 + 21 characters after TEMP, and a unix socket path has at most 107.
MAX_TEMP_DIR = 107 - 41 - 21 - 4
SERVE_SHAPES = ("serve_idle", "serve_load", "serve_abba", "serve_event")
CORE_SHAPES = ("get_stuck_actor", "actor_self_call", "infeasible_task", "tasks_computing")


def venv() -> Path:
    return Path(os.environ.get("HANGWATCH_RAY_VENV") or DEFAULT_VENV)


def python() -> Path:
    return venv() / "bin" / "python"


def _site_packages() -> Path | None:
    found = sorted((venv() / "lib").glob("python3*/site-packages"))
    return found[-1] if found else None


def missing() -> str | None:
    """Why the Ray jobs cannot run here, or None when they can."""
    where = venv()
    hint = f'install it: {where}/bin/pip install "ray[serve]" (or set HANGWATCH_RAY_VENV)'
    if not os.access(python(), os.X_OK):
        return f"no {python()}: the Ray venv is not installed; {hint}"
    site = _site_packages()
    if site is None:
        return f"{where} has no lib/python3*/site-packages; {hint}"
    # pip writes the dist-info last: without it the install did not finish
    for package, module in (("ray", "ray/serve/__init__.py"), ("fastapi", "fastapi/__init__.py")):
        if not list(site.glob(f"{package}-*.dist-info")) or not (site / module).is_file():
            return f"{where}: {package} is not (completely) installed; {hint}"
    return None


def require() -> None:
    """Skip the calling test when Ray cannot run here; fail it under ``CI=true``."""
    gate.require(missing(), "Ray cannot run")


def job_env(**extra: str) -> dict[str, str]:
    env = realsw.job_env(**extra)  # scrubbed of MASTER_*, RANK, VIRTUAL_ENV, PYTHONPATH...
    for key in [k for k in env if k.startswith("RAY_")]:
        del env[key]  # nothing from whoever runs the tests may change the cluster
    env.update(
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",  # the node's address stays 127.0.0.1
        RAY_USAGE_STATS_ENABLED="0",  # no usage-stats report (egress)
        PYTHONDONTWRITEBYTECODE="1",
    )
    return env


# --- processes -----------------------------------------------------------------------------


def comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except (FileNotFoundError, ProcessLookupError):
        return ""


def holding(temp_dir: Path) -> list[int]:
    """Every process with its cwd or an open file under ``temp_dir`` (Ray's logs are there)."""
    prefix = str(temp_dir.resolve()) + "/"
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            links = [os.readlink(f"/proc/{name}/cwd")]
            links += [os.readlink(f"/proc/{name}/fd/{fd}") for fd in os.listdir(f"/proc/{name}/fd")]
        except OSError:  # gone, or a file closed while we read
            continue
        if any(link.startswith(prefix) for link in links):
            out.append(int(name))
    return sorted(out)


def sweep(temp_dir: Path, timeout: float = 10.0) -> list[int]:
    """SIGKILL what still holds ``temp_dir`` (a Ray process reparented to init); the PIDs."""
    left = holding(temp_dir)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(cmdline(p) for p in left):
        time.sleep(0.05)
    return left


def threads(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except FileNotFoundError:
        return 0


def cpu_share(pids: Sequence[int], seconds: float) -> dict[int, float]:
    """Each process's CPU over ``seconds``, in cores (1.0: one core all the time)."""
    hz = os.sysconf("SC_CLK_TCK")
    before = {p: cpu_ticks(p) for p in pids}
    time.sleep(seconds)
    return {p: (cpu_ticks(p) - before[p]) / hz / seconds for p in pids}


def connections(port: int) -> list[tuple[str, str]]:
    """ESTABLISHED TCP connections with ``port`` at either end: (local, remote) hex pairs."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError), open(table) as f:
            for row in list(f)[1:]:
                words = row.split()
                local, remote, state = words[1], words[2], words[3]
                ends = (int(local.rpartition(":")[2], 16), int(remote.rpartition(":")[2], 16))
                if state == "01" and port in ends:
                    out.append((local, remote))
    return out


def worker_log(job: RayJob, pid: int, stream: str = "out") -> str:
    """What worker ``pid`` printed (Ray sends a worker's stdout to logs/worker-*-PID.out)."""
    found = sorted(job.logs().glob(f"worker-*-{pid}.{stream}"))
    return "".join(p.read_text(errors="replace") for p in found)


# --- jobs ------------------------------------------------------------------------------------


class RayJob(Fixture):
    """``ray_jobs.py --shape NAME``: a Fixture that kills the whole cluster on close."""

    def __init__(self, argv: Sequence[Arg], *, shape: str, temp_dir: Path, port: int, **kw: Any):
        kw.setdefault("timeout", START_TIMEOUT)
        # Ray's own files go under temp_dir; the rest of what the cluster writes unasked under
        # the test's directory too (TMPDIR, caches, HOME for ~/.ray/auth_token)
        kw["env"] = {**kw.get("env", job_env()), **realsw.scratch_env(temp_dir.parent)}
        super().__init__(argv, **kw)
        self.shape = shape
        self.temp_dir = temp_dir
        self.port = port
        self.swept: list[int] = []  # what the sweep found after the tree was killed

    def __enter__(self) -> RayJob:
        super().__enter__()
        return self

    @property
    def driver(self) -> int:
        return self.info.get_int("pid")

    def pid_of(self, role: str) -> int:
        """The PID the READY line names for ``role`` (replica, proxy, controller, actor)."""
        try:
            return self.info.get_int(role)
        except KeyError:
            raise FixtureError(self.describe(f"the READY line names no {role}")) from None

    def tree(self) -> list[int]:
        """The driver and every process below it now."""
        return [self.pid, *realsw.descendants(self.pid)] if self.proc is not None else []

    def find(self, prefix: str) -> list[int]:
        """The processes of the tree whose command line starts with ``prefix`` (Ray's
        setproctitle'd ones: ``ray::ProxyActor``) or whose comm is ``prefix`` (``raylet``)."""
        return [p for p in self.tree() if cmdline(p).startswith(prefix) or comm(p) == prefix]

    def logs(self) -> Path:
        """The session's log folder (``TEMP/session_latest/logs``)."""
        return self.temp_dir / "session_latest" / "logs"

    def close(self) -> None:
        if self.proc is not None:
            realsw.kill_tree(self.proc.pid)
        super().close()
        self.swept = sweep(self.temp_dir)


def temp_dir_for(base: Path) -> Path:
    """Ray's temp dir: ``base/ray``, short enough for Ray's unix socket paths."""
    temp = base / "ray"
    if len(str(temp.resolve())) > MAX_TEMP_DIR:
        raise FixtureError(
            f"{temp} is too long for Ray's unix sockets ({MAX_TEMP_DIR} characters at most): "
            "use tmp_path_factory.mktemp with a short name"
        )
    temp.mkdir(parents=True, exist_ok=True)
    return temp


@contextlib.contextmanager
def ray_job(shape: str, base: Path, *args: Arg, **kw: Any) -> Iterator[RayJob]:
    """Start ``ray_jobs.py --shape SHAPE`` (Ray's temp dir under ``base``, Serve's HTTP port
    free); yield once it prints READY. The cluster is killed and swept on exit."""
    temp = temp_dir_for(base)
    for attempt in range(1, NODE_START_TRIES + 1):
        port = free_port()  # below the ephemeral range, as Serve's own 8000 is
        argv: list[Arg] = [python(), RAY_JOBS, "--shape", shape, "--temp-dir", temp]
        argv += ["--port", str(port), *args]
        job = RayJob(argv, shape=shape, temp_dir=temp, port=port, **kw)
        try:
            job.__enter__()  # closes the cluster (and sweeps it) if it fails
        except FixtureError as e:
            # Ray gives its raylet a fixed 30 s to register with the GCS, which a host
            # running the suite side by side can exceed: that start, not the shape, failed.
            if NODE_START_TIMEOUT not in str(e) or attempt == NODE_START_TRIES:
                raise
            continue
        try:
            yield job
        finally:
            job.close()
        return
