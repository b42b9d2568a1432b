"""Checks before anything is attached: privilege and kernel features (exit 3 with the fix)."""

from __future__ import annotations

import os
import subprocess

from .errors import KernelFeatureError

CAP_DAC_READ_SEARCH = 2
CAP_SETGID = 6
CAP_SETUID = 7
CAP_SYS_PTRACE = 19
CAP_SYS_ADMIN = 21
CAP_PERFMON = 38
CAP_BPF = 39
HOW = (
    "run as root (sudo hangwatch ...), or grant CAP_BPF, CAP_PERFMON, CAP_SYS_PTRACE and "
    "CAP_DAC_READ_SEARCH (e.g. setpriv --ambient-caps +bpf,+perfmon,+sys_ptrace,+dac_read_search ...)"
)
TRACEFS_DIRS = ("/sys/kernel/tracing", "/sys/kernel/debug/tracing")
# The tracepoints nothing works without; the other syscalls' programs are optional (probe.py).
REQUIRED_TRACEPOINTS = ("sys_enter_futex", "sys_exit_futex")


def effective_caps(status_text: str) -> int:
    for line in status_text.splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return 0


def missing_caps(caps: int) -> list[str]:
    """Capabilities we lack; CAP_SYS_ADMIN stands in for BPF and PERFMON on old kernels."""
    have = lambda c: bool(caps >> c & 1)  # noqa: E731
    out = []
    if not (have(CAP_BPF) or have(CAP_SYS_ADMIN)):
        out.append("CAP_BPF")
    if not (have(CAP_PERFMON) or have(CAP_SYS_ADMIN)):
        out.append("CAP_PERFMON")
    if not have(CAP_SYS_PTRACE):
        out.append("CAP_SYS_PTRACE")  # to read lock words in /proc/PID/mem
    if not have(CAP_DAC_READ_SEARCH):
        # /proc/PID/{syscall,mem,io,environ,fd} are 0400 and owned by the target's user:
        # without it, evidence about non-root targets is silently missing.
        out.append("CAP_DAC_READ_SEARCH")
    return out


def _tracefs_ready(dirs: tuple[str, ...]) -> bool:
    return any(os.path.isdir(os.path.join(d, "events", "syscalls")) for d in dirs)


def missing_tracepoints(dirs: tuple[str, ...] = TRACEFS_DIRS) -> list[str]:
    """Required syscall tracepoints that no mounted tracefs has."""
    return [
        tp
        for tp in REQUIRED_TRACEPOINTS
        if not any(os.path.exists(os.path.join(d, "events", "syscalls", tp, "id")) for d in dirs)
    ]


def check(
    btf_path: str = "/sys/kernel/btf/vmlinux", tracefs_dirs: tuple[str, ...] = TRACEFS_DIRS
) -> list[str]:
    """Raise KernelFeatureError for what is missing; return notices for what we fixed.

    Must run before bcc is imported: bcc fixes its tracefs path at import time.
    """
    with open("/proc/self/status") as f:
        caps = effective_caps(f.read())
    lacking = missing_caps(caps)
    if lacking:
        raise KernelFeatureError(f"missing capability {', '.join(lacking)}", HOW)
    if not os.path.exists(btf_path):
        raise KernelFeatureError(
            f"the kernel has no BTF ({btf_path} is missing)",
            "hangwatch needs Linux >= 5.8 built with CONFIG_DEBUG_INFO_BTF=y",
        )
    notices = []
    if not (caps >> CAP_SETUID & 1 and caps >> CAP_SETGID & 1):
        # Optional: agent.sources.confined reads a target's source lines as that target, and only
        # a process that may change its uid and groups can become another user.
        notices.append(
            "no CAP_SETUID and CAP_SETGID: source lines of processes run by other users are "
            "not shown (the agent reads them only with the target's own rights)"
        )
    if not _tracefs_ready(tracefs_dirs):
        # Minimal hosts and containers often lack the mount; we are privileged, so fix it.
        for fs, where in (("debugfs", "/sys/kernel/debug"), ("tracefs", "/sys/kernel/tracing")):
            subprocess.run(["mount", "-t", fs, fs, where], capture_output=True, check=False)
        if not _tracefs_ready(tracefs_dirs):
            raise KernelFeatureError(
                "tracefs with syscall tracepoints is not available",
                "mount it (mount -t tracefs tracefs /sys/kernel/tracing) on a kernel built "
                "with CONFIG_FTRACE_SYSCALLS=y",
            )
        notices.append("mounted tracefs at /sys/kernel/tracing")
    absent = missing_tracepoints(tracefs_dirs)
    if absent:
        raise KernelFeatureError(
            f"the kernel has no syscall tracepoint {', '.join(absent)}",
            "hangwatch needs a kernel built with CONFIG_FTRACE_SYSCALLS=y",
        )
    return notices
