"""NvmlSource against a scripted NVML (tests/fakenvml.py) and a fake clock; no GPU, no root.

The last tests use the real pynvml module: on a host without the driver they prove the
library's own failure path ends in a clear ok=False reading, not an exception.
"""

from __future__ import annotations

import ctypes
import logging
import sys

import pynvml
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.model import GpuDevice, GpuProcessUse
from agent.sources.nvml import CACHE_S, NOT_INSTALLED, NvmlSource
from tests.fakenvml import GIB, V1, V2, V3, FakeDevice, FakeNVML

LOGGER = "agent.sources.nvml"  # every module logs as logging.getLogger(__name__)


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, s: float) -> None:
        self.t += s


def two_gpus() -> FakeNVML:
    """GPU 0 busy with 100 and 200; GPU 1 holds 100 again and 300 (memory not available)."""
    return FakeNVML(
        [
            FakeDevice(
                "GPU-aaaa",
                "NVIDIA H100 80GB HBM3",
                total=80 * GIB,
                used=30 * GIB,
                util=75,
                processes={100: 10 * GIB, 200: 20 * GIB},
                samples=[(100, 10, 40), (100, 20, 90), (200, 15, 5)],
            ),
            FakeDevice(
                "GPU-bbbb",
                "NVIDIA H100 80GB HBM3",
                total=80 * GIB,
                used=5 * GIB,
                util=0,
                processes={100: 5 * GIB, 300: None},
                samples=[(100, 12, 30)],
            ),
        ]
    )


def source(fake: FakeNVML, clock: Clock | None = None, retry=(5.0, 40.0)) -> NvmlSource:
    return NvmlSource(nvml=fake, clock=clock or Clock(), retry_s=retry)


def records(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == level]


# -- good reads ---------------------------------------------------------------------------


def test_two_devices_and_their_processes() -> None:
    fake = two_gpus()
    fake.names_as_bytes = True  # older pynvml: decoded all the same
    r = source(fake).read()
    assert r.ok and r.error is None and r.errors_total == 0
    assert r.devices == (
        GpuDevice(0, "GPU-aaaa", "NVIDIA H100 80GB HBM3", 80 * GIB, 30 * GIB, 0.75),
        GpuDevice(1, "GPU-bbbb", "NVIDIA H100 80GB HBM3", 80 * GIB, 5 * GIB, 0.0),
    )
    assert r.processes == {
        # the max of its two samples on GPU 0, and its own on GPU 1: one entry per GPU
        100: (GpuProcessUse(0, 10 * GIB, 0.9), GpuProcessUse(1, 5 * GIB, 0.3)),
        200: (GpuProcessUse(0, 20 * GIB, 0.05),),
        300: (GpuProcessUse(1, None, 0.0),),  # no sample: 0%; memory unknown stays unknown
    }


def test_each_read_covers_the_time_since_the_previous_one() -> None:
    fake = two_gpus()
    clock = Clock()
    src = source(fake, clock)
    src.read()
    assert ("nvmlDeviceGetProcessUtilization", 0, 0) in fake.calls
    fake.devices[0].samples.append((200, 25, 60))
    fake.clear_calls()
    clock.advance(1)
    r = src.read()
    # the newest stamp seen per device is passed on, so old samples are not counted again
    assert ("nvmlDeviceGetProcessUtilization", 0, 20) in fake.calls
    assert ("nvmlDeviceGetProcessUtilization", 1, 12) in fake.calls
    assert r.processes[100] == (GpuProcessUse(0, 10 * GIB, 0.0), GpuProcessUse(1, 5 * GIB, 0.0))
    assert r.processes[200] == (GpuProcessUse(0, 20 * GIB, 0.6),)


def test_no_samples_is_zero_for_everyone_not_an_error() -> None:
    fake = two_gpus()
    for d in fake.devices:
        d.samples.clear()  # the driver answers NOT_FOUND
    r = source(fake).read()
    assert r.ok and r.errors_total == 0
    assert all(u.sm_utilization == 0.0 for uses in r.processes.values() for u in uses)
    assert r.processes[200] == (GpuProcessUse(0, 20 * GIB, 0.0),)


def test_process_utilisation_not_supported_is_zero_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, LOGGER)
    fake = two_gpus()
    fake.devices[0].process_util_supported = False
    clock = Clock()
    src = source(fake, clock)
    for _ in range(3):
        r = src.read()
        clock.advance(1)
        assert r.ok
        assert r.processes[200] == (GpuProcessUse(0, 20 * GIB, 0.0),)
    assert len([m for m in records(caplog, logging.INFO) if "not supported" in m]) == 1


def test_device_utilisation_not_supported_is_none() -> None:
    fake = two_gpus()
    fake.devices[1].util = None  # MIG mode
    r = source(fake).read()
    assert r.ok and r.devices[1].utilization is None and r.devices[0].utilization == 0.75


def test_garbage_sample_never_looks_busy() -> None:
    fake = two_gpus()
    fake.devices[1].samples = [(300, 50, 4294967295)]
    r = source(fake).read()
    assert r.processes[300] == (GpuProcessUse(1, None, 0.0),)


def test_v3_missing_falls_back_to_v2_and_remembers() -> None:
    fake = two_gpus()
    fake.missing.add(V3)
    clock = Clock()
    src = source(fake, clock)
    r = src.read()
    assert r.ok and r.processes[100][1] == GpuProcessUse(1, 5 * GIB, 0.3)
    clock.advance(1)
    assert src.read().ok
    names = fake.names()
    assert names.count(V3) == 1  # tried once, never again
    assert names.count(V2) == 4  # two devices, two reads


def test_unversioned_function_last() -> None:
    fake = two_gpus()
    fake.missing |= {V3, V2}
    fake.legacy_unversioned = True
    r = source(fake).read()
    assert r.ok and r.processes[300] == (GpuProcessUse(1, None, 0.0),)
    assert fake.names().count(V1) == 2


def test_no_process_function_at_all_is_a_clear_failure() -> None:
    fake = two_gpus()
    fake.missing |= {V3, V2}  # and the unversioned one raises NVMLLibraryMismatchError
    r = source(fake).read()
    assert not r.ok and r.processes == {} and r.devices == ()
    assert r.error is not None and "answers none of" in r.error and V2 in r.error


def test_cached_within_half_a_second() -> None:
    fake = two_gpus()
    clock = Clock()
    src = source(fake, clock)
    first = src.read()
    n = len(fake.calls)
    clock.advance(CACHE_S - 0.1)
    assert src.read() is first and len(fake.calls) == n
    clock.advance(0.2)
    assert src.read() is not first and len(fake.calls) > n


def test_duration_is_the_reads_own_time() -> None:
    fake = two_gpus()
    clock = Clock()
    fake.on_call = lambda _fn: clock.advance(0.01)
    r = source(fake, clock).read()
    assert r.duration_s == pytest.approx(0.01 * len(fake.calls))


def test_pids_from_the_last_good_reading() -> None:
    fake = two_gpus()
    clock = Clock()
    src = source(fake, clock)
    assert src.pids() == {100, 200, 300}  # reads first
    fake.devices[0].processes.pop(200)
    clock.advance(0.1)
    assert src.pids() == {100, 200, 300}  # the same tick: the cached reading
    clock.advance(1)
    assert src.pids() == {100, 300}
    fake.fail("nvmlDeviceGetCount", pynvml.NVML_ERROR_UNKNOWN, times=None)
    clock.advance(1)
    assert not src.read().ok
    assert src.pids() == {100, 300}  # NVML away: matches do not flap


def test_close_shuts_nvml_down_once() -> None:
    fake = two_gpus()
    src = source(fake)
    src.close()
    assert "nvmlShutdown" not in fake.names()  # never initialised: nothing to shut down
    src.read()
    assert fake.refcount == 1
    src.close()
    src.close()
    assert fake.refcount == 0 and fake.names().count("nvmlShutdown") == 1


# -- NVML not there -----------------------------------------------------------------------


def test_init_failure_logged_once_retried_with_backoff_then_recovery(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, LOGGER)
    fake = two_gpus()
    fake.init_error = pynvml.NVML_ERROR_LIBRARY_NOT_FOUND
    clock = Clock(0.0)
    src = source(fake, clock, retry=(5.0, 40.0))
    tried = []
    for second in range(200):
        clock.t = float(second)
        before = len(fake.calls)
        r = src.read()
        if len(fake.calls) > before:
            tried.append(second)
            assert fake.calls[before:] == [("nvmlInit",)]  # nothing else while it fails
        assert not r.ok and r.devices == () and r.processes == {}
        assert r.error == (
            "NVML not available: NVML Shared Library Not Found (no NVIDIA driver on this host?)"
        )
        assert r.errors_total == 0  # no NVML on this host is not an error of NVML
    assert tried == [0, 5, 15, 35, 75, 115, 155, 195]  # 5, 10, 20, then capped at 40
    assert len(records(caplog, logging.WARNING)) == 1
    assert "NVML Shared Library Not Found" in records(caplog, logging.WARNING)[0]

    fake.init_error = None  # the driver got installed
    clock.t = 235.0
    assert src.read().ok
    for second in range(236, 240):
        clock.t = float(second)
        assert src.read().ok
    assert records(caplog, logging.INFO) == ["NVML available again: 2 GPUs"]
    assert len(records(caplog, logging.WARNING)) == 1


@pytest.mark.parametrize(
    ("code", "words"),
    [
        (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "Driver Not Loaded (is the nvidia kernel module"),
        (pynvml.NVML_ERROR_NO_PERMISSION, "Insufficient Permissions (can this user open"),
    ],
)
def test_init_failure_names_the_cause(code: int, words: str) -> None:
    fake = two_gpus()
    fake.init_error = code
    r = source(fake).read()
    assert not r.ok and r.error is not None
    assert r.error.startswith("NVML not available: " + words)


def test_package_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    r = NvmlSource(clock=Clock()).read()
    assert not r.ok and r.error == NOT_INSTALLED


# -- errors at run time -------------------------------------------------------------------


def test_gpu_lost_mid_run_backs_off_reinits_and_recovers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, LOGGER)
    fake = two_gpus()
    clock = Clock(0.0)
    src = source(fake, clock, retry=(5.0, 40.0))
    fake.fail("nvmlDeviceGetMemoryInfo", pynvml.NVML_ERROR_GPU_IS_LOST, nth=3, times=None)
    assert src.read().ok  # calls 1 and 2

    clock.t = 1.0
    r = src.read()  # call 3: GPU 0 of the second read
    assert not r.ok and r.devices == () and r.processes == {}  # nothing partial
    assert r.error == "NVML error: GPU is lost (nvmlDeviceGetMemoryInfo, GPU 0)"
    assert r.errors_total == 1
    assert src.pids() == {100, 200, 300}

    fake.clear_calls()
    for t in (2.0, 3.0, 5.9):  # backing off: the failed reading, no NVML call
        clock.t = t
        assert src.read() is r
    assert fake.calls == []

    clock.t = 6.0
    r2 = src.read()
    # a lost GPU: shut down (ignoring what it says) and init again before reading
    assert fake.names()[:3] == ["nvmlShutdown", "nvmlInit", "nvmlDeviceGetCount"]
    assert not r2.ok and r2.errors_total == 2

    fake.clear_calls()
    clock.t = 15.9  # doubled: 10 s after 6.0
    src.read()
    assert fake.calls == []
    clock.t = 16.0
    assert src.read().errors_total == 3
    assert len(records(caplog, logging.WARNING)) == 1  # one distinct error, one line

    fake.heal()
    clock.t = 36.0  # 20 s after 16.0
    good = src.read()
    assert good.ok and good.errors_total == 3 and len(good.devices) == 2
    assert records(caplog, logging.INFO)[-1] == "NVML available again: 2 GPUs"

    # a good read resets the back-off: the next failure waits retry_s[0] again
    fake.fail("nvmlDeviceGetCount", pynvml.NVML_ERROR_UNKNOWN)
    clock.t = 37.0
    assert not src.read().ok
    fake.clear_calls()
    clock.t = 42.0
    assert src.read().ok and fake.calls != []
    # a new failure after a good read is worth a new line even with a known text
    assert len(records(caplog, logging.WARNING)) == 2


def test_unknown_error_retries_without_reinit() -> None:
    fake = two_gpus()
    clock = Clock()
    src = source(fake, clock)
    fake.fail("nvmlDeviceGetUtilizationRates", pynvml.NVML_ERROR_UNKNOWN)
    r = src.read()
    assert not r.ok
    assert r.error == "NVML error: Unknown Error (nvmlDeviceGetUtilizationRates, GPU 0)"
    fake.clear_calls()
    clock.advance(5)
    assert src.read().ok
    assert "nvmlInit" not in fake.names() and "nvmlShutdown" not in fake.names()


def test_new_error_text_is_logged_again(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, LOGGER)
    fake = two_gpus()
    clock = Clock()
    src = source(fake, clock)
    src.read()
    fake.fail("nvmlDeviceGetCount", pynvml.NVML_ERROR_GPU_IS_LOST)
    clock.advance(1)
    assert not src.read().ok
    fake.init_error = pynvml.NVML_ERROR_DRIVER_NOT_LOADED  # the driver is being reloaded
    for _ in range(4):
        clock.advance(60)
        r = src.read()
    assert r.error is not None and "Driver Not Loaded" in r.error
    assert r.errors_total == 5  # NVML worked before: its failures count
    warnings = records(caplog, logging.WARNING)
    assert len(warnings) == 2 and "GPU is lost" in warnings[0]


def test_failed_read_does_not_swallow_samples() -> None:
    fake = two_gpus()
    clock = Clock()
    src = source(fake, clock)
    fake.fail("nvmlDeviceGetUUID", pynvml.NVML_ERROR_UNKNOWN, nth=2)  # GPU 1, after GPU 0's
    assert not src.read().ok
    clock.advance(5)
    r = src.read()
    assert r.ok and r.processes[100][0].sm_utilization == 0.9
    assert fake.names().count("nvmlDeviceGetProcessUtilization") == 3
    assert fake.calls.count(("nvmlDeviceGetProcessUtilization", 0, 0)) == 2


def test_anything_else_raised_is_a_failed_read_too() -> None:
    fake = two_gpus()
    fake.fail("nvmlDeviceGetName", OSError("ctypes went wrong"))
    r = source(fake).read()
    assert not r.ok
    assert r.error == "NVML error: OSError: ctypes went wrong (nvmlDeviceGetName, GPU 0)"


# -- properties ---------------------------------------------------------------------------


samples_st = st.lists(
    st.tuples(st.sampled_from([1, 2, 3]), st.integers(1, 10**6), st.integers(0, 100)),
    max_size=20,
)


@settings(max_examples=200, deadline=None)
@given(samples_st, samples_st)
def test_sm_utilisation_is_the_max_of_new_samples(first: list, second: list) -> None:
    fake = FakeNVML([FakeDevice("GPU-x", "x", processes={1: 1, 2: 2, 3: None})])
    clock = Clock()
    src = source(fake, clock)
    fake.devices[0].samples = first
    r1 = src.read()
    newest = max((ts for _, ts, _ in first), default=0)
    fake.devices[0].samples = first + second
    clock.advance(1)
    r2 = src.read()
    for r, seen, since in ((r1, first, 0), (r2, first + second, newest)):
        assert r.ok
        for pid in (1, 2, 3):
            want = max((sm for p, ts, sm in seen if p == pid and ts > since), default=0) / 100
            assert r.processes[pid][0].sm_utilization == want


@settings(max_examples=50, deadline=None)
@given(st.floats(0.5, 30), st.integers(1, 6))
def test_backoff_doubles_to_the_cap(lo: float, doublings: int) -> None:
    hi = lo * 2**doublings
    fake = two_gpus()
    fake.init_error = pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    clock = Clock(0.0)
    src = source(fake, clock, retry=(lo, hi))
    src.read()
    delays = []
    for _ in range(doublings + 3):
        before = clock.t
        while True:
            n = len(fake.calls)
            src.read()
            if len(fake.calls) > n:
                break
            clock.advance(lo / 8)
        delays.append(clock.t - before)
    want = [min(hi, lo * 2**k) for k in range(doublings + 3)]
    assert delays == pytest.approx(want, abs=lo / 4)


# -- the real pynvml on this host ---------------------------------------------------------


def _driver_present() -> bool:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


@pytest.mark.skipif(_driver_present(), reason="this host has the NVIDIA driver")
def test_real_pynvml_without_driver() -> None:
    src = NvmlSource(retry_s=(0.0, 0.0))  # the real module, imported lazily
    try:
        r = src.read()
        assert not r.ok and r.devices == () and r.processes == {}
        assert r.error == (
            "NVML not available: NVML Shared Library Not Found (no NVIDIA driver on this host?)"
        )
        assert src.pids() == set()
    finally:
        src.close()


@pytest.mark.skipif(not _driver_present(), reason="no NVIDIA driver on this host")
def test_real_pynvml_with_driver() -> None:
    src = NvmlSource()
    try:
        r = src.read()
        assert r.ok, r.error
        assert r.devices and all(d.memory_total > 0 and d.uuid for d in r.devices)
    finally:
        src.close()
