"""What the three processes of the stack share: socket names, the scheduler's settings, logging
and SGLang's ``get_zmq_socket``."""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from pathlib import Path

import zmq

SHAPES = (
    "loading",  # the scheduler receives its weights; the front-end already listens
    "idle",  # everything up, no requests
    "serving",  # a client sends requests continuously and gets answers
    "abba",  # two scheduler threads deadlock on two threading.Locks; the main thread joins
    "abba-retry",  # the same, with a client retrying on new connections
    "native-abba",  # two scheduler threads deadlock on two pthread mutexes in a C library
    "blocked-loop",  # the front-end's event loop blocks on a threading.Lock never released
    "fork-lock",  # the scheduler forks a helper while a thread holds a lock the helper needs
)


@dataclass(frozen=True)
class IpcNames:
    """The three ``ipc://`` endpoints, as SGLang's PortArgs has them."""

    scheduler_input: str  # tokenizer manager PUSH -> scheduler PULL (bound by the scheduler)
    detokenizer: str  # scheduler PUSH -> detokenizer PULL (bound by the detokenizer)
    tokenizer: str  # detokenizer PUSH -> tokenizer manager PULL (bound by the front-end)

    @classmethod
    def under(cls, run_dir: Path) -> IpcNames:
        return cls(
            *(f"ipc://{run_dir}/{name}" for name in ("scheduler", "detokenizer", "tokenizer"))
        )


@dataclass(frozen=True)
class SchedulerConfig:
    shape: str
    weights: str  # "file:PATH" or "tcp:HOST:PORT"
    log: str | None
    native_lib: str | None  # libabba.so, for native-abba
    watchdog_timeout: float  # seconds; 0 disables the watchdog thread
    log_every_mib: int = 1  # a progress line per this many MiB of weights received


def setup_logging(log: str | None, prefix: str) -> None:
    """One line per record, ``[time prefix] message``, appended to ``log`` (else stderr).

    Every process of the stack appends to the same file, as SGLang's processes share stderr.
    """
    handler: logging.Handler = (
        logging.FileHandler(log) if log else logging.StreamHandler(sys.stderr)
    )
    logging.basicConfig(
        level=logging.INFO,
        format=f"[%(asctime)s {prefix}] %(message)s",
        handlers=[handler],
        force=True,
    )


def get_zmq_socket(context: zmq.Context, kind: int, endpoint: str, bind: bool) -> zmq.Socket:
    """SGLang's helper: no high-water mark, so nothing is ever dropped or blocks a sender."""
    sock = context.socket(kind)
    if kind == zmq.PUSH:
        sock.setsockopt(zmq.SNDHWM, 0)
    elif kind == zmq.PULL:
        sock.setsockopt(zmq.RCVHWM, 0)
    if bind:
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)
    return sock
