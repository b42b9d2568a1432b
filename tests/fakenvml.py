"""A scripted stand-in for the ``pynvml`` module, for ``agent.sources.nvml.NvmlSource`` tests.

It has pynvml's function names for everything NvmlSource calls, raises the real
``pynvml.NVMLError`` subclasses and returns what pynvml returns (its ctypes structs, its
"friendly objects" for process lists, lists of ``c_nvmlProcessUtilizationSample_t``), so code
that passes against it holds no assumption that the real module would break. Only the C library
is faked: no driver or GPU needed.

Tests change the state between reads: ``devices`` (and their processes and samples),
``missing`` (C functions the "driver" lacks), ``init_error``, and ``fail()`` for an error on
the Nth call of a function. ``calls`` records every call, handles shown as device indexes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import pynvml

GIB = 1 << 30

V3 = "nvmlDeviceGetComputeRunningProcesses_v3"
V2 = "nvmlDeviceGetComputeRunningProcesses_v2"
V1 = "nvmlDeviceGetComputeRunningProcesses"

# pynvml's "no such instance" for gpuInstanceId/computeInstanceId outside MIG.
_NO_INSTANCE = 0xFFFFFFFF


def error(code: int) -> pynvml.NVMLError:
    """The exception pynvml raises for ``code``: NVMLError.__new__ picks the subclass."""
    return pynvml.NVMLError(code)


@dataclass
class FakeDevice:
    uuid: str
    name: str
    total: int = 80 * GIB
    used: int = 0
    util: int | None = 0  # percent, as NVML gives it; None: NotSupported (MIG, some vGPUs)
    processes: dict[int, int | None] = field(default_factory=dict)  # pid -> bytes, None: N/A
    samples: list[tuple[int, int, int]] = field(default_factory=list)  # (pid, µs stamp, sm %)
    process_util_supported: bool = True


class FakeHandle:
    """Stands for the ctypes device pointer pynvml returns."""

    def __init__(self, index: int) -> None:
        self.index = index

    def __repr__(self) -> str:
        return f"FakeHandle({self.index})"


@dataclass
class _Fault:
    fn: str
    raise_: BaseException | int
    first: int  # 1-based call number of `fn` from which it fails
    times: int | None  # None: until healed


class FakeNVML:
    NVMLError = pynvml.NVMLError
    NVMLLibraryMismatchError = pynvml.NVMLLibraryMismatchError

    def __init__(self, devices: Iterable[FakeDevice] = ()) -> None:
        self.devices: list[FakeDevice] = list(devices)
        self.missing: set[str] = set()  # C functions this "driver" lacks: FunctionNotFound
        self.init_error: int | None = None  # nvmlInit raises NVMLError(init_error)
        self.names_as_bytes = False  # what pynvml releases before convertStrBytes returned
        # pynvml before 11.5 called the v1 C function for the unversioned name; newer ones
        # wrap v3 and raise NVMLLibraryMismatchError when the driver lacks it.
        self.legacy_unversioned = False
        self.calls: list[tuple[Any, ...]] = []
        self.counts: Counter[str] = Counter()
        self.refcount = 0  # nvmlInit minus nvmlShutdown, as NVML counts them
        self.on_call: Callable[[str], None] | None = None  # e.g. advance a fake clock
        self._faults: list[_Fault] = []

    # -- scripting ------------------------------------------------------------------------

    def fail(
        self, fn: str, raise_: BaseException | int, nth: int | None = None, times: int | None = 1
    ) -> None:
        """Make call number ``nth`` of ``fn`` (counted since this fake was made; default the
        next one) and the ``times - 1`` after it raise: an NVML code raises the real pynvml
        error, an exception instance is raised as is. ``times=None``: until ``heal()``."""
        first = self.counts[fn] + 1 if nth is None else nth
        self._faults.append(_Fault(fn, raise_, first, times))

    def heal(self) -> None:
        self._faults.clear()

    def clear_calls(self) -> None:
        self.calls.clear()

    def names(self) -> list[str]:
        """The functions called, in order."""
        return [c[0] for c in self.calls]

    # -- plumbing -------------------------------------------------------------------------

    def _enter(self, fn: str, *args: Any, c_name: str | None = None) -> None:
        shown = tuple(a.index if isinstance(a, FakeHandle) else a for a in args)
        self.calls.append((fn, *shown))
        self.counts[fn] += 1
        if self.on_call is not None:
            self.on_call(fn)
        n = self.counts[fn]
        for f in self._faults:
            if f.fn == fn and n >= f.first and (f.times is None or n < f.first + f.times):
                raise error(f.raise_) if isinstance(f.raise_, int) else f.raise_
        if (c_name or fn) in self.missing:
            raise error(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        if fn != "nvmlInit" and self.refcount == 0:
            raise error(pynvml.NVML_ERROR_UNINITIALIZED)

    def _device(self, handle: FakeHandle) -> FakeDevice:
        if not 0 <= handle.index < len(self.devices):
            raise error(pynvml.NVML_ERROR_GPU_IS_LOST)  # its device went away under it
        return self.devices[handle.index]

    def _text(self, s: str) -> str | bytes:
        return s.encode() if self.names_as_bytes else s

    # -- pynvml's names -------------------------------------------------------------------

    def nvmlInit(self) -> None:
        self._enter("nvmlInit")
        if self.init_error is not None:
            raise error(self.init_error)
        self.refcount += 1

    def nvmlShutdown(self) -> None:
        self._enter("nvmlShutdown")
        self.refcount -= 1

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeHandle:
        self._enter("nvmlDeviceGetHandleByIndex", index)
        if not 0 <= index < len(self.devices):
            raise error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return FakeHandle(index)

    def nvmlDeviceGetUUID(self, handle: FakeHandle) -> str | bytes:
        self._enter("nvmlDeviceGetUUID", handle)
        return self._text(self._device(handle).uuid)

    def nvmlDeviceGetName(self, handle: FakeHandle) -> str | bytes:
        self._enter("nvmlDeviceGetName", handle)
        return self._text(self._device(handle).name)

    def nvmlDeviceGetMemoryInfo(
        self, handle: FakeHandle, version: int | None = None
    ) -> pynvml.c_nvmlMemory_t:
        self._enter("nvmlDeviceGetMemoryInfo", handle)
        d = self._device(handle)
        return pynvml.c_nvmlMemory_t(total=d.total, free=d.total - d.used, used=d.used)

    def nvmlDeviceGetUtilizationRates(self, handle: FakeHandle) -> pynvml.c_nvmlUtilization_t:
        self._enter("nvmlDeviceGetUtilizationRates", handle)
        d = self._device(handle)
        if d.util is None:
            raise error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return pynvml.c_nvmlUtilization_t(gpu=d.util, memory=0)

    def _process_list(self, handle: FakeHandle) -> list[Any]:
        """As pynvml builds it: structs turned into friendly objects, N/A memory into None."""
        out = []
        for pid, memory in self._device(handle).processes.items():
            c = pynvml.c_nvmlProcessInfo_v3_t(
                pid=pid,
                usedGpuMemory=pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value
                if memory is None
                else memory,
                gpuInstanceId=_NO_INSTANCE,
                computeInstanceId=_NO_INSTANCE,
            )
            obj = pynvml.nvmlStructToFriendlyObject(c)
            if obj.usedGpuMemory == pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value:
                obj.usedGpuMemory = None
            out.append(obj)
        return out

    def nvmlDeviceGetComputeRunningProcesses_v3(self, handle: FakeHandle) -> list[Any]:
        self._enter(V3, handle)
        return self._process_list(handle)

    def nvmlDeviceGetComputeRunningProcesses_v2(self, handle: FakeHandle) -> list[Any]:
        self._enter(V2, handle)
        return self._process_list(handle)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: FakeHandle) -> list[Any]:
        if self.legacy_unversioned:
            self._enter(V1, handle)
            # v1's nvmlProcessInfo_t had only these two fields.
            return [
                pynvml.nvmlFriendlyObject({"pid": p.pid, "usedGpuMemory": p.usedGpuMemory})
                for p in self._process_list(handle)
            ]
        try:
            self._enter(V1, handle, c_name=V3)
        except pynvml.NVMLError_FunctionNotFound:
            # pynvml's throwOnVersionMismatch: not an NVMLError at all.
            raise pynvml.NVMLLibraryMismatchError(
                "Unversioned function called and the pyNVML version does not match the NVML "
                "lib version."
            ) from None
        return self._process_list(handle)

    def nvmlDeviceGetProcessUtilization(
        self, handle: FakeHandle, timeStamp: int
    ) -> list[pynvml.c_nvmlProcessUtilizationSample_t]:
        self._enter("nvmlDeviceGetProcessUtilization", handle, timeStamp)
        d = self._device(handle)
        if not d.process_util_supported:
            raise error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        # The driver returns the samples newer than timeStamp; none at all is NOT_FOUND.
        out = [
            pynvml.c_nvmlProcessUtilizationSample_t(
                pid=pid, timeStamp=ts, smUtil=sm, memUtil=0, encUtil=0, decUtil=0
            )
            for pid, ts, sm in d.samples
            if ts > timeStamp
        ]
        if not out:
            raise error(pynvml.NVML_ERROR_NOT_FOUND)
        return out
