"""se.exec_start dated per CPU (agent.sources.schedclock) on a real blocked thread of a child,
on each CPU dated from the other (no root needed); the rules against injected clocks are in
tests/test_schedclock.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from agent.observe.sampler import Sampler
from agent.sources.procfs import ProcFS

CHILD = """
import os, sys, time
os.sched_setaffinity(0, {int(sys.argv[1])})
r, w = os.pipe()
sys.stdout.write(f"{time.monotonic_ns()}\\n")
sys.stdout.flush()
os.read(r, 1)  # blocked in read from here on: se.exec_start is about now
"""


def cpus_here() -> list[int]:
    return sorted(os.sched_getaffinity(0))


@pytest.mark.skipif(len(cpus_here()) < 2, reason="one CPU: its clock is the agent's own")
@pytest.mark.parametrize("order", ["first on the last", "last on the first"])
def test_a_real_thread_on_another_cpu_is_dated_to_when_it_stopped(order):
    """A thread blocked on one CPU, read by a sampler on another: its last run is when it
    blocked, within 1 s. With the sampler's own CPU's offset for both (before), on this
    project's 2-CPU VM one of the two read 7.1 s off; the steal time a loaded host adds while
    the offsets are read is tens of ms (a full suite with a Ray run beside it: 51 ms)."""
    cpus = cpus_here()
    theirs, ours = (cpus[0], cpus[-1]) if order == "first on the last" else (cpus[-1], cpus[0])
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(theirs)], stdout=subprocess.PIPE, text=True
    )
    home = os.sched_getaffinity(0)
    try:
        assert child.stdout is not None
        blocked_at = int(child.stdout.readline())
        time.sleep(0.3)
        sampler = Sampler(ProcFS())
        os.sched_setaffinity(0, {ours})  # where the snapshot begins: the offset it has
        t = sampler.snapshot([child.pid]).processes[child.pid].thread(child.pid)
        assert os.sched_getaffinity(0) == home  # back on the CPUs it was created on
    finally:
        os.sched_setaffinity(0, home)
        child.kill()
        child.wait()
    assert t is not None and t.blocked and t.last_ran_ns is not None
    assert abs(t.last_ran_ns - blocked_at) < 1_000_000_000, (t.last_ran_ns - blocked_at) / 1e9
