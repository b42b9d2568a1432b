"""NVML as plain data: which processes hold GPU memory, and how busy each one keeps the GPU.

The only module that talks to NVML (through the ``pynvml`` module of nvidia-ml-py, or anything
with its function names: the tests inject ``tests.fakenvml.FakeNVML``). ``NvmlSource.read()``
never raises: a host without a driver, a lost GPU or a driver reload gives ``ok=False`` with the
reason in words, never a partial reading. Half a reading would show a busy process as absent or
idle, and a false verdict is worse than none.

Failures are cheap and quiet: NVML is tried again after a back-off (``retry_s[0]`` seconds,
doubling up to ``retry_s[1]``), and between tries ``read()`` returns the failed reading without
calling NVML. Each distinct failure is logged once at WARNING; the next good read logs once at
INFO.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from ..model import GpuDevice, GpuProcessUse, GpuReading

log = logging.getLogger(__name__)

# A tick may ask twice (discovery, then verdicts): one NVML read serves both.
CACHE_S = 0.5

# NVML return codes (nvml.h): part of the C ABI, so they hold for any pynvml version.
_SUCCESS = 0
_UNINITIALIZED = 1
_NOT_SUPPORTED = 3
_NO_PERMISSION = 4
_NOT_FOUND = 6
_DRIVER_NOT_LOADED = 9
_LIBRARY_NOT_FOUND = 12
_FUNCTION_NOT_FOUND = 13
_GPU_IS_LOST = 15
_LIB_RM_VERSION_MISMATCH = 18

# After these the library's state is suspect: shut it down and init again on the next try.
_REINIT = frozenset({_GPU_IS_LOST, _DRIVER_NOT_LOADED, _UNINITIALIZED, _LIB_RM_VERSION_MISMATCH})

_HINTS = {
    _LIBRARY_NOT_FOUND: "no NVIDIA driver on this host?",
    _DRIVER_NOT_LOADED: "is the nvidia kernel module loaded?",
    _NO_PERMISSION: "can this user open /dev/nvidiactl?",
    _LIB_RM_VERSION_MISMATCH: "driver upgraded without reloading its kernel module?",
}

# Newest first. pynvml's unversioned function is v1 in old releases and a wrapper of v3 in new
# ones (raising NVMLLibraryMismatchError, not NVMLError, when the driver lacks v3).
_PROCESS_FNS = (
    "nvmlDeviceGetComputeRunningProcesses_v3",
    "nvmlDeviceGetComputeRunningProcesses_v2",
    "nvmlDeviceGetComputeRunningProcesses",
)

# usedGpuMemory when the driver cannot say (NVML_VALUE_NOT_AVAILABLE as an unsigned long long);
# recent pynvml turns it into None itself, older releases pass it through.
_NOT_AVAILABLE = 2**64 - 1

NOT_INSTALLED = "NVML not available: the nvidia-ml-py package is not installed"


class _Failure(Exception):
    """Why this attempt produced no reading."""

    def __init__(self, text: str, reinit: bool = False) -> None:
        super().__init__(text)
        self.text = text
        self.reinit = reinit


def _describe(exc: BaseException) -> str:
    try:
        text = str(exc)
    except Exception:  # a broken __str__ must not break the read
        text = ""
    return text or type(exc).__name__


def _text(value: Any) -> str:
    """Names and UUIDs are bytes in older pynvml releases, str in newer ones."""
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return str(value)


class NvmlSource:
    """Reads NVML once per call (at most once per ``CACHE_S``), as a ``GpuReading``."""

    def __init__(
        self,
        nvml: Any | None = None,
        clock: Callable[[], float] = time.monotonic,
        retry_s: tuple[float, float] = (5.0, 300.0),
    ) -> None:
        self._nvml = nvml
        self._clock = clock
        self._retry = retry_s
        self._lock = threading.Lock()  # the daemon loop and a scrape could both ask
        self._inited = False  # nvmlInit succeeded and no nvmlShutdown since
        self._need_init = True
        self._ever_inited = False
        self._proc_fn: int | None = None  # index in _PROCESS_FNS of the one that worked
        self._last_ts: dict[str, int] = {}  # device UUID -> newest process sample seen (µs)
        self._unsupported_logged: set[str] = set()
        self._last: GpuReading | None = None
        self._last_at = 0.0
        self._good: GpuReading | None = None
        self._retry_at: float | None = None
        self._delay: float | None = None
        self._warned: str | None = None
        self._failed_before = False
        self._errors = 0

    # -- public ---------------------------------------------------------------------------

    def read(self) -> GpuReading:
        with self._lock:
            now = self._clock()
            if self._last is not None:
                if now - self._last_at < CACHE_S:
                    return self._last
                if self._retry_at is not None and now < self._retry_at:
                    return self._last
            try:
                reading = self._attempt(now)
            except _Failure as f:
                reading = self._fail(f, now)
            except Exception as e:  # read() never raises: an unforeseen error is a failed read
                reading = self._fail(_Failure(f"NVML error: {_describe(e)}"), now)
            self._last = reading
            self._last_at = self._clock()
            return reading

    def pids(self) -> set[int]:
        """PIDs holding GPU memory in the last good reading (reads first, or reuses the
        reading of the last ``CACHE_S``). During an NVML failure: those of the last good one,
        so services matched by GPU memory do not flap while NVML is away."""
        self.read()
        with self._lock:
            return set(self._good.processes) if self._good is not None else set()

    def close(self) -> None:
        with self._lock:
            if self._inited and self._nvml is not None:
                try:
                    self._nvml.nvmlShutdown()
                except Exception as e:  # closing must not fail because the GPU already did
                    log.debug("nvmlShutdown: %s", _describe(e))
            self._inited = False
            self._need_init = True
            self._last = None

    # -- one attempt ----------------------------------------------------------------------

    def _attempt(self, start: float) -> GpuReading:
        nvml = self._ensure_init()
        devices, processes, last_ts = self._read_all(nvml)
        # Only a whole good read moves the sample timestamps: a failed one must not swallow
        # samples that the next good read would otherwise see.
        self._last_ts = last_ts
        reading = GpuReading(
            ok=True,
            devices=tuple(devices),
            processes={pid: tuple(uses) for pid, uses in processes.items()},
            errors_total=self._errors,
            duration_s=max(0.0, self._clock() - start),
        )
        if self._failed_before:
            log.info("NVML available again: %d GPUs", len(devices))
        elif self._good is None:
            log.info("NVML available: %d GPUs", len(devices))
        self._good = reading
        self._failed_before = False
        self._warned = None
        self._delay = None
        self._retry_at = None
        return reading

    def _fail(self, f: _Failure, start: float) -> GpuReading:
        # A host that never had NVML is not erring, it has no GPU: count only failures of an
        # NVML that worked once, so a CPU-only host does not show a growing error counter.
        if self._ever_inited:
            self._errors += 1
        if f.reinit:
            self._need_init = True
        lo, hi = self._retry
        self._delay = lo if self._delay is None else min(hi, self._delay * 2)
        end = self._clock()
        self._retry_at = end + self._delay
        if f.text != self._warned:
            log.warning(
                "%s; GPU evidence is off until NVML answers (next try in %g s, backing off to %g s)",
                f.text,
                self._delay,
                hi,
            )
            self._warned = f.text
        self._failed_before = True
        return GpuReading(
            ok=False, error=f.text, errors_total=self._errors, duration_s=max(0.0, end - start)
        )

    def _ensure_init(self) -> Any:
        if self._nvml is None:
            try:
                import pynvml
            except ImportError as e:
                raise _Failure(NOT_INSTALLED) from e
            self._nvml = pynvml
        nvml = self._nvml
        if not self._need_init:
            return nvml
        if self._inited:
            try:
                nvml.nvmlShutdown()
            except Exception as e:  # a lost GPU or unloaded driver may refuse; init starts afresh
                log.debug("nvmlShutdown before re-init: %s", _describe(e))
            self._inited = False
        try:
            nvml.nvmlInit()
        except Exception as e:
            code = self._code(e)
            hint = _HINTS.get(code) if code is not None else None
            text = f"NVML not available: {_describe(e)}"
            raise _Failure(f"{text} ({hint})" if hint else text, reinit=True) from e
        self._inited = True
        self._need_init = False
        self._ever_inited = True
        self._proc_fn = None  # a reloaded driver may offer other versions
        return nvml

    def _code(self, exc: BaseException) -> int | None:
        base = getattr(self._nvml, "NVMLError", None)
        if isinstance(base, type) and isinstance(exc, base):
            value = getattr(exc, "value", None)
            return value if isinstance(value, int) else None
        return None

    def _runtime(self, exc: BaseException, fn: str, gpu: int | None) -> _Failure:
        where = fn if gpu is None else f"{fn}, GPU {gpu}"
        code = self._code(exc)
        # NVML's own errors read well alone; anything else (a ctypes or binding bug) needs its type.
        what = _describe(exc) if code is not None else f"{type(exc).__name__}: {_describe(exc)}"
        return _Failure(f"NVML error: {what} ({where})", reinit=code in _REINIT)

    def _call(self, fn: str, gpu: int | None, *args: Any) -> Any:
        try:
            return getattr(self._nvml, fn)(*args)
        except Exception as e:
            raise self._runtime(e, fn, gpu) from e

    # -- the read itself ------------------------------------------------------------------

    def _read_all(
        self, nvml: Any
    ) -> tuple[list[GpuDevice], dict[int, list[GpuProcessUse]], dict[str, int]]:
        devices: list[GpuDevice] = []
        processes: dict[int, list[GpuProcessUse]] = {}
        last_ts = dict(self._last_ts)
        for i in range(int(self._call("nvmlDeviceGetCount", None))):
            handle = self._call("nvmlDeviceGetHandleByIndex", i, i)
            uuid = _text(self._call("nvmlDeviceGetUUID", i, handle))
            name = _text(self._call("nvmlDeviceGetName", i, handle))
            mem = self._call("nvmlDeviceGetMemoryInfo", i, handle)
            utilization = self._utilization(nvml, i, handle)
            held = self._processes(nvml, i, handle)
            sm = self._process_utilization(nvml, i, handle, uuid, name, last_ts)
            devices.append(GpuDevice(i, uuid, name, int(mem.total), int(mem.used), utilization))
            for pid, memory in held.items():
                processes.setdefault(pid, []).append(GpuProcessUse(i, memory, sm.get(pid, 0.0)))
        return devices, processes, last_ts

    def _utilization(self, nvml: Any, i: int, handle: Any) -> float | None:
        try:
            rates = nvml.nvmlDeviceGetUtilizationRates(handle)
        except Exception as e:
            if self._code(e) == _NOT_SUPPORTED:  # MIG mode, some vGPUs
                return None
            raise self._runtime(e, "nvmlDeviceGetUtilizationRates", i) from e
        return min(1.0, max(0.0, int(rates.gpu) / 100))

    def _processes(self, nvml: Any, i: int, handle: Any) -> dict[int, int | None]:
        mismatch = getattr(nvml, "NVMLLibraryMismatchError", None)
        start = self._proc_fn or 0
        for k in range(start, len(_PROCESS_FNS)):
            fn = getattr(nvml, _PROCESS_FNS[k], None)
            if fn is None:  # an older pynvml without this version
                continue
            try:
                items = fn(handle)
            except Exception as e:
                missing = self._code(e) == _FUNCTION_NOT_FOUND or (
                    isinstance(mismatch, type) and isinstance(e, mismatch)
                )
                if missing:  # the driver's NVML predates this version: try the next one
                    continue
                raise self._runtime(e, _PROCESS_FNS[k], i) from e
            self._proc_fn = k
            held: dict[int, int | None] = {}
            for p in items:
                pid = int(p.pid)
                memory = p.usedGpuMemory
                memory = None if memory is None or memory >= _NOT_AVAILABLE else int(memory)
                if pid in held:
                    # One process in several MIG instances of this device: one entry per GPU.
                    before = held[pid]
                    memory = None if before is None or memory is None else before + memory
                held[pid] = memory
            return held
        raise _Failure(f"NVML error: this driver answers none of {', '.join(_PROCESS_FNS)}")

    def _process_utilization(
        self, nvml: Any, i: int, handle: Any, uuid: str, name: str, last_ts: dict[str, int]
    ) -> dict[int, float]:
        """pid -> the highest SM share of its samples since the previous good read."""
        since = last_ts.get(uuid, 0)
        try:
            samples = nvml.nvmlDeviceGetProcessUtilization(handle, since)
        except Exception as e:
            code = self._code(e)
            # NOT_FOUND: no sample since `since`, i.e. nobody ran a kernel. pynvml raises
            # NVMLError(SUCCESS) when the size query answers "success" for an empty buffer.
            if code in (_NOT_FOUND, _SUCCESS):
                return {}
            if code == _NOT_SUPPORTED:
                if uuid not in self._unsupported_logged:
                    self._unsupported_logged.add(uuid)
                    log.info(
                        "GPU %d (%s): per-process utilisation not supported; its processes "
                        "count as 0%% busy",
                        i,
                        name,
                    )
                return {}
            raise self._runtime(e, "nvmlDeviceGetProcessUtilization", i) from e
        out: dict[int, float] = {}
        newest = since
        for s in samples:
            newest = max(newest, int(s.timeStamp))
            sm = int(s.smUtil)
            if sm > 100:  # drivers have returned garbage here; never let it look busy
                continue
            pid = int(s.pid)
            out[pid] = max(out.get(pid, 0.0), sm / 100)
        last_ts[uuid] = newest
        return out
