"""Real Ray (and Ray Serve) in the hang and healthy shapes hangwatch must tell apart.

Run by the Ray venv's python (``tests/realsw/raylib.py`` knows it), never by the project's:

    python ray_jobs.py --shape NAME --temp-dir DIR [--port HTTP_PORT]

The driver starts a local cluster (``ray.init``), brings it into the shape and prints one
flushed line: ``READY shape=NAME pid=DRIVER role=driver ...`` with the PIDs of the processes
that matter (``replica=``, ``proxy=``, ``controller=``, ``actor=``, ``workers=``) and the HTTP
``port=``. Then it stays in the shape until killed. Commands on stdin:

* ``load``: start the continuous client (what ``serve_load`` starts at once), so an idle Serve
  cluster becomes a loaded one without a second start; it answers ``LOADING``.

The HTTP clients run **outside** the driver's process tree, as real clients do: a client that
is a thread of the driver is a process of the service, so the proxy's port would be its
plumbing. Each is a fresh python, started through a launcher that exits at once (so it is
reparented away from the driver), with its cwd in Ray's temp dir, where raylib's sweep finds
and ends it.

| shape | what happens | truth |
| --- | --- | --- |
| serve_idle | a Serve app (HTTP proxy on ``--port``), no requests | idle |
| serve_load | the same, a client sending requests back to back | progressing |
| serve_abba | two requests; the replica's two threads take two threading.Locks in opposite order | stalled (deadlocked, but no kernel-visible cycle) |
| serve_event | one request; the replica blocks in threading.Event().wait() | stalled |
| get_stuck_actor | the driver in ray.get on an actor method blocked on an Event | stalled |
| actor_self_call | an actor (max_concurrency=1) whose method ray.get()s its own other method | stalled |
| infeasible_task | a task with num_gpus=1 on a CPU-only node; the driver in ray.get | stalled |
| tasks_computing | tasks in pure Python loops for --seconds; the driver in ray.get | progressing |
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import threading
import time

# Before `import ray`: keep the node on 127.0.0.1, no usage-stats egress, quiet start.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_DISABLE_IMPORT_WARNING", "1")

import ray
from ray import serve

SHAPES = (
    "serve_idle",
    "serve_load",
    "serve_abba",
    "serve_event",
    "get_stuck_actor",
    "actor_self_call",
    "infeasible_task",
    "tasks_computing",
)
APP = "hw"  # the Serve application's name
TEMP_DIR = "."  # Ray's temp dir (main sets it): the clients' cwd

# A client, stdlib only: GET PATH once (a pending request never returns), or ``load``: GET /
# back to back on one connection, writing the count answered to ANSWERED after each.
CLIENT = """
import http.client, os, sys, time
port, what, answered = int(sys.argv[1]), sys.argv[2], sys.argv[3]
conn = http.client.HTTPConnection("127.0.0.1", port)
n = 0
while True:
    conn.request("GET", "/" if what == "load" else what)
    conn.getresponse().read()
    if what != "load":
        break
    n += 1
    with open(answered + ".tmp", "w") as f:
        f.write(str(n))
    os.replace(answered + ".tmp", answered)
time.sleep(1e9)
"""
# Starts argv in a session of its own and exits: its child is no descendant of the driver.
LAUNCH = "import subprocess, sys; subprocess.Popen(sys.argv[1:], start_new_session=True)"


def say(token: str, **kv: object) -> None:
    words = " ".join(f"{k}={v}" for k, v in kv.items())
    sys.stdout.write(f"{token} {words}\n")
    sys.stdout.flush()


def children_of(pid: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    if int(f.read().rpartition(")")[2].split()[1]) == pid:
                        out.append(int(name))
            except (OSError, ValueError, IndexError):
                continue
    return sorted(out)


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        for c in children_of(todo.pop(0)):
            out.append(c)
            todo.append(c)
    return out


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def find(prefix: str, timeout: float = 60.0) -> int:
    """The one process below the driver whose (setproctitle'd) cmdline starts with ``prefix``."""
    deadline = time.monotonic() + timeout
    while True:
        found = [p for p in descendants(os.getpid()) if cmdline(p).startswith(prefix)]
        if len(found) == 1:
            return found[0]
        if time.monotonic() > deadline:
            raise SystemExit(f"want one process {prefix!r} below the driver, found {found}")
        time.sleep(0.2)


# --- Serve ---------------------------------------------------------------------------------


def note_stuck(path: str) -> None:
    """Append this thread's native TID to ``path``: the driver learns the stuck threads from
    the file, not by calling the replica (a call would wake the driver's threads just as the
    hang begins, which no real client of a hung replica does)."""
    with open(path, "a") as f:
        f.write(f"{threading.get_native_id()}\n")


def stuck_tids(path: str, count: int, timeout: float = 60.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with open(path) as f:
                tids = [int(t) for t in f.read().split()]
        except FileNotFoundError:
            tids = []
        if len(tids) >= count:
            return tids
        if time.monotonic() > deadline:
            raise SystemExit(f"want {count} stuck threads in {path}, found {tids}")
        time.sleep(0.1)


@serve.deployment(max_ongoing_requests=4, ray_actor_options={"num_cpus": 0})
class Hello:
    def pid(self) -> int:
        return os.getpid()

    async def __call__(self, request: object) -> str:
        return "hello\n"


@serve.deployment(max_ongoing_requests=4, ray_actor_options={"num_cpus": 0})
class Abba:
    """``/ab`` takes lock a then b, ``/ba`` b then a; a barrier makes both hold their first."""

    def __init__(self, stuck_file: str) -> None:
        self.a = threading.Lock()
        self.b = threading.Lock()
        self.both_hold_one = threading.Barrier(2)
        self.stuck_file = stuck_file  # native TIDs of the threads in the cycle, a line each

    def pid(self) -> int:
        return os.getpid()

    def _work(self, path: str) -> str:
        first, second = (self.a, self.b) if path.endswith("/ab") else (self.b, self.a)
        with first:
            note_stuck(self.stuck_file)
            self.both_hold_one.wait()
            with second:  # never: the other thread holds it and waits for ours
                return "done\n"

    async def __call__(self, request: object) -> str:
        # Each request in a thread of its own (the user-code loop's default executor).
        return await asyncio.to_thread(self._work, request.url.path)  # type: ignore[attr-defined]


@serve.deployment(max_ongoing_requests=4, ray_actor_options={"num_cpus": 0})
class Waiter:
    """Every request waits for an Event nobody sets."""

    def __init__(self, stuck_file: str) -> None:
        self.never = threading.Event()
        self.stuck_file = stuck_file

    def pid(self) -> int:
        return os.getpid()

    def _wait(self) -> str:
        note_stuck(self.stuck_file)
        self.never.wait()
        return "never\n"

    async def __call__(self, request: object) -> str:
        return await asyncio.to_thread(self._wait)


def listening(port: int) -> bool:
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            rows = [r.split() for r in list(f)[1:]]
        if any(r[3] == "0A" and int(r[1].rpartition(":")[2], 16) == port for r in rows):
            return True
    return False


def wait_listening(port: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not listening(port):
        if time.monotonic() > deadline:
            raise SystemExit(f"nothing listens on port {port} after {timeout} s")
        time.sleep(0.1)


def outside_client(port: int, what: str) -> str:
    """Start a client outside the driver's tree (``what``: a path, or ``load``); returns the
    file where a ``load`` client counts its answers."""
    answered = os.path.join(TEMP_DIR, f"answered-{os.getpid()}-{what.strip('/') or 'root'}")
    argv = [sys.executable, "-c", CLIENT, str(port), what, answered]
    subprocess.run([sys.executable, "-c", LAUNCH, *argv], check=True, cwd=TEMP_DIR)
    return answered


def pending(port: int, path: str) -> None:
    """A request that is never answered (no timeout), from outside the service."""
    outside_client(port, path)


def answered(counter: str) -> int:
    try:
        with open(counter) as f:
            return int(f.read() or 0)
    except FileNotFoundError:
        return 0


def load(port: int) -> int:
    """Requests back to back on one connection, forever, from outside the service; returns
    once 10 were answered, with how many were."""
    counter = outside_client(port, "load")
    while (n := answered(counter)) < 10:
        time.sleep(0.1)
    return n


def serve_shape(shape: str, port: int, idle_before: float) -> None:
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    stuck_file = os.path.join(TEMP_DIR, "stuck-tids")
    if shape in ("serve_abba", "serve_event"):
        deployment = (Abba if shape == "serve_abba" else Waiter).bind(stuck_file)  # type: ignore[attr-defined]
    else:
        deployment = Hello.bind()  # type: ignore[attr-defined]
    handle = serve.run(deployment, name=APP, route_prefix="/")
    replica = handle.pid.remote().result()
    wait_listening(port)  # no request yet: serve_idle must have answered none
    proxy = find("ray::ProxyActor")
    controller = find("ray::ServeController")
    info = dict(replica=replica, proxy=proxy, controller=controller, port=port)
    if shape == "serve_load":
        load(port)
    elif shape in ("serve_abba", "serve_event"):
        paths = ["/ab", "/ba"] if shape == "serve_abba" else ["/wait"]
        time.sleep(idle_before)  # a hang comes after start-up, not with it
        for path in paths:
            pending(port, path)
        tids = stuck_tids(stuck_file, len(paths))
        time.sleep(0.5)  # past the second append: in the lock / the wait
        info["tids"] = ",".join(map(str, tids))
    say("READY", shape=shape, pid=os.getpid(), role="driver", **info)
    for line in sys.stdin:
        if line.strip() == "load" and shape == "serve_idle":
            say("LOADING", answered=load(port))
    threading.Event().wait()  # stdin closed: stay in the shape until killed


# --- core Ray ------------------------------------------------------------------------------


@ray.remote(num_cpus=0)
class Stuck:
    def __init__(self) -> None:
        self.never = threading.Event()

    def pid(self) -> int:
        return os.getpid()

    def block(self) -> None:
        say("BLOCKING", pid=os.getpid(), tid=threading.get_native_id())  # to the worker's log
        self.never.wait()


@ray.remote(num_cpus=0, max_concurrency=1)
class Selfish:
    def pid(self) -> int:
        return os.getpid()

    def inner(self) -> str:
        say("INNER", pid=os.getpid())  # never printed: the actor's only slot is taken
        return "inner"

    def outer(self) -> str:
        say("OUTER", pid=os.getpid(), tid=threading.get_native_id())
        me = ray.get_runtime_context().current_actor
        # queued behind this very call, which holds the actor's only slot: never runs
        return str(ray.get(me.inner.remote()))


@ray.remote(num_gpus=1)
def needs_gpu() -> int:
    return os.getpid()


@ray.remote(num_cpus=1)
def compute(seconds: float) -> int:
    say("COMPUTING", pid=os.getpid())
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        n = sum(i * i for i in range(10_000)) + n % 7
    return n


# The actor shapes: the actor's class, and the method whose call never returns.
ACTORS = {"get_stuck_actor": (Stuck, "block"), "actor_self_call": (Selfish, "outer")}


def core_shape(shape: str, args: argparse.Namespace) -> None:
    me = os.getpid()
    if shape in ACTORS:
        cls, method = ACTORS[shape]
        actor = cls.remote()  # type: ignore[attr-defined]
        pid = ray.get(actor.pid.remote())
        time.sleep(args.idle_before)  # a hang comes after start-up, not with it
        ref = getattr(actor, method).remote()
        say("READY", shape=shape, pid=me, role="driver", actor=pid)
        ray.get(ref)
    elif shape == "infeasible_task":
        time.sleep(args.idle_before)
        ref = needs_gpu.remote()
        say("READY", shape=shape, pid=me, role="driver")
        ray.get(ref)
    elif shape == "tasks_computing":
        refs = [compute.remote(args.seconds) for _ in range(args.tasks)]
        say("READY", shape=shape, pid=me, role="driver", tasks=args.tasks)
        ray.get(refs)
        say("DONE", shape=shape)
    threading.Event().wait()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=SHAPES, required=True)
    ap.add_argument("--temp-dir", required=True, help="Ray's temp dir (sessions, logs)")
    ap.add_argument("--port", type=int, default=8000, help="Serve's HTTP port")
    ap.add_argument("--num-cpus", type=int, default=2)
    ap.add_argument("--tasks", type=int, default=2, help="tasks_computing: how many tasks")
    ap.add_argument("--seconds", type=float, default=3600.0, help="tasks_computing: how long")
    ap.add_argument(
        "--idle-before",
        type=float,
        default=20.0,
        help="the hang shapes: seconds the cluster idles before the hang begins",
    )
    args = ap.parse_args()
    global TEMP_DIR
    TEMP_DIR = os.path.abspath(args.temp_dir)
    ray.init(
        num_cpus=args.num_cpus,
        num_gpus=0,
        include_dashboard=False,
        _temp_dir=os.path.abspath(args.temp_dir),
        logging_level="WARNING",
    )
    if args.shape.startswith("serve_"):
        serve_shape(args.shape, args.port, args.idle_before)
    else:
        core_shape(args.shape, args)


if __name__ == "__main__":
    main()
