"""The only module that talks to bcc: compile bpf/*.bpf.c, attach, read maps.

Everything it returns is plain data (agent.model.ProbeReading), so nothing
above this module needs root, bcc or a kernel to be tested.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import time
from collections.abc import Iterable
from pathlib import Path

from .errors import KernelFeatureError
from .model import FutexWait, InflightWait, ProbeEvent, ProbeReading

BPF_DIR = Path(os.environ.get("HANGWATCH_BPF_DIR", Path(__file__).resolve().parent.parent / "bpf"))
FALLBACK_HEADERS = "/usr/src/hangwatch-kernel-headers"


def header_defines(path: Path | None = None) -> dict[str, int]:
    """The HW_* constants of bpf/hangwatch.h: declared once, in C."""
    text = (path or BPF_DIR / "hangwatch.h").read_text()
    return {
        m.group(1): int(m.group(2), 0)
        for m in re.finditer(r"^#define\s+(HW_\w+)\s+(0x[0-9a-fA-F]+|\d+)\b", text, re.M)
    }


def kernel_headers() -> str | None:
    """Where bcc finds kernel headers: explicit, the running kernel's, or setup's merged tree."""
    explicit = os.environ.get("BCC_KERNEL_SOURCE")
    if explicit:
        if not os.path.isdir(explicit):
            raise KernelFeatureError(
                f"no kernel headers at BCC_KERNEL_SOURCE={explicit}",
                "point it at a kernel header tree, or unset it to use the running kernel's",
            )
        return explicit
    own = f"/lib/modules/{os.uname().release}/build"
    if os.path.isdir(own):
        return own
    return FALLBACK_HEADERS if os.path.isdir(FALLBACK_HEADERS) else None


class FutexProbe:
    """The futex probe, attached for as long as the object lives (use as a context manager)."""

    def __init__(self, long_wait_s: float = 1.0, ringbuf_pages: int = 64) -> None:
        try:
            from bcc import BPF
        except ImportError as e:
            raise KernelFeatureError(
                "bcc is not importable",
                "install the distribution's python3-bpfcc (make setup does), and run with a "
                "Python that sees system site packages",
            ) from e
        headers = kernel_headers()
        if headers is None:
            raise KernelFeatureError(
                f"no kernel headers for {os.uname().release}",
                f"install linux-headers-{os.uname().release}, or run `make setup` to build the "
                f"merged fallback at {FALLBACK_HEADERS}",
            )
        os.environ["BCC_KERNEL_SOURCE"] = headers
        self._defs = header_defines()
        cflags = [
            f"-I{BPF_DIR}",
            f"-DLONG_WAIT_NS={int(long_wait_s * 1e9)}ULL",
            f"-DRINGBUF_PAGES={ringbuf_pages}",
        ]
        for name, flag in (("futex_wait", "HAVE_FUTEX_WAIT"), ("futex_waitv", "HAVE_FUTEX_WAITV")):
            if BPF.tracepoint_exists("syscalls", f"sys_enter_{name}"):
                cflags.append(f"-D{flag}")
        t0 = time.monotonic()
        try:
            self._bpf = BPF(src_file=str(BPF_DIR / "futex.bpf.c").encode(), cflags=cflags)
        except Exception as e:  # bcc raises bare Exception for compile and load failures
            raise KernelFeatureError(
                f"the kernel refused the futex probe ({e})",
                "check that the kernel has BPF, syscall tracepoints and tracefs mounted",
            ) from e
        self.load_seconds = time.monotonic() - t0
        self.programs = self._bpf.num_open_tracepoints()
        self._watched = self._bpf["watched"]
        self._inflight = self._bpf["inflight"]
        self._refusals = self._bpf["refusals"]
        self._hist = self._bpf["wait_hist"]
        self._counters = self._bpf["counters"]
        self._events: list[ProbeEvent] = []
        self._bpf["events"].open_ring_buffer(self._on_event)
        self._watching: set[int] = set()

    def _on_event(self, _ctx: object, data: int, _size: int) -> None:
        e = self._bpf["events"].event(data)
        kind = "edeadlk" if e.kind == self._defs["HW_EVENT_EDEADLK"] else "long-wait"
        self._events.append(
            ProbeEvent(kind, e.ts_ns, e.tgid, e.tid, e.uaddr, e.op, e.duration_ns, e.ret)
        )

    def watch(self, tgids: Iterable[int]) -> None:
        """Make the watched set exactly ``tgids``."""
        want = set(tgids)
        one = ctypes.c_uint8(1)
        for tgid in want - self._watching:
            self._watched[ctypes.c_uint32(tgid)] = one
        for tgid in self._watching - want:
            with contextlib.suppress(KeyError):
                del self._watched[ctypes.c_uint32(tgid)]
        self._watching = want

    def forget(self, tids: Iterable[int]) -> None:
        """Drop in-flight entries of threads that died in a wait (they never reach sys_exit)."""
        for tid in tids:
            for table in (self._inflight, self._refusals):
                with contextlib.suppress(KeyError):
                    del table[ctypes.c_uint32(tid)]

    def read(self) -> ProbeReading:
        self._bpf.ring_buffer_poll(0)
        events, self._events = tuple(self._events), []
        vector = self._defs["HW_SYSCALL_FUTEX_WAITV"]
        inflight = {}
        for k, w in self._inflight.items():
            wait = FutexWait(
                uaddr=w.uaddr,
                op=w.op,
                val=w.val,
                since_ns=w.start_ns,
                vector=w.syscall == vector,
                source="bpf",
            )
            inflight[k.value] = InflightWait(k.value, w.tgid, wait, w.word, w.owner_hint)
        refusals = {k.value: (r.tgid, r.uaddr, r.ts_ns) for k, r in self._refusals.items()}
        hist: dict[int, dict[int, int]] = {}
        for k, n in self._hist.items():
            hist.setdefault(k.tgid, {})[k.slot] = n.value
        counters: dict[str, int] = {}
        for per_cpu in self._counters.values():
            for c in per_cpu:
                for name, _ in c._fields_:
                    counters[name] = counters.get(name, 0) + getattr(c, name)
        return ProbeReading(inflight, refusals, events, hist, counters)

    def close(self) -> None:
        self._bpf.cleanup()

    def __enter__(self) -> FutexProbe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
