"""agent.sources.pystacks against real processes with the real py-spy: a stuck Python service (a parked
worker pool, an ABBA deadlock on two threading.Locks, a busy loop, the main thread joining)
is read by the line of its own code where each thread waits, without stopping it: no signal
and no ptrace call reaches it during the read, and no parked thread of it is woken."""

from __future__ import annotations

import ctypes
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.analysis import evidence as ev
from agent.analysis.stacks import group_stacks, lock_cycle_hint, lock_waiters, stack_facts
from agent.model import ProcessSample, Snapshot
from agent.observe.sampler import Sampler
from agent.report.sentences import reasons, wait_words
from agent.sources.probe import kernel_headers
from agent.sources.procfs import ProcFS
from agent.sources.pystacks import SourceLines, find_reader, read_stacks
from scripts.fixturelib import Fixture, tasks, wait_until
from scripts.realsw import ptrace_stop
from tests.privileged.harness import Untouched

# The stuck service. It says READY once every parked thread has slept in futex for three
# reads in a row: the queue workers in Queue.get, `evict` and `update` each at the line that
# takes its second lock (the Barrier makes sure both hold their first).
SERVICE = """\
import queue
import threading
import time

work = queue.Queue()
lock_a = threading.Lock()
lock_b = threading.Lock()
both_hold = threading.Barrier(2)
tids = {}


def serve_forever():
    tids.setdefault("workers", []).append(threading.get_native_id())
    work.get()


def evict():
    tids["evict"] = threading.get_native_id()
    with lock_a:
        both_hold.wait()
        with lock_b:
            pass


def update():
    tids["update"] = threading.get_native_id()
    with lock_b:
        both_hold.wait()
        with lock_a:
            pass


def spin():
    tids["spin"] = threading.get_native_id()
    while True:
        pass


def asleep_in_futex(tid):
    try:
        with open(f"/proc/self/task/{tid}/syscall") as f:
            nr = f.read().split()[0]
        with open(f"/proc/self/task/{tid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return nr == "202" and state == "S"


def main():
    threads = [threading.Thread(target=serve_forever, name=f"worker-{i}") for i in range(6)]
    threads.append(threading.Thread(target=evict, name="evict"))
    threads.append(threading.Thread(target=update, name="update"))
    threads.append(threading.Thread(target=spin, name="spin", daemon=True))
    for t in threads:
        t.start()
    while len(tids.get("workers", ())) < 6 or len(tids) < 4:
        time.sleep(0.01)
    parked = [*tids["workers"], tids["evict"], tids["update"]]
    stable = 0
    while stable < 3:
        stable = stable + 1 if all(asleep_in_futex(t) for t in parked) else 0
        time.sleep(0.05)
    workers = ",".join(str(t) for t in tids["workers"])
    print(
        f"READY workers={workers} evict={tids['evict']} update={tids['update']}"
        f" spin={tids['spin']} main={threading.get_native_id()}",
        flush=True,
    )
    for t in threads:
        t.join()


main()
"""

# 100 threads parked in Event.wait(), and the main thread joining them.
POOL = """\
import threading
import time

N = 100
never = threading.Event()
tids = []


def park():
    tids.append(threading.get_native_id())
    never.wait()


def asleep_in_futex(tid):
    try:
        with open(f"/proc/self/task/{tid}/syscall") as f:
            nr = f.read().split()[0]
        with open(f"/proc/self/task/{tid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return nr == "202" and state == "S"


threads = [threading.Thread(target=park, name=f"parked-{i}") for i in range(N)]
for t in threads:
    t.start()
stable = 0
while stable < 3:
    ok = len(tids) == N and all(asleep_in_futex(t) for t in tids)
    stable = stable + 1 if ok else 0
    time.sleep(0.05)
print("READY", flush=True)
for t in threads:
    t.join()
"""

# Signals generated for, and ptrace calls aimed at, any thread of the target.
WATCH = r"""
BPF_HASH(targets, u32, u8, 16384);
BPF_ARRAY(counts, u64, 2);

static void bump(int i) {
    u64 *n = counts.lookup(&i);
    if (n)
        __sync_fetch_and_add(n, 1);
}

TRACEPOINT_PROBE(signal, signal_generate) {
    u32 tid = args->pid;
    if (targets.lookup(&tid))
        bump(0);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_ptrace) {
    u32 tid = args->pid;
    if (targets.lookup(&tid))
        bump(1);
    return 0;
}
"""
SIGNALS, PTRACE_CALLS = 0, 1


class Watch:
    """Counts signals generated for the target's threads (signal:signal_generate's pid is
    the TID a signal is for; the target's TIDs in a map stand for its tgid: its threads are
    all there and none come or go while it is read) and ptrace calls aimed at them."""

    def __init__(self, pid: int) -> None:
        from bcc import BPF

        self.bpf = BPF(text=WATCH.encode())
        targets = self.bpf[b"targets"]
        for tid in tasks(pid):
            targets[ctypes.c_uint32(tid)] = ctypes.c_uint8(1)
        self.counts = self.bpf[b"counts"]

    def __getitem__(self, i: int) -> int:
        return int(self.counts[i].value)

    def reset(self) -> None:
        for i in (SIGNALS, PTRACE_CALLS):
            self.counts[i] = ctypes.c_uint64(0)

    def close(self) -> None:
        self.bpf.cleanup()


@pytest.fixture
def watch(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    headers = kernel_headers()
    assert headers is not None, "no kernel headers for bcc (make setup builds the fallback)"
    monkeypatch.setenv("BCC_KERNEL_SOURCE", headers)
    made: list[Watch] = []

    def start(pid: int) -> Watch:
        made.append(Watch(pid))
        return made[-1]

    yield start
    for w in made:
        w.close()


def line_of(src: str, function: str, nth_with: int | None = None, text: str | None = None) -> int:
    """The line number, in ``function`` of ``src``, of its nth ``with`` or of ``text``."""
    lines = src.splitlines()
    start = lines.index(f"def {function}():")
    withs = 0
    for i in range(start + 1, len(lines)):
        stripped = lines[i].strip()
        if lines[i].startswith("def "):
            break
        if text is not None and stripped == text:
            return i + 1
        if nth_with is not None and stripped.startswith("with "):
            withs += 1
            if withs == nth_with:
                return i + 1
    raise AssertionError(f"no such line in {function}")


def switches(pid: int, tids: list[int]) -> dict[int, int]:
    """Voluntary context switches of each thread: a parked thread's count moves only when
    something wakes it (a ptrace stop does)."""
    out = {}
    for tid in tids:
        with open(f"/proc/{pid}/task/{tid}/status") as f:
            m = re.search(r"^voluntary_ctxt_switches:\s+(\d+)$", f.read(), re.M)
        assert m is not None
        out[tid] = int(m.group(1))
    return out


def tracers(pid: int) -> dict[int, int]:
    out = {}
    for tid in tasks(pid):
        with open(f"/proc/{pid}/task/{tid}/status") as f:
            m = re.search(r"^TracerPid:\s+(\d+)$", f.read(), re.M)
        assert m is not None
        out[tid] = int(m.group(1))
    return out


def sample_of(pid: int) -> tuple[ProcessSample, Snapshot]:
    """The repo's own reading of the process from /proc (no probe needed)."""
    snap = Sampler().snapshot([pid])
    return snap.processes[pid], snap


@pytest.fixture
def service(tmp_path: Path) -> Iterator[tuple[Fixture, Path, str]]:
    path = tmp_path / "stuck_service.py"
    path.write_text(SERVICE)
    with Fixture([sys.executable, path], timeout=30) as fx:
        yield fx, path, SERVICE


def test_a_stuck_service_is_read_by_its_own_lines_without_stopping_it(service, watch):
    assert find_reader() is not None, "py-spy is not installed next to the interpreter"
    fx, path, src = service
    pid = fx.pid
    workers = fx.info.get_ints("workers")
    evict, update = fx.info.get_int("evict"), fx.info.get_int("update")
    spin, main = fx.info.get_int("spin"), fx.info.get_int("main")
    assert len(workers) == 6 and main == pid
    parked = [*workers, evict, update]

    # The counter counts: a harmless signal (Python ignores SIGWINCH) goes up by one.
    w = watch(pid)
    os.kill(pid, signal.SIGWINCH)
    wait_until(lambda: w[SIGNALS] >= 1, 5, "the SIGWINCH to be counted")
    w.reset()
    assert (w[SIGNALS], w[PTRACE_CALLS]) == (0, 0)

    before = switches(pid, parked)
    proc = ProcFS()
    read = read_stacks(pid, proc, source=SourceLines(proc))
    time.sleep(0.1)  # anything the read set off has landed
    assert w[SIGNALS] == 0, "the target got a signal while it was read"
    assert w[PTRACE_CALLS] == 0, "something ptraced the target while it was read"
    assert switches(pid, parked) == before, "a parked thread was woken by the read"
    assert set(tracers(pid).values()) == {0}

    assert read is not None and read.error is None, read
    print(f"\nread {len(read.threads)} threads in {read.seconds * 1000:.1f} ms")
    assert set(read.threads) == set(tasks(pid)) == {*parked, spin, main}

    sample, snap = sample_of(pid)
    groups, bare = group_stacks(sample, read.threads)
    assert bare == []
    pool = next(g for g in groups if workers[0] in g.tids)
    assert sorted(pool.tids) == sorted(workers)
    # glibc's sem_wait waits with FUTEX_WAIT_BITSET; the op is told, whichever it is
    said = wait_words(pool.wait)
    assert re.fullmatch(r"in futex [A-Z_]+ with no timeout", said), said
    site = pool.thread.site()
    assert site is not None
    callee, at = site
    assert (callee, at.function, at.file) == ("Queue.get", "serve_forever", str(path))
    assert at.line == line_of(src, "serve_forever", text="work.get()")
    assert at.code == "work.get()"

    # Each side of the cycle, at the line that takes its second lock, in its own function.
    for tid, function, code in (
        (evict, "evict", "with lock_b:"),
        (update, "update", "with lock_a:"),
    ):
        inner = read.threads[tid].frames[0]
        assert (inner.function, inner.file) == (function, str(path))
        assert inner.line == line_of(src, function, nth_with=2)
        assert inner.code == code
        assert read.threads[tid].site() == (None, inner)
    assert line_of(src, "evict", nth_with=2) != line_of(src, "update", nth_with=2)

    waiters = lock_waiters(sample, read.threads)
    assert {x.tid for x in waiters} == {evict, update}  # the main thread's join is threading.py
    hint = lock_cycle_hint(waiters)
    assert {x.tid for x in hint} == {evict, update}
    assert len({x.word for x in hint}) == 2

    facts = stack_facts(sample, read, snap.wall, snap.mono_ns)
    (lock_hint,) = (f for f in facts if isinstance(f, ev.PyLockHint))
    assert {a.tid for a in lock_hint.waits} == {evict, update} and lock_hint.words == 2
    print("\n".join(reasons(facts)))
    gil = [g for g in groups if g.gil is not None]
    print(f"GIL: {[g.gil for g in gil]} (the busy loop is {spin})")
    assert not gil or groups[0] is gil[0]

    # The watch would have seen a dump that stops the process: a blocking one ptraces every
    # thread and wakes every parked one. (Last: it disturbs the target.)
    reader = find_reader()
    assert reader is not None
    done = subprocess.run([reader, "dump", "--pid", str(pid)], capture_output=True, check=False)
    assert done.returncode == 0, done.stderr
    time.sleep(0.1)
    assert w[PTRACE_CALLS] > 0
    woken = switches(pid, parked)
    assert all(woken[t] > before[t] for t in parked)


def test_time_to_read_a_hundred_parked_threads(tmp_path: Path):
    path = tmp_path / "pool.py"
    path.write_text(POOL)
    with Fixture([sys.executable, path], timeout=30) as fx:
        proc = ProcFS()
        source = SourceLines(proc)
        reads = [read_stacks(fx.pid, proc, source=source) for _ in range(5)]
        for read in reads:
            assert read is not None and read.error is None, read
            assert len(read.threads) == 101
        took = [r.seconds * 1000 for r in reads if r is not None]
        print(
            f"\npy-spy --nonblocking read 101 threads (100 parked) in "
            f"{statistics.median(took):.1f} ms median of 5 "
            f"(min {min(took):.1f}, max {max(took):.1f}; the first {took[0]:.1f})"
        )
        sample, _ = sample_of(fx.pid)
        groups, _ = group_stacks(sample, reads[-1].threads if reads[-1] else {})
        assert max(len(g.tids) for g in groups) == 100


def test_the_untouched_watcher_sees_a_ptrace_stop_and_a_signal() -> None:
    """The watcher the real-software test trusts to say "never stopped, never signalled"
    must see both when they happen: a blocking dumper's ptrace stop, and a signal."""
    target = subprocess.Popen(["sleep", "60"])
    try:
        with Untouched([target.pid]) as quiet:
            time.sleep(0.2)
        assert quiet.touched is None, quiet.touched
        with Untouched([target.pid]) as stopped:
            ptrace_stop(target.pid, seconds=0.05)
        assert stopped.touched is not None and "ptrace" in stopped.touched
        with Untouched([target.pid]) as signalled:
            os.kill(target.pid, signal.SIGWINCH)  # sleep(1) ignores it
            time.sleep(0.05)
        assert signalled.touched is not None and "signalled" in signalled.touched
        assert (signal.SIGWINCH, target.pid) in signalled.signals
    finally:
        target.kill()
        target.wait()
