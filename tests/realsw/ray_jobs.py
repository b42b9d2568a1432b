"""Real Ray (and Ray Serve) in the hang and healthy shapes hangwatch must tell apart.

Run by the Ray venv's python (``tests/realsw/raylib.py`` knows it), never by the project's:

    python ray_jobs.py --shape NAME --temp-dir DIR [--port HTTP_PORT]

The driver starts a local cluster (``ray.init``), brings it into the shape and prints one
flushed line: ``READY shape=NAME pid=DRIVER role=driver ...`` with the PIDs of the processes
that matter (``replica=``, ``proxy=``, ``controller=``, ``actor=``, ``workers=``) and the HTTP
``port=``. Then it stays in the shape until killed. Commands on stdin:

* ``load``: start the continuous client (what ``serve_load`` starts at once), so an idle Serve
  cluster becomes a loaded one without a second start; it answers ``LOADING``.

| shape | what happens | truth |
| --- | --- | --- |
| serve_idle | a Serve app (HTTP proxy on ``--port``), no requests | idle |
| serve_load | the same, a driver thread sending requests back to back | progressing |
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
import http.client
import os
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
STATS = {"answered": 0}


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


@serve.deployment(max_ongoing_requests=4, ray_actor_options={"num_cpus": 0})
class Hello:
    def pid(self) -> int:
        return os.getpid()

    async def __call__(self, request: object) -> str:
        return "hello\n"


@serve.deployment(max_ongoing_requests=4, ray_actor_options={"num_cpus": 0})
class Abba:
    """``/ab`` takes lock a then b, ``/ba`` b then a; a barrier makes both hold their first."""

    def __init__(self) -> None:
        self.a = threading.Lock()
        self.b = threading.Lock()
        self.both_hold_one = threading.Barrier(2)
        self.stuck: list[int] = []  # native TIDs of the threads in the cycle

    def pid(self) -> int:
        return os.getpid()

    def tids(self) -> list[int]:
        return list(self.stuck)

    def _work(self, path: str) -> str:
        first, second = (self.a, self.b) if path.endswith("/ab") else (self.b, self.a)
        with first:
            self.stuck.append(threading.get_native_id())
            self.both_hold_one.wait()
            with second:  # never: the other thread holds it and waits for ours
                return "done\n"

    async def __call__(self, request: object) -> str:
        # Each request in a thread of its own (the user-code loop's default executor).
        return await asyncio.to_thread(self._work, request.url.path)  # type: ignore[attr-defined]


@serve.deployment(max_ongoing_requests=4, ray_actor_options={"num_cpus": 0})
class Waiter:
    """Every request waits for an Event nobody sets."""

    def __init__(self) -> None:
        self.never = threading.Event()
        self.stuck: list[int] = []

    def pid(self) -> int:
        return os.getpid()

    def tids(self) -> list[int]:
        return list(self.stuck)

    def _wait(self) -> str:
        self.stuck.append(threading.get_native_id())
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


def request(port: int, path: str, timeout: float | None = None) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def pending(port: int, path: str) -> threading.Thread:
    """A driver thread whose request is never answered (no timeout)."""

    def run() -> None:
        try:
            request(port, path)
        except OSError as e:
            say("CLIENT_ERROR", path=path, error=type(e).__name__)

    t = threading.Thread(target=run, name=f"pending{path.replace('/', '-')}", daemon=True)
    t.start()
    return t


def load(port: int) -> None:
    """Requests back to back on one connection, forever (a thread of the driver)."""

    def run() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        while True:
            conn.request("GET", "/")
            conn.getresponse().read()
            STATS["answered"] += 1

    threading.Thread(target=run, name="load", daemon=True).start()


def serve_shape(shape: str, port: int) -> None:
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    deployment = {"serve_abba": Abba, "serve_event": Waiter}.get(shape, Hello)
    handle = serve.run(deployment.bind(), name=APP, route_prefix="/")  # type: ignore[attr-defined]
    replica = handle.pid.remote().result()
    wait_listening(port)  # no request yet: serve_idle must have answered none
    proxy = find("ray::ProxyActor")
    controller = find("ray::ServeController")
    info = dict(replica=replica, proxy=proxy, controller=controller, port=port)
    if shape == "serve_load":
        load(port)
        while STATS["answered"] < 10:
            time.sleep(0.1)
    elif shape in ("serve_abba", "serve_event"):
        paths = ["/ab", "/ba"] if shape == "serve_abba" else ["/wait"]
        for path in paths:
            pending(port, path)
        while len(tids := handle.tids.remote().result()) < len(paths):
            time.sleep(0.1)
        time.sleep(0.5)  # past the second append: in the lock / the wait
        info["tids"] = ",".join(map(str, tids))
    say("READY", shape=shape, pid=os.getpid(), role="driver", **info)
    for line in sys.stdin:
        if line.strip() == "load" and shape == "serve_idle":
            load(port)
            while STATS["answered"] < 10:
                time.sleep(0.1)
            say("LOADING", answered=STATS["answered"])
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


def core_shape(shape: str, args: argparse.Namespace) -> None:
    me = os.getpid()
    if shape == "get_stuck_actor":
        actor = Stuck.remote()  # type: ignore[attr-defined]
        pid = ray.get(actor.pid.remote())
        ref = actor.block.remote()
        say("READY", shape=shape, pid=me, role="driver", actor=pid)
        ray.get(ref)
    elif shape == "actor_self_call":
        actor = Selfish.remote()  # type: ignore[attr-defined]
        pid = ray.get(actor.pid.remote())
        ref = actor.outer.remote()
        say("READY", shape=shape, pid=me, role="driver", actor=pid)
        ray.get(ref)
    elif shape == "infeasible_task":
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
    args = ap.parse_args()
    ray.init(
        num_cpus=args.num_cpus,
        num_gpus=0,
        include_dashboard=False,
        _temp_dir=os.path.abspath(args.temp_dir),
        logging_level="WARNING",
    )
    if args.shape.startswith("serve_"):
        serve_shape(args.shape, args.port)
    else:
        core_shape(args.shape, args)


if __name__ == "__main__":
    main()
