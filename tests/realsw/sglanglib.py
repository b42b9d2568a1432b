"""Real SGLang (its CPU engine) for the tests: its venv, a tiny and a big random model, a server
in its hang and healthy shapes, the processes it starts, and a client.

SGLang lives in a venv of its own outside the checkout, ``$HANGWATCH_SGLANG_VENV`` (default
``/var/cache/hangwatch/sglang``), installed by ``scripts/setup.sh --tests`` from the lock
``sglang-requirements.txt`` with ``--no-deps`` (SGLang's CUDA-only requirements left out).
PyPI's ``sgl-kernel`` is CUDA-only; ``sglang_shim/`` (on the server's PYTHONPATH) stands in
for the one kernel op the CPU engine calls: this is real SGLang with that op substituted.
Nothing is downloaded: the models are random Llamas made here (``vllm_model.py``), cached
under ``/var/cache/hangwatch/sglang-models`` by version.

The server is ``python -m sglang.launch_server --device cpu ...`` with
``SGLANG_USE_CPU_ENGINE=1``. Its main process runs the HTTP server (uvicorn) and the
tokenizer manager, and has a SubprocessWatchdog thread; it starts ``sglang::scheduler`` (runs
the model) and ``sglang::detokenizer``, which rename themselves with setproctitle, so they are
found by parent links and their new names. The port opens only once the model is loaded.
``sglang_inject/sitecustomize.py`` (on the server's PYTHONPATH only) makes the scheduler's
forward hang once the trigger file exists (:meth:`SglangServer.hang`).

Only the standard library and ``scripts/`` are needed here: the tests run under the project's
``.venv``, the server under the SGLang venv's python.
"""

from __future__ import annotations

import contextlib
import errno
import http.client
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from scripts.daemonproc import free_port
from scripts.fixturelib import REPO_ROOT, Fixture, FixtureError, FixtureLine, blocked_in
from scripts.realsw import alive, cmdline, descendants, kill_tree, scratch_env
from tests import gate
from tests.limits import HANG_S
from tests.realsw.readlimit import ReadLimit
from tests.realsw.serving.native import build_abba
from tests.realsw.vllmlib import (  # the same /proc helpers
    SYS_FUTEX,
    SYS_POLL,
    child_titled,
    http_get,
    in_syscall,
    in_untimed_futex,
    listening_ports,
    made_once,
    thread_names,
)

__all__ = [
    "SYS_FUTEX",
    "SYS_POLL",
    "blocked_in",
    "http_get",
    "in_syscall",
    "in_untimed_futex",
    "listening_ports",
    "thread_names",
]

DEFAULT_VENV = Path("/var/cache/hangwatch/sglang")
MODEL_CACHE = Path(
    os.environ.get("HANGWATCH_SGLANG_MODELS") or "/var/cache/hangwatch/sglang-models"
)
# change a version when vllm_model.py changes that size
MODEL_VERSIONS = {"tiny": "tinyllama-h128-l2-v512-1", "big": "llama-h2048-l24-v512-1"}
MODEL_SCRIPT = REPO_ROOT / "tests" / "realsw" / "vllm_model.py"
SHIM_DIR = REPO_ROOT / "tests" / "realsw" / "sglang_shim"
INJECT_DIR = REPO_ROOT / "tests" / "realsw" / "sglang_inject"
START_TIMEOUT = 300.0  # ~30 s on 2 idle cores; several times that while something else runs
MAX_TOKENS_FOREVER = 400  # a request that would run for a while, were it not hung
KV_TOKENS = {"tiny": 8192, "big": 2048}  # --max-total-tokens: else it sizes a 14 GB KV cache

# SGLang's own processes, as setproctitle names them
SCHEDULER_TITLE, DETOKENIZER_TITLE = "sglang::scheduler", "sglang::detokenizer"
HANG_MODES = ("event", "abba")
READY_LOG = "The server is fired up and ready to roll!"  # after its own warm-up request
LOAD_BEGIN, LOAD_END = "Load weight begin", "Load weight end"

_SCRUBBED = ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")


def venv() -> Path:
    return Path(os.environ.get("HANGWATCH_SGLANG_VENV") or DEFAULT_VENV)


def python() -> Path:
    return venv() / "bin" / "python"


def _site_packages() -> list[Path]:
    return sorted((venv() / "lib").glob("python3*/site-packages"))


def missing() -> str | None:
    """Why the SGLang tests cannot run here, or None when they can (no import: ~10 s)."""
    install = "bash scripts/setup.sh --tests installs it"
    if not os.access(python(), os.X_OK):
        return f"no {python()}: the SGLang venv is not installed ({install})"
    sites = _site_packages()
    if not sites:
        return f"{venv()} has no site-packages"
    site = sites[-1]
    for pkg in ("sglang", "transformers", "tokenizers", "torch", "zmq", "uvicorn"):
        if not (site / pkg / "__init__.py").is_file():
            return f"{venv()} lacks {pkg} ({install})"
    if not (SHIM_DIR / "sgl_kernel" / "__init__.py").is_file():
        return f"no {SHIM_DIR}/sgl_kernel: the checkout lacks the kernel stand-in"
    return None


@pytest.fixture(scope="session")
def sglang_ready() -> None:
    """Skip when SGLang cannot run here, but fail under ``CI=true`` (tests.gate)."""
    gate.require(missing(), "real SGLang cannot run")


# --- the models ------------------------------------------------------------------------------


def model_dir(size: str = "tiny") -> Path:
    """The model's directory, made on first use (tiny: seconds; big: a few minutes, 4.7 GB) and cached
    by version."""
    out = MODEL_CACHE / MODEL_VERSIONS[size]
    argv = [str(python()), str(MODEL_SCRIPT), str(out), size]
    return made_once(out, argv, _env(), 900, f"the {size} model")


def evict(model: Path) -> int:
    """Drop the model's weight files from the page cache, so that loading them reads storage;
    returns their size in bytes."""
    size = 0
    for path in sorted(model.glob("*.safetensors")):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages are not dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            size += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return size


def read_bytes(pid: int) -> int:
    """Bytes the process made storage read (``read_bytes`` of /proc/PID/io; not page-cache
    hits); 0 once gone."""
    try:
        with open(f"/proc/{pid}/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


# --- the server ------------------------------------------------------------------------------


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _SCRUBBED}
    env.update(
        PYTHONUNBUFFERED="1",
        PYTHONSAFEPATH="1",  # no cwd on sys.path
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        DO_NOT_TRACK="1",
        SGLANG_USE_CPU_ENGINE="1",  # else the CPU engine is not used
        OMP_NUM_THREADS="1",
        **extra,
    )
    return env


class SglangServer(Fixture):
    """The SGLang server on a free port, its output in ``log``. ``__enter__`` returns once
    ``/health`` answers 200 and the scheduler and detokenizer are found (``wait=False``: once
    the process is started, for the loading case).

    ``close`` kills the server's process tree, and the scheduler and detokenizer by PID too:
    a child whose parent died is orphaned out of the tree.
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        hang: str = "event",
        size: str = "tiny",
        sleep_on_idle: bool = False,
        watchdog_timeout: float | None = None,
        wait: bool = True,
        timeout: float = START_TIMEOUT,
        cgroup: Path | None = None,
    ) -> None:
        assert hang in HANG_MODES, hang
        self.run_dir = run_dir
        self.port = free_port()
        self.log = run_dir / "sglang.log"
        self.trigger = run_dir / "hang-trigger"
        self.release_fifo = self.trigger.with_name(self.trigger.name + ".release")
        self.model = model_dir(size)
        self.wait = wait
        argv = [
            "/bin/sh",
            "-c",
            # into the cgroup first, if given, so that every process of the server is born in it;
            # in the run directory: on a crash SGLang looks for files in its cwd
            '{ [ -z "$HANGWATCH_SGLANG_CGROUP" ] || echo $$ >"$HANGWATCH_SGLANG_CGROUP"; } &&'
            ' cd "$HANGWATCH_SGLANG_DIR" && exec "$0" "$@" >>"$HANGWATCH_SGLANG_LOG" 2>&1',
            str(python()),
            "-m",
            "sglang.launch_server",
            "--model-path",
            str(self.model),
            "--device",
            "cpu",
            "--attention-backend",
            "torch_native",
            "--context-length",
            "512",  # <= the model's max positions
            "--max-total-tokens",
            str(KV_TOKENS[size]),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        if sleep_on_idle:
            argv.append("--sleep-on-idle")
        if watchdog_timeout is not None:
            # SGLang's scheduler watchdog ends the server once a forward has run this long
            # (default 300 s): a hang held longer than that needs more
            argv += ["--watchdog-timeout", str(watchdog_timeout)]
        env = _env(
            **scratch_env(run_dir),
            PYTHONPATH=f"{INJECT_DIR}:{SHIM_DIR}",
            HANGWATCH_SGLANG_DIR=str(run_dir),
            HANGWATCH_SGLANG_CGROUP=str(cgroup or ""),
            HANGWATCH_SGLANG_LOG=str(self.log),
            HANGWATCH_SGLANG_TRIGGER=str(self.trigger),
            HANGWATCH_SGLANG_HANG=hang,
            HANGWATCH_SGLANG_ABBA_LIB=str(build_abba()) if hang == "abba" else "",
        )
        super().__init__(argv, ready=None, timeout=timeout, env=env)
        self.scheduler = 0
        self.detokenizer = 0
        self.started = 0.0  # time.monotonic() at start

    def __enter__(self) -> SglangServer:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkfifo(self.release_fifo)
        self.started = time.monotonic()
        super().__enter__()
        try:
            if self.wait:
                self.wait_healthy()
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
        return f"{super().describe(what)}\nSGLang log (last 4000 chars):\n{self.log_text()[-4000:]}"

    def _check_running(self, what: str) -> None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise FixtureError(self.describe(f"the server exited {what}"))

    def find_children(self) -> bool:
        self.scheduler = child_titled(self.pid, SCHEDULER_TITLE) or 0
        self.detokenizer = child_titled(self.pid, DETOKENIZER_TITLE) or 0
        return bool(self.scheduler and self.detokenizer)

    def wait_loading(self) -> None:
        """Until the scheduler logged that it began loading the weights (port still closed)."""
        deadline = time.monotonic() + self.timeout
        while LOAD_BEGIN not in self.log_text():
            self._check_running("while starting")
            if time.monotonic() > deadline:
                raise FixtureError(self.describe(f"no {LOAD_BEGIN!r} within {self.timeout} s"))
            time.sleep(0.05)
        self.scheduler = child_titled(self.pid, SCHEDULER_TITLE) or 0

    def wait_healthy(self) -> None:
        """Until /health is 200 and SGLang logged its warm-up request done."""
        deadline = time.monotonic() + self.timeout
        while True:
            self._check_running("while starting")
            with contextlib.suppress(OSError, http.client.HTTPException):
                if READY_LOG in self.log_text() and http_get(self.port, "/health", 2)[0] == 200:
                    break
            if time.monotonic() > deadline:
                raise FixtureError(self.describe(f"/health not 200 within {self.timeout} s"))
            time.sleep(0.5)
        if not self.find_children():
            tree = {p: cmdline(p)[:60] for p in descendants(self.pid)}
            raise FixtureError(self.describe(f"no scheduler and detokenizer below it: {tree}"))

    # --- hangs ---------------------------------------------------------------------------

    def hang(self, after: int = 0) -> None:
        """From now on the scheduler's forward hangs after ``after`` more forwards have run."""
        self.trigger.with_name(self.trigger.name + ".hung").unlink(missing_ok=True)
        tmp = self.trigger.with_name(self.trigger.name + ".tmp")
        tmp.write_text(f"after={after}\n")
        os.replace(tmp, self.trigger)

    def wait_hung(self, timeout: float = 60.0) -> FixtureLine:
        """The ``HUNG mode= pid= tid= tids= mono=`` line the scheduler writes as it hangs."""
        hung = self.trigger.with_name(self.trigger.name + ".hung")
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(OSError):
                text = hung.read_text().strip()
                if text:
                    return FixtureLine(text)
            if time.monotonic() > deadline:
                raise FixtureError(self.describe(f"the scheduler did not hang within {timeout} s"))
            time.sleep(0.1)

    def release(self) -> None:
        """End an ``event`` hang: the trigger goes first (no forward hangs from now on), then
        the hung forward's release helper is woken through the FIFO. Nothing to do when no
        forward hung; a forward that hangs as the trigger goes is waited for a moment."""
        self.trigger.unlink(missing_ok=True)
        hung = self.trigger.with_name(self.trigger.name + ".hung")
        deadline = time.monotonic() + 5
        while True:
            try:
                os.close(os.open(self.release_fifo, os.O_WRONLY | os.O_NONBLOCK))
                break
            except OSError as e:
                if e.errno != errno.ENXIO:  # ENXIO: no reader (yet)
                    raise
            if time.monotonic() > deadline:
                if hung.exists():
                    raise FixtureError(self.describe("hung, yet nothing waits on the FIFO"))
                return
            time.sleep(0.05)
        hung.unlink(missing_ok=True)

    def kill_detokenizer(self) -> None:
        os.kill(self.detokenizer, signal.SIGKILL)

    def close(self) -> None:
        if self.proc is not None:
            kill_tree(self.proc.pid)
        for pid in (self.scheduler, self.detokenizer):
            if pid and alive(pid):
                kill_tree(pid)
        super().close()


@contextlib.contextmanager
def sglang_server(run_dir: Path, **kwargs: Any) -> Iterator[SglangServer]:
    with SglangServer(run_dir, **kwargs) as server:
        yield server


# The loading case's cap holds the load this long at least, on any disk: past the harness's
# bound twice (tests/limits.py), so that it ends when the test lifts the cap, never before.
HELD_LOAD_S = 2 * HANG_S


@contextlib.contextmanager
def loading_server(run_dir: Path) -> Iterator[tuple[SglangServer, int, ReadLimit]]:
    """The big model, dropped from the page cache, read from storage at a capped rate: the
    scheduler reads storage all along, and the load lasts until the test calls the cap's
    ``release``. Yields once the scheduler began loading (port closed), with the model's size
    in bytes and the cap."""
    model = model_dir("big")
    size = evict(model)
    with (
        ReadLimit(model, int(size // HELD_LOAD_S)) as cap,
        sglang_server(run_dir, size="big", wait=False, cgroup=cap.procs) as server,
    ):
        server.wait_loading()
        yield server, size, cap


# --- the client ------------------------------------------------------------------------------


def _body(prompt: str, max_tokens: int, stream: bool) -> bytes:
    return json.dumps(
        {
            "text": prompt,
            "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
            "stream": stream,
        }
    ).encode()


HEADERS = {"Content-Type": "application/json"}


def generate(
    server: SglangServer, prompt: str = "hello world", max_tokens: int = 16, timeout: float = 60
) -> dict[str, Any]:
    """One non-streaming ``/generate`` (SGLang's native API); its JSON answer."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout)
    try:
        conn.request("POST", "/generate", _body(prompt, max_tokens, False), HEADERS)
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise FixtureError(f"/generate: {resp.status} {data[:500]!r}")
        result: dict[str, Any] = json.loads(data)
        return result
    finally:
        conn.close()


class Pending:
    """A ``/generate`` sent on its own connection and never read (until ``close``): a client
    that waits for its answer."""

    def __init__(self, server: SglangServer, *, stream: bool, max_tokens: int) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=600)
        self.conn.request("POST", "/generate", _body("hello", max_tokens, stream), HEADERS)
        self.resp: http.client.HTTPResponse | None = None
        self.chunks: list[dict[str, Any]] = []

    def read_chunks(self, count: int, timeout: float = 60) -> list[dict[str, Any]]:
        """Read SSE events until ``count`` ``data: {...}`` chunks have come (streaming only),
        each within ``timeout`` s: well inside SGLang's 300 s scheduler watchdog, which ends
        the server if a hung step is not released in time."""
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

    def drain(self, timeout: float = 120) -> int:
        """Read the answer to its end (a stream to its last event); its HTTP status."""
        if self.conn.sock is not None:
            self.conn.sock.settimeout(timeout)
        if self.resp is None:
            self.resp = self.conn.getresponse()
        self.resp.read()
        return self.resp.status

    def close(self) -> None:
        self.conn.close()


@contextlib.contextmanager
def pending(
    server: SglangServer, *, stream: bool = False, max_tokens: int = MAX_TOKENS_FOREVER
) -> Iterator[Pending]:
    p = Pending(server, stream=stream, max_tokens=max_tokens)
    try:
        yield p
    finally:
        p.close()


class Continuous:
    """A client thread sending requests back to back; ``done`` counts the answers."""

    def __init__(self, server: SglangServer, max_tokens: int = 16) -> None:
        self.server = server
        self.max_tokens = max_tokens
        self.done = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sglang-client", daemon=True)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                generate(self.server, max_tokens=self.max_tokens)
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
