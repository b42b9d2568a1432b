"""Programs that do nothing, on the tracepoints hangwatch attaches to: the floor under any
program there, what the syscall tracepoints themselves cost. The benchmark's "empty programs"
mode measures the workloads under these, with no daemon, to set hangwatch's cost against."""

from __future__ import annotations

import os
from collections.abc import Iterable

from agent.sources.probe import kernel_headers


class EmptyPrograms:
    """One program per syscall tracepoint of ``tracepoints`` (names such as
    ``sys_enter_futex``, as ``KernelProbes.tracepoints()`` gives them), each returning 0 at
    once. Loaded and attached by bcc; detached by close() or on leaving the ``with`` block."""

    def __init__(self, tracepoints: Iterable[str]) -> None:
        from bcc import BPF  # the distribution's python3-bpfcc; only here, only as root

        headers = kernel_headers()
        if headers:
            os.environ["BCC_KERNEL_SOURCE"] = headers
        tracepoints = list(tracepoints)
        text = "\n".join(f"TRACEPOINT_PROBE(syscalls, {tp}) {{ return 0; }}" for tp in tracepoints)
        if any(tp.endswith("_preadv2") for tp in tracepoints):
            # The type of its flags, which no header bcc includes defines (see bpf/io.bpf.c).
            text = "typedef int rwf_t;\n" + text
        self._bpf = BPF(text=text.encode())

    def close(self) -> None:
        self._bpf.cleanup()

    def __enter__(self) -> EmptyPrograms:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
