"""Start the serving stack of ``tests/realsw/serving`` in one of its shapes, with its client.

The stack runs under the real-software venv's python (``scripts/realsw.py`` knows it), never
under the project's ``.venv``; the tests and this module only need the standard library and
``scripts/``. Every program is a :class:`~scripts.fixturelib.Fixture`: its own process
group, a ready line on stdout, the whole group killed on exit.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from scripts import realsw
from scripts.daemonproc import free_port
from scripts.fixturelib import REPO_ROOT, Arg, Fixture, FixtureLine
from tests.limits import HANG_S
from tests.realsw.serving.native import build_abba
from tests.realsw.serving.procview import futex_parked, listen_queue

__all__ = [
    "Stack",
    "build_abba",
    "futex_parked",
    "listen_queue",
    "serving_stack",
    "weight_server",
]

START_TIMEOUT = 60.0  # spawn start-up imports FastAPI three times: slow on a busy 2-CPU machine


def _env() -> dict[str, str]:
    # The stack runs as ``python -m tests.realsw.serving.server``: it needs the checkout.
    return realsw.job_env(PYTHONPATH=str(REPO_ROOT), PYTHONDONTWRITEBYTECODE="1")


@dataclass
class Stack:
    """A running stack: the root process's Fixture, its READY line, its client, its log."""

    server: Fixture
    info: FixtureLine
    client: Fixture | None
    log: Path

    @property
    def pid(self) -> int:
        return self.info.get_int("pid")

    @property
    def port(self) -> int:
        return self.info.get_int("port")

    @property
    def scheduler(self) -> int:
        return self.info.get_int("scheduler")

    @property
    def detokenizer(self) -> int:
        return self.info.get_int("detokenizer")


@contextlib.contextmanager
def weight_server(rate_mib: float = 2.0, mib: int | None = None) -> Iterator[Fixture]:
    """The local weight server (stdlib only: run by this interpreter), outside the stack. By
    default its load lasts past the harness's bound twice at ``rate_mib``: it ends when the
    test writes a line to the server (``fx.send``), or ends the stack, never by a clock."""
    if mib is None:
        mib = round(2 * HANG_S * rate_mib)
    argv = [sys.executable, "-m", "tests.realsw.serving.weights"]
    argv += ["--port", "0", "--rate", str(rate_mib), "--mib", str(mib)]
    with Fixture(argv, env=_env()) as fx:
        yield fx


@contextlib.contextmanager
def serving_stack(
    shape: str,
    run_dir: Path,
    *,
    client: Sequence[str] = (),
    server_args: Sequence[str] = (),
    timeout: float = START_TIMEOUT,
) -> Iterator[Stack]:
    """Start ``server.py --shape SHAPE``; once it listens, ``client.py CLIENT...`` if given;
    yield once the server announces READY. Everything is killed on exit."""
    python = realsw.python()
    log = run_dir / "serving.log"
    argv: list[Arg] = [python, "-m", "tests.realsw.serving.server", "--shape", shape]
    # A port given by number, as an engine's --port: the front door clients know.
    argv += ["--port", str(free_port()), "--log", log, "--run-dir", run_dir, *server_args]
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(Fixture(argv, ready="LISTENING", timeout=timeout, env=_env()))
        cl = None
        if client:
            port = server.info.get_int("port")
            cl_argv: list[Arg] = [python, "-m", "tests.realsw.serving.client", "--port", str(port)]
            cl_argv += client
            cl = stack.enter_context(Fixture(cl_argv, ready=None, timeout=timeout, env=_env()))
        yield Stack(server, server.wait_for("READY"), cl, log)
