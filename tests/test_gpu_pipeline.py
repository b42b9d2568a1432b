"""NVML through the whole daemon, without root: a fake NVML, a fixture /proc, the real Daemon.

Discovery (the gpu selector), verdicts (GPU activity as progress, a failed read as no
evidence) and metrics (per-process and per-device GPU series, the collector's success).
"""

from __future__ import annotations

import time
from pathlib import Path

import pynvml

from agent.config import Target, validate
from agent.daemon import Daemon
from agent.export.metrics import registry_for
from agent.report.sentences import reasons
from agent.sources.nvml import NvmlSource
from agent.sources.procfs import ProcFS
from tests.fakenvml import GIB, FakeDevice, FakeNVML
from tests.test_discovery import add
from tests.test_procfs import stat_line, write


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def host(tmp_path: Path) -> Path:
    """Process 100 (a server that holds a GPU) with one parked thread; 200 an unrelated shell."""
    root = tmp_path / "proc"
    add(root, 1, 0, "init", "/sbin/init")
    add(root, 100, 1, "python3", "python3 serve.py")
    add(root, 200, 1, "bash", "bash")
    t = root / "100/task/100"
    write(t / "stat", stat_line(100, "python3"))
    write(t / "schedstat", "1000 0 1\n")
    write(t / "sched", "se.exec_start : 1.0\n")
    write(t / "syscall", "7 0x0 0x0 0x0 0x0 0x0 0x0 0x7000 0x1000\n")  # parked in poll
    return root


def daemon(tmp_path: Path, fake: FakeNVML, clock: Clock) -> Daemon:
    cfg = validate({"targets": [{"name": "any-gpu", "gpu": True}]}, "test")
    assert cfg.targets[0] == Target("any-gpu", gpu=True)
    return Daemon.with_sources(
        cfg, ProcFS(str(host(tmp_path))), None, NvmlSource(nvml=fake, clock=clock)
    )


def tick(d: Daemon, clock: Clock, fake: FakeNVML, util: int, stamp: int) -> None:
    clock.t += 1.0  # past the source's per-interval cache
    fake.devices[0].samples = [(100, stamp, util)]
    d.step()


def test_a_gpu_process_is_discovered_judged_and_exported(tmp_path: Path) -> None:
    fake = FakeNVML(
        [FakeDevice("GPU-aaaa", "NVIDIA H200", used=40 * GIB, util=60, processes={100: 38 * GIB})]
    )
    clock = Clock()
    d = daemon(tmp_path, fake, clock)
    for i in range(3):
        tick(d, clock, fake, util=60, stamp=10 + i)
        time.sleep(0.01)
    assert set(d.services) == {100}, "only the process holding GPU memory is watched"
    exp = d.exposition
    assert exp is not None
    (svc,) = exp.services
    assert (svc.service, svc.pid, svc.state) == ("any-gpu", 100, "progressing")
    (p,) = svc.processes
    assert p.gpu_memory_bytes == {"0": 38 * GIB} and p.gpu_utilization == {"0": 0.6}
    reg = registry_for(lambda: d.exposition, commit="abc1234")
    labels = {
        "service": "any-gpu",
        "service_pid": "100",
        "pid": "100",
        "comm": "python3",
        "gpu": "0",
    }
    assert reg.get_sample_value("hangwatch_process_gpu_memory_bytes", labels) == 38 * GIB
    assert reg.get_sample_value("hangwatch_process_gpu_utilization_ratio", labels) == 0.6
    assert reg.get_sample_value("hangwatch_gpu_memory_used_bytes", {"gpu": "0"}) == 40 * GIB
    info = {"gpu": "0", "uuid": "GPU-aaaa", "name": "NVIDIA H200"}
    assert reg.get_sample_value("hangwatch_gpu_info", info) == 1
    assert reg.get_sample_value("hangwatch_collector_success", {"collector": "gpu"}) == 1
    assert d.session is not None
    assert "GPU 0: 60% SM utilisation" in reasons(d.session.verdicts()[0].reasons)[0]


def test_idle_process_not_found_samples_and_errors_mid_run(tmp_path: Path) -> None:
    fake = FakeNVML(
        [FakeDevice("GPU-aaaa", "NVIDIA H200", used=40 * GIB, util=0, processes={100: 38 * GIB})]
    )
    clock = Clock()
    d = daemon(tmp_path, fake, clock)
    # No samples at all: NVML says NOT_FOUND; that is 0%, not an error.
    for _ in range(3):
        clock.t += 1.0
        fake.devices[0].samples = []
        d.step()
    assert d.collectors["gpu"].success
    (svc,) = d.exposition.services if d.exposition else ()
    assert svc.state != "progressing"
    assert svc.processes[0].gpu_utilization == {"0": 0.0}
    # The GPU is lost mid-run: the collector fails, errors are counted, nothing is guessed.
    fake.fail("nvmlDeviceGetMemoryInfo", pynvml.NVML_ERROR_GPU_IS_LOST, times=None)
    clock.t += 1.0
    d.step()
    assert not d.collectors["gpu"].success
    exp = d.exposition
    assert exp is not None and exp.agent.gpu_errors_total >= 1
    (svc,) = exp.services
    assert svc.state != "progressing" and not svc.gpu_spin
    assert svc.processes[0].gpu_memory_bytes == {}, "a failed read exports no stale GPU data"
    # The process stays watched while NVML is away: services do not flap.
    assert set(d.services) == {100}
    reg = registry_for(lambda: d.exposition, commit="abc1234")
    assert reg.get_sample_value("hangwatch_collector_success", {"collector": "gpu"}) == 0
    assert reg.get_sample_value("hangwatch_gpu_errors_total") >= 1


def test_gpu_memory_growing_at_zero_utilisation_is_loading(tmp_path: Path) -> None:
    """Weights copied to the GPU grow its memory while SM utilisation stays at 0% and every
    host thread is parked: that is work (loading), and its twin whose memory holds still is
    not."""
    fake = FakeNVML(
        [FakeDevice("GPU-aaaa", "NVIDIA H200", used=10 * GIB, util=0, processes={100: 8 * GIB})]
    )
    clock = Clock()
    d = daemon(tmp_path, fake, clock)
    states = []
    for _ in range(4):
        fake.devices[0].processes[100] = (fake.devices[0].processes[100] or 0) + 2 * GIB
        tick(d, clock, fake, util=0, stamp=0)
        states.append(d.exposition.services[0].state if d.exposition else None)
    assert states[-1] == "progressing", states
    assert d.session is not None
    said = reasons(d.session.verdicts()[0].reasons)
    assert any("GPU memory grew by" in r for r in said), said
    # The twin, on a host of its own: the memory holds still, nothing else happens.
    twin_fake = FakeNVML(
        [FakeDevice("GPU-aaaa", "NVIDIA H200", used=10 * GIB, util=0, processes={100: 8 * GIB})]
    )
    twin = daemon(tmp_path / "twin", twin_fake, clock)
    for _ in range(4):
        tick(twin, clock, twin_fake, util=0, stamp=0)
    exp = twin.exposition
    assert exp is not None and exp.services[0].state != "progressing"
