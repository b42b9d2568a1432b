"""Hang injection for the real SGLang server of ``tests/realsw/test_sglang_*.py``.

This directory is put on ``PYTHONPATH`` for the server only, so every process of it (the HTTP
server, ``sglang::scheduler``, ``sglang::detokenizer``, multiprocessing's helpers) imports
this module at start. It does nothing until ``sglang.srt.models.llama`` is imported, and then
only wraps ``LlamaForCausalLM.forward``, which the scheduler calls once per batch (a prefill
or a decode step).

Each call checks whether the file named by ``HANGWATCH_SGLANG_TRIGGER`` exists. The file holds
``after=N`` (default 0): the first N forwards after it appeared still run (a streaming request
gets its first tokens out), and the one after them hangs, mid-step, in the way given by
``HANGWATCH_SGLANG_HANG``:

* ``event``: ``threading.Event().wait()``: the thread in futex(2), no timeout. It is released
  when something opens the FIFO ``TRIGGER.release`` for writing (the test makes the FIFO): a
  helper thread sleeps in open(2) on it meanwhile, no timer, and sets the Event. The trigger
  is removed before the release, so one server serves several hangs in turn.
* ``abba``: a native ABBA deadlock: two threads in ``libabba.so`` (``HANGWATCH_SGLANG_ABBA_LIB``,
  built from ``tests/realsw/serving/abba.c``) each hold one pthread mutex and wait for the
  other's; the calling thread joins them (futex, no timeout). Never released.

When it hangs it writes ``TRIGGER.hung``: ``HUNG mode=M pid=P tid=T tids=A,B mono=S`` (the
deadlocked threads' TIDs for ``abba``; ``mono`` is ``time.monotonic()`` when the hang began).
Only the standard library is used here; it must not slow down or break the server's imports.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import threading
import time
from typing import Any

TRIGGER = os.environ.get("HANGWATCH_SGLANG_TRIGGER", "")
MODE = os.environ.get("HANGWATCH_SGLANG_HANG", "event")
ABBA_LIB = os.environ.get("HANGWATCH_SGLANG_ABBA_LIB", "")
TARGET = "sglang.srt.models.llama"

_steps_since_trigger = 0


def _announce(tids: list[int]) -> None:
    line = (
        f"HUNG mode={MODE} pid={os.getpid()} tid={threading.get_native_id()} "
        f"tids={','.join(map(str, tids))} mono={time.monotonic():.3f}\n"
    )
    tmp = f"{TRIGGER}.hung.tmp"
    with open(tmp, "w") as f:
        f.write(line)
    os.replace(tmp, f"{TRIGGER}.hung")


def _hang() -> None:
    if MODE == "abba":
        import ctypes

        lib = ctypes.CDLL(ABBA_LIB)
        if lib.abba_init() != 0:
            raise OSError("pthread_barrier_init failed")
        workers = [
            threading.Thread(target=lib.abba_ab, name="kernel-0", daemon=True),
            threading.Thread(target=lib.abba_ba, name="kernel-1", daemon=True),
        ]
        for t in workers:
            t.start()
        _announce([t.native_id or 0 for t in workers])
        for t in workers:
            t.join()
        return
    released = threading.Event()

    def wait_release() -> None:
        with open(f"{TRIGGER}.release", "rb") as f:  # blocks in open(2) until a writer comes
            f.read()
        released.set()

    threading.Thread(target=wait_release, name="hang-release", daemon=True).start()
    _announce([])
    released.wait()


def _after() -> int:
    try:
        with open(TRIGGER) as f:
            text = f.read()
    except OSError:
        return 0
    for word in text.split():
        if word.startswith("after="):
            return int(word[len("after=") :])
    return 0


def _check() -> None:
    global _steps_since_trigger
    if not os.path.exists(TRIGGER):
        _steps_since_trigger = 0
        return
    if _steps_since_trigger >= _after():
        _steps_since_trigger = 0
        _hang()
        return
    _steps_since_trigger += 1


def _patch(module: Any) -> None:
    cls = module.LlamaForCausalLM
    forward = cls.forward

    def hanging_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        _check()
        return forward(self, *args, **kwargs)

    hanging_forward.__wrapped__ = forward  # type: ignore[attr-defined]
    cls.forward = hanging_forward


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self.inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.inner.exec_module(module)
        _patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader)
                return spec
        return None


if TRIGGER:
    sys.meta_path.insert(0, _Finder())
