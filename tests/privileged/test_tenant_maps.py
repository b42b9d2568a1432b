"""A tenant cannot blind the kernel side for others: real BPF on this kernel, hostile
processes run as ``nobody``.

* A watched tenant that writes to 16,400 fds fills its own share of the write map, is
  flagged (``hangwatch_process_bpf_entries_refused_total``), and a root service started
  after it still has its writes counted: progressing, not stalled (the real daemon).
* An unwatched ``prctl(PR_SET_NAME)`` loop cannot crowd the ring buffer: a watched
  process's EDEADLK refusal and long wait are still seen, and the rename itself still is.
* A watched tenant refusing itself a PI lock 20,000 times loses its own events beyond its
  rate, counted against it; another process's long wait still arrives.
* A tenant whose threads all wait, or all spin on empty polls, fills only its share of the
  threads map; threads that are gone give their share back once user space forgets them.
* An unwatched process's EDEADLK takes no entry in the refusals map.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.model import ProbeReading
from agent.sources.probe import KernelProbes
from scripts.fixturelib import AS_NOBODY, Fixture
from tests.limits import HANG_S
from tests.privileged.daemonlib import (
    INTERVAL,
    Samples,
    free_port,
    pids_in,
    running_daemon,
    value,
    wait_for_log,
)
from tests.privileged.daemonlib import wait_until as daemon_wait_until

# serial: floods of renames, refusals and writes; exact drop counters
pytestmark = pytest.mark.serial

PYTHON = "/usr/bin/python3"
NOBODY = AS_NOBODY
FDS = 16_400  # more than the write map holds (16,384), host-wide, before the shares
THRESHOLD = 2

# Told to, writes one byte to each of FDS dup's of /dev/null, then parks.
FILLER = f"""
# hw-tenant-filler
import os, sys
print(f"STARTED pid={{os.getpid()}}", flush=True)
sys.stdin.readline()
fd = os.open("/dev/null", os.O_WRONLY)
fds = [os.dup(fd) for _ in range({FDS})]
for d in fds:
    os.write(d, b"x")
print("FILLED", flush=True)
sys.stdin.read()
"""

# A healthy service: 100 KB every 0.1 s to its own file (1 MB/s), asleep in between.
WRITER = """
# hw-root-writer
import os, sys, time
print(f"STARTED pid={os.getpid()}", flush=True)
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
chunk = b"x" * 100_000
while True:
    os.pwrite(fd, chunk, 0)
    time.sleep(0.1)
"""

# Renames itself as fast as it can, until killed.
RENAMER = """
import ctypes, os
libc = ctypes.CDLL(None)
names = [b"hw-flood-a", b"hw-flood-b"]
print(f"STARTED pid={os.getpid()}", flush=True)
i = 0
while True:
    libc.prctl(15, names[i & 1], 0, 0, 0)
    i += 1
"""

CONFIG = f"""
listen: "127.0.0.1:{{port}}"
interval_seconds: {INTERVAL}
park_threshold_seconds: {THRESHOLD}
targets:
  - name: tenant
    cmdline: "hw-tenant-filler"
  - name: service
    cmdline: "hw-root-writer"
"""


def tenant_filler() -> Fixture:
    """The filler as ``nobody``, its fd limit raised by root before the drop."""
    argv = ["prlimit", f"--nofile={FDS + 100}", "--", *NOBODY, PYTHON, "-c", FILLER]
    return Fixture(argv, ready="STARTED", timeout=30)


def test_a_tenant_filling_the_write_map_blinds_only_itself(tmp_path: Path) -> None:
    port = free_port()
    cfg = tmp_path / "hangwatch.yaml"
    cfg.write_text(CONFIG.format(port=port))
    out = tmp_path / "service.out"
    with running_daemon(cfg, port) as daemon, tenant_filler() as tenant:
        daemon_wait_until(daemon, lambda s: tenant.pid in pids_in(s), "the tenant watched")
        tenant.send("go")
        tenant.wait_for("FILLED", timeout=HANG_S)
        with Fixture([PYTHON, "-c", WRITER, out], ready="STARTED") as service:
            pid = str(service.pid)

            def written(s: Samples) -> bool:
                return (value(s, "hangwatch_process_write_bytes_total", pid=pid) or 0) >= 1e6

            daemon_wait_until(daemon, written, "the service's writes counted")
            time.sleep(2 * THRESHOLD)  # parked between writes for longer than the threshold
            s = daemon_wait_until(daemon, written, "a scrape past the threshold")
            state = value(s, "hangwatch_service_state", service="service", state="progressing")
            assert state == 1, {k: v for k, v in s.items() if "service_state" in k[0] and v}
        refused = value(s, "hangwatch_process_bpf_entries_refused_total", pid=str(tenant.pid))
        # Its share is an eighth of the map: the rest of its fds were refused, to it alone.
        assert refused is not None and refused >= FDS - 16_384 // 8, refused
        # Parked since it filled its share: its change to stalled says what it lost.
        wait_for_log(
            daemon,
            rf"service tenant pid {tenant.pid}: \S+ -> stalled: .*process {tenant.pid}: "
            "evidence incomplete",
            "the tenant's verdict saying its evidence is incomplete",
        )


@pytest.fixture
def probes() -> Iterator[KernelProbes]:
    with KernelProbes(long_wait_s=0.04) as p:
        yield p


def test_a_rename_flood_does_not_hide_watched_events(probes: KernelProbes) -> None:
    with (
        Fixture([*NOBODY, PYTHON, "-c", RENAMER], ready="STARTED", timeout=30) as flood,
        Fixture.c("pi_deadlock", "--wait-for-go", ready="HOLDING") as pi,
        Fixture.py("futex_calls", "10", ready="STARTED") as waits,
    ):
        probes.watch([pi.pid, waits.pid])
        probes.read()
        time.sleep(1)  # the flood runs with nothing read meanwhile
        pi.send("go")
        (parked,) = pi.wait_for("READY").get_ints("parked_tids")
        waits.send("go")
        waits.wait_for("DONE")
        time.sleep(0.5)  # still flooding after them
        renamed = probes.take_execs()
        r: ProbeReading = probes.read()
    kinds = {(e.kind, e.tid) for e in r.events}
    assert ("edeadlk", parked) in kinds, (r.events, r.counters)
    assert ("long-wait", waits.pid) in kinds, (r.events, r.counters)
    assert renamed is not None and flood.pid in renamed, (renamed, r.counters)
    assert r.counters["events_dropped"] == 0, r.counters


def test_an_unwatched_refusal_takes_no_refusals_entry(probes: KernelProbes) -> None:
    with Fixture([*NOBODY, *Fixture.c("pi_deadlock").argv], timeout=30) as pi:
        tids = set(pi.info.get_ints("tids"))
        probes.read()
        kept = {tid for tid, _ in probes._rows("refusals")}
    assert not kept & tids, kept


def test_a_tenant_with_many_threads_fills_only_its_share_of_the_threads_map() -> None:
    """The threads map at 16 entries, a share of 8: a watched tenant whose 20 threads all
    wait keeps 8 and is charged the rest; a process watched after it still has its waits
    tracked (on a map the tenant could fill, they were lost: inflight_full)."""
    sizes = {"MAX_THREADS": 16, "MAX_THREADS_PER_PROCESS": 8}
    with (
        KernelProbes(map_sizes=sizes) as probes,
        Fixture(
            [*NOBODY, *Fixture.c("park_pool", "20", "--wait-for-go").argv], ready="WAITING"
        ) as tenant,
        Fixture.py("futex_calls", "10", ready="STARTED") as other,
    ):
        probes.watch([tenant.pid])
        tenant.send("go")
        tenant.wait_for("READY")
        probes.watch([tenant.pid, other.pid])
        other.send("go")
        other.wait_for("DONE")
        r = probes.read()
    assert sum(r.wait_histogram.get(other.pid, {}).values()) == 11, (r.wait_histogram, r.counters)
    assert r.counters["inflight_full"] == 0, r.counters
    assert r.shares[tenant.pid].entries_refused >= 20 - 8, r.shares


def test_marks_for_a_tenant_parked_before_it_was_watched_take_an_eighth_at_most() -> None:
    """The threads map at 16 entries: a tenant whose 20 threads parked before it was watched
    gets marks for 2 of them (an eighth of the map), however many the agent asks for, and
    no share is claimed or given back for them; a process watched after it still has every
    wait tracked."""
    sizes = {"MAX_THREADS": 16, "MAX_THREADS_PER_PROCESS": 8}
    with (
        KernelProbes(map_sizes=sizes) as probes,
        Fixture(
            [*NOBODY, *Fixture.c("park_pool", "20", "--wait-for-go").argv], ready="WAITING"
        ) as tenant,
        Fixture.py("futex_calls", "10", ready="STARTED") as other,
    ):
        tenant.send("go")
        tenant.wait_for("READY")
        tids = [int(t) for t in os.listdir(f"/proc/{tenant.pid}/task")]
        probes.watch([tenant.pid])
        marked = probes.seed({tid: tenant.pid for tid in tids})
        assert len(marked) == 2, marked
        assert probes.seed({tid: tenant.pid for tid in tids}) == set()  # the room is taken
        r = probes.read()
        assert marked <= r.seeded and marked <= r.threads, (marked, r.seeded)
        probes.watch([tenant.pid, other.pid])
        other.send("go")
        other.wait_for("DONE")
        r = probes.read()
        probes.forget(marked)  # claimed by no one: nothing given back to the tenant
        released = {k.value: v.threads for k, v in probes._released.items()}
        assert released.get(tenant.pid, 0) == 0, released
    assert sum(r.wait_histogram.get(other.pid, {}).values()) == 11, (r.wait_histogram, r.counters)
    assert r.counters["inflight_full"] == 0, r.counters


# Told to, 20 threads each poll an empty pipe 200 times with a timeout of 0 (a spin), then
# park; SPUN once all have.
POLLING_TENANT = """
import os, select, sys, threading
print(f"STARTED pid={os.getpid()}", flush=True)
sys.stdin.readline()
r, _ = os.pipe()
done = threading.Barrier(21)
def spin():
    p = select.poll()
    p.register(r, select.POLLIN)
    for _ in range(200):
        p.poll(0)
    done.wait()
    threading.Event().wait()
for _ in range(20):
    threading.Thread(target=spin, daemon=True).start()
done.wait()
print("SPUN", flush=True)
sys.stdin.read()
"""
# Told to, polls an empty pipe POLLS times with a timeout of 0.
POLLS = 500
POLLER = f"""
import os, select, sys, threading
print(f"STARTED pid={{os.getpid()}}", flush=True)
sys.stdin.readline()
r, _ = os.pipe()
p = select.poll()
p.register(r, select.POLLIN)
for _ in range({POLLS}):
    assert p.poll(0) == []
print(f"DONE tid={{threading.get_native_id()}}", flush=True)
sys.stdin.read()
"""


def test_a_tenant_spinning_on_many_threads_fills_only_its_share_of_the_threads_map() -> None:
    """The threads map at 16 entries, a share of 8: a watched tenant whose 20 threads spin
    on empty polls keeps 8 and is charged the rest; a process watched after it still has
    each of its empty polls counted."""
    sizes = {"MAX_THREADS": 16, "MAX_THREADS_PER_PROCESS": 8}
    with (
        KernelProbes(map_sizes=sizes) as probes,
        Fixture([*NOBODY, PYTHON, "-c", POLLING_TENANT], ready="STARTED") as tenant,
        Fixture([PYTHON, "-c", POLLER], ready="STARTED") as other,
    ):
        probes.watch([tenant.pid])
        tenant.send("go")
        tenant.wait_for("SPUN")
        probes.watch([tenant.pid, other.pid])
        other.send("go")
        tid = other.wait_for("DONE").get_int("tid")
        r = probes.read()
    assert r.empty_polls is not None and r.empty_polls.get(tid) == POLLS, (tid, r.empty_polls)
    assert r.counters["poll_calls_full"] == 0, r.counters
    assert r.shares[tenant.pid].entries_refused >= 20 - 8, r.shares


# Told to (a line on stdin), runs one short-lived thread that makes one timed futex wait.
STEPS = """
import os, sys, threading
print(f"STARTED pid={os.getpid()}", flush=True)
for _ in sys.stdin:
    t = threading.Thread(target=lambda: threading.Event().wait(0.01))
    t.start()
    t.join()
    print(f"DONE tid={t.native_id}", flush=True)
"""


def test_threads_forgotten_give_their_share_back() -> None:
    """A share of 2 threads (the main thread, which joins, and one worker): a second worker
    is refused while the first one's entry stands; once user space forgets the gone threads
    (as the observer does each tick), a third worker has its entry again."""
    sizes = {"MAX_THREADS_PER_PROCESS": 2}
    with (
        KernelProbes(map_sizes=sizes) as probes,
        Fixture([PYTHON, "-c", STEPS], ready="STARTED") as fx,
    ):
        probes.watch([fx.pid])
        tids = []
        for _ in range(2):
            fx.send("go")
            tids.append(fx.wait_for("DONE").get_int("tid"))
        r = probes.read()
        assert tids[0] in r.threads and tids[1] not in r.threads, (tids, r.threads)
        refused = r.shares[fx.pid].entries_refused
        assert refused > 0, r.shares
        probes.forget(tids)
        fx.send("go")
        third = fx.wait_for("DONE").get_int("tid")
        r = probes.read()
    assert third in r.threads, (third, r.threads)
    assert r.shares[fx.pid].entries_refused == refused, (refused, r.shares)


REFUSALS = 20_000
# Told to, asks the kernel REFUSALS times for a PI lock it holds itself: EDEADLK each time.
SELF_REFUSER = f"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
word = ctypes.c_uint32(libc.gettid())  # the lock word says: held by this thread
print(f"STARTED pid={{os.getpid()}}", flush=True)
sys.stdin.readline()
for _ in range({REFUSALS}):
    libc.syscall(202, ctypes.byref(word), 6, 0, None, None, 0)  # FUTEX_LOCK_PI
    assert ctypes.get_errno() == 35, ctypes.get_errno()
print("DONE", flush=True)
sys.stdin.read()
"""


def test_a_watched_refusal_flood_loses_only_its_own_events(probes: KernelProbes) -> None:
    """A watched tenant refusing itself a PI lock in a loop sends at most its rate of events;
    the rest are counted against it, and another process's long wait still arrives."""
    with (
        Fixture([*NOBODY, PYTHON, "-c", SELF_REFUSER], ready="STARTED", timeout=HANG_S) as flood,
        Fixture.py("futex_calls", "10", ready="STARTED") as waits,
    ):
        probes.watch([flood.pid, waits.pid])
        flood.send("go")
        flood.wait_for("DONE", timeout=HANG_S)
        waits.send("go")
        waits.wait_for("DONE")
        r = probes.read()
    assert ("long-wait", waits.pid) in {(e.kind, e.tid) for e in r.events}, r.counters
    sent = sum(e.kind == "edeadlk" and e.tgid == flood.pid for e in r.events)
    assert sent + r.shares[flood.pid].events_dropped == REFUSALS, (sent, r.shares)
    assert sent < REFUSALS and r.counters["events_dropped"] == 0, (sent, r.counters)


def test_a_full_changes_map_makes_discovery_read_every_process() -> None:
    """More tasks exec'd or renamed between two reads than the changes map holds: take_execs
    says some may be missing (None), and discovery then reads every process again."""
    with KernelProbes(map_sizes={"MAX_CHANGES": 4}) as probes:
        probes.take_execs()
        for _ in range(8):
            subprocess.run(["true"], check=True)
        assert probes.take_execs() is None
