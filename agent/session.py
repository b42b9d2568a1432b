"""Where an observation starts and ends, for both commands: preflight, attach, observe, detach.

`diagnose` and `run` differ only in their inputs (the settings, the Scope of services each
tick watches) and in what they do with each tick; both start through ``start()``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from .analysis.verdict import ServiceVerdict
from .analysis.window import Tick
from .model import GpuReading
from .observe.observer import Observer, Scope
from .observe.sampler import Sampler
from .settings import Settings
from .sources.procfs import ProcFS
from .sources.protocols import GpuSource, ProbeSource


class Session:
    """One observation: its settings, the probe and GPU source it reads, and its observer.

    Built by ``start()`` from the real sources, or directly from stand-ins in tests."""

    def __init__(
        self,
        settings: Settings,
        probe: ProbeSource | None,
        gpu: GpuSource | None,
        proc: ProcFS | None = None,
        remember_gone: bool = False,
    ) -> None:
        self.settings = settings
        self.probe = probe
        self.gpu = gpu
        self.observer = Observer(Sampler(proc or ProcFS()), probe, remember_gone)

    def read_gpu(self) -> GpuReading | None:
        """This interval's NVML reading; None without a GPU source."""
        return self.gpu.read() if self.gpu is not None else None

    def observe(self, scope: Scope, gpu: GpuReading | None) -> Tick:
        return self.observer.observe(scope, gpu, self.settings)

    def verdicts(self) -> list[ServiceVerdict]:
        return self.observer.verdicts(self.settings)

    def reconfigure(self, settings: Settings) -> None:
        """New settings (SIGHUP): the threshold and window apply from the next verdict."""
        self.settings = settings


@contextlib.contextmanager
def start(
    settings: Settings,
    *,
    remember_gone: bool = False,
    proc: ProcFS | None = None,
    bpf_stats: bool = False,
    notice: Callable[[str], None] = lambda _: None,
) -> Iterator[Session]:
    """Check privilege and kernel features (KernelFeatureError, exit 3), attach the probes
    and open NVML, yield the session, and detach on the way out whatever happened.

    ``bpf_stats`` turns on the kernel's per-program run-time accounting for the session's
    life. ``notice`` is told what preflight fixed (a tracefs it mounted)."""
    from . import preflight  # late: --help and bad input need no kernel checks

    for line in preflight.check():
        notice(line)
    from .sources.nvml import NvmlSource
    from .sources.probe import KernelProbes  # bcc only after preflight mounted tracefs

    with contextlib.ExitStack() as stack:
        probe: ProbeSource = stack.enter_context(KernelProbes(proc=proc))
        if bpf_stats:
            restore = probe.enable_stats()
            if restore is not None:
                stack.callback(restore)
        gpu = NvmlSource()
        stack.callback(gpu.close)
        yield Session(settings, probe, gpu, proc, remember_gone)
