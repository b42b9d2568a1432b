"""The /proc readers and the sampler, against a fixture /proc tree (no root needed)."""

from __future__ import annotations

import os
import socket
import struct
import threading
from collections.abc import Collection
from dataclasses import replace
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from agent.model import FUTEX_WAIT, ProbeReading
from agent.observe.discovery import descendants
from agent.observe.sampler import Sampler
from agent.sources.procfs import (
    MappingsAt,
    ProcFS,
    parse_epoll_fds,
    parse_epoll_inputs,
    parse_exec_start_ms,
    parse_net_tcp,
    parse_net_unix,
    parse_stat,
    parse_syscall,
)

TCP_HEADER = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"


def stat_line(
    pid: int, comm: str, state: str = "S", ppid: int = 1, start: int = 4242, threads: int = 0
) -> str:
    rest = [state, str(ppid)] + ["0"] * 17 + [str(start)] + ["0"] * 30
    rest[17] = str(threads)  # field 20, num_threads
    return f"{pid} ({comm}) {' '.join(rest)}\n"


def test_parse_stat_survives_parentheses_and_spaces_in_comm():
    st_ = parse_stat(stat_line(7, "a) (b c", state="D", ppid=3, start=99))
    assert (st_.pid, st_.comm, st_.state, st_.ppid, st_.start_ticks) == (7, "a) (b c", "D", 3, 99)


def test_parse_syscall_forms():
    assert parse_syscall("running\n") is None
    assert parse_syscall("-1 0x7ffd1000 0x401000\n").nr == -1
    sc = parse_syscall("202 0x5613a001c0a0 0x80 0x2 0x0 0x0 0x0 0x7ffd1000 0x7f00aa\n")
    assert sc is not None
    assert (sc.nr, sc.args[:3], sc.sp) == (202, (0x5613A001C0A0, 0x80, 2), 0x7FFD1000)
    assert sc.pc == 0x7F00AA
    idle = parse_syscall("-1 0x7ffd1000 0x401000\n")
    assert idle is not None and (idle.sp, idle.pc) == (0x7FFD1000, 0x401000)


def test_parse_exec_start():
    text = "dl (9301, #threads: 3)\n---\nse.exec_start   :   265462.412643\nse.vruntime : 1\n"
    assert parse_exec_start_ms(text) == 265462.412643


def _tcp_line(i, addr: str, port: int, st_: int, tx: int, rx: int, inode: int, v6: bool) -> str:
    if v6:
        raw = socket.inet_pton(socket.AF_INET6, addr)
        hexaddr = "".join(f"{w:08X}" for w in struct.unpack("<4I", raw))
    else:
        hexaddr = f"{struct.unpack('<I', socket.inet_aton(addr))[0]:08X}"
    return (
        f"{i:4d}: {hexaddr}:{port:04X} {'0' * len(hexaddr)}:0000 {st_:02X} {tx:08X}:{rx:08X} "
        f"00:00000000 00000000     0        0 {inode} 1 0000000000000000 100 0 0 10 0\n"
    )


@given(
    st.lists(
        st.tuples(
            st.ip_addresses(v=4).map(str),
            st.integers(0, 65535),
            st.sampled_from([1, 10]),
            st.integers(0, 2**16),
            st.integers(0, 2**16),
            st.integers(1, 2**31),
        ),
        max_size=8,
    )
)
def test_net_tcp_round_trip(rows):
    text = TCP_HEADER + "".join(_tcp_line(i, *r, v6=False) for i, r in enumerate(rows))
    got = [
        (s.address, s.port, s.state, s.tx_queue, s.rx_queue, s.inode)
        for s in parse_net_tcp(text, "tcp")
    ]
    assert got == [tuple(r) for r in rows]


def test_net_tcp6_address():
    text = TCP_HEADER + _tcp_line(0, "::1", 8000, 10, 128, 2, 55, v6=True)
    (s,) = parse_net_tcp(text, "tcp6")
    assert (s.address, s.port, s.rx_queue, s.tx_queue) == ("::1", 8000, 2, 128)


# --- a fixture /proc tree ----------------------------------------------------------------------


def write(path: Path, text: str | bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)


def make_proc(tmp_path: Path) -> Path:
    """Process 10 ('server', child of 1): thread 10 blocked on a glibc mutex that thread 11
    holds, thread 11 running; a listening socket on port 8000 with 2 queued connections;
    process 20 is its child."""
    root = tmp_path / "proc"
    write(root / "1/stat", stat_line(1, "init", ppid=0))
    write(root / "10/stat", stat_line(10, "server", ppid=1))
    write(root / "20/stat", stat_line(20, "rank", ppid=10))
    write(root / "20/task/20/stat", stat_line(20, "rank", state="R", ppid=10))
    write(root / "20/task/20/schedstat", "5 0 0\n")
    write(root / "10/io", "rchar: 1\nwchar: 12345\n")
    t10, t11 = root / "10/task/10", root / "10/task/11"
    write(t10 / "stat", stat_line(10, "server", ppid=1))
    write(t10 / "schedstat", "1000 0 3\n")
    write(t10 / "sched", "server (10, #threads: 2)\nse.exec_start : 5000.5\n")
    write(t10 / "syscall", "202 0x2000 0x80 0x2 0x0 0x0 0x0 0x7000 0x401000\n")
    write(t11 / "stat", stat_line(11, "loader", state="R", ppid=1))
    write(t11 / "schedstat", "999999 0 3\n")
    # /proc/PID/mem: a sparse file read with pread at the futex address
    mem = bytearray(0x3000)
    mem[0x2000:0x2014] = struct.pack(
        "<5I", 2, 0, 11, 1, 0
    )  # __lock, __count, __owner, __nusers, __kind
    write(root / "10/mem", bytes(mem))
    write(
        root / "10/maps",
        "00001000-00003000 rw-p 00000000 00:00 0 \n"
        "00006000-00008000 rw-p 00000000 00:00 0    [stack]\n",
    )
    (root / "10/fd").mkdir(parents=True)
    os.symlink("socket:[777]", root / "10/fd/3")
    os.symlink("/var/log/x.log", root / "10/fd/4")
    (root / "10/ns").mkdir()
    os.symlink("net:[4026531840]", root / "10/ns/net")
    write(root / "10/net/tcp", TCP_HEADER + _tcp_line(0, "0.0.0.0", 8000, 0x0A, 128, 2, 777, False))
    return root


def test_sampler_reads_a_fixture_tree(tmp_path):
    proc = ProcFS(str(make_proc(tmp_path)))
    assert descendants(proc, [10]) == {10: [10, 20]}
    sampler = Sampler(proc, clock_ns=lambda: 6_000_000_000, wall=lambda: 1e9)
    snap = sampler.snapshot([10, 20, 30], ProbeReading())
    assert snap.gone == {30}
    p = snap.processes[10]
    assert (p.comm, p.ppid, p.write_bytes) == ("server", 1, 12345)
    t10 = p.thread(10)
    assert t10 is not None and t10.wait is not None and t10.lock is not None
    assert (t10.wait.uaddr, t10.wait.op, t10.wait.val, t10.wait.source) == (
        0x2000,
        FUTEX_WAIT,
        2,
        "proc",
    )
    assert (t10.lock.word, t10.lock.owner_field, t10.lock.users_field) == (2, 11, 1)
    assert t10.last_ran_ns == 5_000_500_000
    assert t10.stack == (0x6000, 0x8000)
    t11 = p.thread(11)
    assert t11 is not None and t11.wait is None and t11.cpu_ns == 999999
    (lst,) = p.listeners
    assert (lst.port, lst.queued, lst.backlog) == (8000, 2, 128)


def test_probe_entry_wins_over_seeding_only_when_proc_agrees(tmp_path):
    from agent.model import FutexWait, InflightWait

    proc = ProcFS(str(make_proc(tmp_path)))
    sampler = Sampler(proc, clock_ns=lambda: 6_000_000_000)
    seen = FutexWait(0x2000, FUTEX_WAIT, 2, since_ns=4_000_000_000, source="bpf")
    snap = sampler.snapshot([10], ProbeReading(inflight={10: InflightWait(10, 10, seen)}))
    assert snap.processes[10].thread(10).wait == seen
    stale = FutexWait(0x9999, FUTEX_WAIT, 2, since_ns=1, source="bpf")  # another word: stale
    snap = sampler.snapshot([10], ProbeReading(inflight={10: InflightWait(10, 10, stale)}))
    assert snap.processes[10].thread(10).wait.source == "proc"


def test_vanished_process_is_gone_not_an_error(tmp_path):
    root = make_proc(tmp_path)
    (root / "10/task/10/stat").unlink()
    (root / "10/task/11/stat").unlink()
    snap = Sampler(ProcFS(str(root))).snapshot([10])
    assert snap.gone == {10}


class CountingProcFS(ProcFS):
    """Counts reads per file name: what a tick costs."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.reads: dict[str, int] = {}

    def _read(self, *parts: object) -> str | None:
        # The sampler's own clock read (thread-self/sched, once a tick) is not a thread's.
        name = "/".join(map(str, parts)) if parts[0] == "thread-self" else str(parts[-1])
        self.reads[name] = self.reads.get(name, 0) + 1
        return super()._read(*parts)

    def mappings_at(self, pid: int, addrs: Collection[int]) -> MappingsAt:
        self.reads["maps"] = self.reads.get("maps", 0) + 1
        return super().mappings_at(pid, addrs)


def test_a_thread_that_did_not_run_is_not_read_again(tmp_path):
    root = make_proc(tmp_path)
    proc = CountingProcFS(str(root))
    sampler = Sampler(proc, clock_ns=lambda: 6_000_000_000)
    first = sampler.snapshot([10]).processes[10].thread(10)
    assert first.wait is not None and first.wait.uaddr == 0x2000
    # Thread 10 has not run (same schedstat): what it shows cannot have changed, and
    # is not read again, even if the file says otherwise.
    write(root / "10/task/10/syscall", "202 0x2100 0x80 0x2 0x0 0x0 0x0 0x7000 0x401000\n")
    proc.reads.clear()
    again = sampler.snapshot([10]).processes[10].thread(10)
    assert again.wait == first.wait and again.last_ran_ns == first.last_ran_ns
    assert proc.reads.get("syscall", 0) == 0 and proc.reads.get("sched", 0) == 0
    # Thread 11 was running: read in full every time.
    assert proc.reads["stat"] >= 2 and proc.reads["schedstat"] == 2
    # Once it has run, it is read again.
    write(root / "10/task/10/schedstat", "2000 0 4\n")
    moved = sampler.snapshot([10]).processes[10].thread(10)
    assert moved.wait is not None and moved.wait.uaddr == 0x2100 and moved.cpu_ns == 2000


def in_wait(tid: int, since_ns: int, uaddr: int = 0x2000, pid: int = 10) -> ProbeReading:
    """A probe reading: ``tid`` in a futex wait on ``uaddr`` that it saw begin at ``since_ns``."""
    from agent.model import FutexWait, InflightWait

    wait = FutexWait(uaddr, FUTEX_WAIT, 2, since_ns=since_ns, source="bpf")
    return ProbeReading(inflight={tid: InflightWait(tid, pid, wait)})


def test_a_thread_still_in_the_wait_the_probe_saw_begin_is_not_read_at_all(tmp_path):
    root = make_proc(tmp_path)
    proc = CountingProcFS(str(root))
    sampler = Sampler(proc, clock_ns=lambda: 6_000_000_000)
    first = sampler.snapshot([10], in_wait(10, 4_000_000_000)).processes[10].thread(10)
    assert first.wait is not None and first.wait.since_ns == 4_000_000_000
    proc.reads.clear()
    # The same wait, by its start time: it never left the syscall. Even its schedstat is
    # not read (thread 11, running, is: one read of it).
    again = sampler.snapshot([10], in_wait(10, 4_000_000_000)).processes[10].thread(10)
    assert again == first
    assert proc.reads["schedstat"] == 1
    # Another wait (it woke and waited again, its run time unchanged to the ns it is not):
    # its schedstat says whether it ran.
    write(root / "10/task/10/schedstat", "1500 0 4\n")
    write(root / "10/task/10/syscall", "202 0x2100 0x80 0x2 0x0 0x0 0x0 0x7000 0x401000\n")
    proc.reads.clear()
    moved = sampler.snapshot([10], in_wait(10, 5_000_000_000, 0x2100)).processes[10].thread(10)
    assert proc.reads["schedstat"] == 2 and proc.reads["syscall"] == 1
    assert moved.wait is not None and moved.wait.uaddr == 0x2100 and moved.cpu_ns == 1500


def test_a_marked_wait_seen_from_proc_is_not_read_while_the_mark_stands(tmp_path):
    """Thread 10 was read in a futex wait the probe did not see begin. Once the probe marked
    it (and its CPU time says it did not run between the read and the mark), a tick reads
    nothing of it while the probe says the mark stands; when the mark goes, it is read."""
    root = make_proc(tmp_path)
    proc = CountingProcFS(str(root))
    sampler = Sampler(proc, clock_ns=lambda: 6_000_000_000)
    first = sampler.snapshot([10]).processes[10].thread(10)
    assert first.wait is not None and first.wait.source == "proc"
    asked: list[dict[int, int]] = []
    sampler.seed(lambda threads: asked.append(dict(threads)) or set(threads))
    assert asked == [{10: 10}]  # thread 11 runs: not asked for
    marked = ProbeReading(seeded=frozenset({10}))
    write(root / "10/task/10/syscall", "202 0x2100 0x80 0x2 0x0 0x0 0x0 0x7000 0x401000\n")
    proc.reads.clear()
    again = sampler.snapshot([10], marked).processes[10].thread(10)
    assert again == first and proc.reads["schedstat"] == 1  # thread 11's only
    sampler.seed(lambda threads: asked.append(dict(threads)) or set(threads))
    assert len(asked) == 1  # nothing new to ask for
    # The mark is gone (it left the wait): read again, from its schedstat on.
    write(root / "10/task/10/schedstat", "2000 0 4\n")
    moved = sampler.snapshot([10], ProbeReading()).processes[10].thread(10)
    assert moved.wait is not None and moved.wait.uaddr == 0x2100 and moved.cpu_ns == 2000


def test_a_mark_made_after_the_thread_ran_is_not_trusted(tmp_path):
    """Thread 10 ran between its read and its mark (its CPU time moved): it may have left the
    wait before the mark was made, so the mark proves nothing and it is read each tick; it
    is not asked for again."""
    root = make_proc(tmp_path)
    proc = CountingProcFS(str(root))
    sampler = Sampler(proc, clock_ns=lambda: 6_000_000_000)
    sampler.snapshot([10])

    def mark(threads):
        write(root / "10/task/10/schedstat", "1001 0 4\n")  # it ran meanwhile
        return set(threads)

    sampler.seed(mark)
    write(root / "10/task/10/syscall", "7 0x0 0x0 0x0 0x0 0x0 0x0 0x7000 0x401000\n")  # poll
    proc.reads.clear()
    t = sampler.snapshot([10], ProbeReading(seeded=frozenset({10}))).processes[10].thread(10)
    assert proc.reads["schedstat"] == 2 and t.wait is None and t.syscall == 7
    asked: list[dict[int, int]] = []
    sampler.seed(lambda threads: asked.append(dict(threads)) or set())
    assert asked == []


def parked_only(root: Path) -> None:
    """make_proc's process 10 with thread 11 parked too, in a timed futex wait of its own."""
    write(root / "10/task/11/stat", stat_line(11, "loader", ppid=1))
    write(root / "10/task/11/sched", "loader\nse.exec_start : 4000.0\n")
    write(root / "10/task/11/syscall", "202 0x2800 0x80 0x0 0x7fff0000 0x0 0x0 0x7100 0x401000\n")


class WalkCountingProcFS(CountingProcFS):
    """Counts fd walks and memory opens too (the reads of a process, not of a thread)."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.walks = 0
        self.opens = 0

    def socket_fds(self, pid: int) -> dict[int, int]:
        self.walks += 1
        return super().socket_fds(pid)

    def open_memory(self, pid: int):  # type: ignore[no-untyped-def]
        self.opens += 1
        return super().open_memory(pid)


def test_a_quiet_process_is_reused_but_for_its_sockets(tmp_path):
    """No thread of process 10 ran: its maps, lock words, fds and write counter are not read
    again; its listener's queue is (clients connect to a server that does not run)."""
    root = make_proc(tmp_path)
    parked_only(root)
    proc = WalkCountingProcFS(str(root))
    sampler = Sampler(proc, clock_ns=lambda: 6_000_000_000)
    first = sampler.snapshot([10]).processes[10]
    assert first.listeners[0].queued == 2
    proc.reads.clear()
    proc.walks = proc.opens = 0
    write(root / "10/io", "rchar: 1\nwchar: 99999\n")  # cannot move unless it runs: not read
    write(root / "10/net/tcp", TCP_HEADER + _tcp_line(0, "0.0.0.0", 8000, 0x0A, 128, 5, 777, False))
    again = sampler.snapshot([10]).processes[10]
    assert (again.threads, again.word_ids, again.write_bytes) == (
        first.threads,
        first.word_ids,
        first.write_bytes,
    )
    assert again.listeners[0].queued == 5
    assert "maps" not in proc.reads and "io" not in proc.reads and "syscall" not in proc.reads
    assert proc.walks == 0 and proc.opens == 0
    # One thread ran: the process is read again, all of it.
    write(root / "10/task/11/schedstat", "1000000 0 4\n")
    proc.reads.clear()
    moved = sampler.snapshot([10]).processes[10]
    assert proc.reads["maps"] == 1 and proc.reads["io"] == 1 and proc.walks == 1
    assert moved.write_bytes == 99999


def test_a_quiet_process_reads_its_words_in_shared_memory_again(tmp_path):
    """Another process may take a lock in shared memory: the word is read again, the rest
    of the quiet process is not."""
    root = make_proc(tmp_path)
    parked_only(root)
    write(
        root / "10/maps",
        "00001000-00003000 rw-s 00000000 00:05 4242 /dev/shm/ring\n"
        "00006000-00008000 rw-p 00000000 00:00 0    [stack]\n",
    )
    proc = WalkCountingProcFS(str(root))
    sampler = Sampler(proc, clock_ns=lambda: 6_000_000_000)
    first = sampler.snapshot([10]).processes[10].thread(10)
    assert first.lock is not None and first.lock.owner_field == 11
    mem = bytearray((root / "10/mem").read_bytes())
    mem[0x2000:0x2014] = struct.pack("<5I", 2, 0, 77, 1, 0)  # now held by thread 77
    write(root / "10/mem", bytes(mem))
    proc.reads.clear()
    proc.opens = 0
    again = sampler.snapshot([10]).processes[10].thread(10)
    assert again.lock is not None and again.lock.owner_field == 77
    assert "maps" not in proc.reads and proc.opens == 1


def test_a_tid_reused_by_another_process_is_read_afresh(tmp_path):
    root = make_proc(tmp_path)
    sampler = Sampler(ProcFS(str(root)), clock_ns=lambda: 6_000_000_000)
    sampler.snapshot([10])
    # Same TID and CPU time under another pid: the cache is keyed by (pid, tid).
    write(root / "30/stat", stat_line(30, "other", ppid=1))
    write(root / "30/task/10/stat", stat_line(10, "other", state="D", ppid=1))
    write(root / "30/task/10/schedstat", "1000 0 3\n")
    t = sampler.snapshot([30]).processes[30].thread(10)
    assert (t.name, t.state, t.wait) == ("other", "D", None)


def test_threads_waiting_on_one_word_read_it_once(tmp_path):
    root = make_proc(tmp_path)
    for tid in range(12, 40):  # 28 more threads parked on the same mutex word
        task = root / f"10/task/{tid}"
        write(task / "stat", stat_line(tid, "server", ppid=1))
        write(task / "schedstat", f"{tid} 0 3\n")
        write(task / "sched", "server\nse.exec_start : 5000.5\n")
        write(task / "syscall", "202 0x2000 0x80 0x2 0x0 0x0 0x0 0x7000 0x401000\n")
    reads = []

    class CountingMemory(ProcFS):
        def open_memory(self, pid):
            mem = super().open_memory(pid)
            if mem is not None:
                real = mem.ints

                def ints(addr, count):
                    reads.append(addr)
                    return real(addr, count)

                mem.ints = ints
            return mem

    snap = Sampler(CountingMemory(str(root)), clock_ns=lambda: 6_000_000_000).snapshot([10])
    parked = [t for t in snap.processes[10].threads if t.lock is not None]
    assert len(parked) == 29 and all(t.lock.word == 2 for t in parked)
    assert reads == [0x2000]


def test_last_ran_is_moved_from_the_scheduler_clock_to_monotonic(tmp_path):
    """se.exec_start runs on the scheduler clock, which on a VM here lagged CLOCK_MONOTONIC by
    123 s: the sampler's own thread (running: 'now' on that clock) gives the offset."""
    root = make_proc(tmp_path)
    write(root / "thread-self/sched", "se.exec_start : 100000.000000\n")  # 100 s, ours now
    now = 223_000_000_000  # monotonic 223 s: the scheduler clock lags by 123 s
    t = Sampler(ProcFS(str(root)), clock_ns=lambda: now).snapshot([10]).processes[10].thread(10)
    raw = ProcFS(str(root)).thread_exec_start_ms(10, 10)
    assert raw is not None and t is not None and t.last_ran_ns is not None
    assert t.last_ran_ns == min(int(raw * 1e6) + 123_000_000_000, now)


def test_parse_net_unix_keeps_bound_paths_by_inode():
    text = (
        "Num       RefCount Protocol Flags    Type St Inode Path\n"
        "0000000003d67bfb: 00000002 00000000 00010000 0001 01 31020 /tmp/run/scheduler\n"
        "00000000994bc2a3: 00000003 00000000 00000000 0001 03   249\n"  # connected: no path
        "0000000012345678: 00000002 00000000 00010000 0001 01 31021 @hidden\n"
        "garbage\n"
    )
    assert parse_net_unix(text.splitlines()) == {31020: "/tmp/run/scheduler", 31021: "hidden"}


def test_parse_epoll_inputs_reads_the_inodes_awaited_for_input():
    fdinfo = (
        "pos:\t0\nflags:\t02\nmnt_id:\t17\nino:\t1039\n"
        "tfd:        4 events: 80000019 data:                4  pos:0 ino:b2721 sdev:9\n"
        "tfd:        5 events:       4 data:                5  pos:0 ino:b2722 sdev:9\n"  # out
        "tfd:        6 events: 40000000 data:                6  pos:0 ino:b2723 sdev:9\n"  # fired
        "tfd:        7 events:       1 data:                7  pos:0\n"  # no inode: left out
    )
    assert parse_epoll_inputs(fdinfo) == {0xB2721}
    assert parse_epoll_inputs("") == set()


def test_parse_epoll_fds_reads_each_tfd_line():
    fdinfo = (
        "pos:\t0\nflags:\t02000002\nmnt_id:\t15\nino:\t1057\n"
        "tfd:       11 events:       19 data:                b  pos:0 ino:405 sdev:f\n"
        "tfd:        9 events:       19 data:                9  pos:0 ino:405 sdev:f\n"
        "tfd: x events: 19\n"
    )
    assert parse_epoll_fds(fdinfo) == [11, 9]
    assert parse_epoll_fds("") == []


def test_the_pipes_a_process_reads_are_listed_again_only_once_it_has_run(tmp_path):
    root = make_proc(tmp_path)
    parked_only(root)
    walks = []

    class PipeWalks(ProcFS):
        def pipes_read(self, pid: int) -> set[int]:
            walks.append(pid)
            return super().pipes_read(pid)

    sampler = Sampler(PipeWalks(str(root)), clock_ns=lambda: 6_000_000_000)
    sampler.snapshot([10])
    sampler.pipes_read([10])
    sampler.snapshot([10])  # quiet: its fds are what they were
    sampler.pipes_read([10])
    assert walks == [10]
    write(root / "10/task/11/schedstat", "1000000 0 4\n")  # it ran
    sampler.snapshot([10])
    sampler.pipes_read([10])
    assert walks == [10, 10]


class TaskListings(CountingProcFS):
    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.listed = 0

    def tids(self, pid: int) -> list[int]:
        self.listed += 1
        return super().tids(pid)


def test_threads_still_in_their_waits_and_as_many_are_not_listed_again(tmp_path):
    """Thread 10 is in the futex wait the probe saw begin, thread 11 parked and not running,
    and the process counts two threads: the task directory is not listed again (no thread
    can have come or gone); thread 11's schedstat is read."""
    root = make_proc(tmp_path)
    parked_only(root)
    write(root / "10/stat", stat_line(10, "server", ppid=1, threads=2))
    proc = TaskListings(str(root))
    sampler = Sampler(proc, clock_ns=lambda: 6_000_000_000)
    first = sampler.snapshot([10], in_wait(10, 4_000_000_000)).processes[10]
    assert proc.listed == 1
    proc.reads.clear()
    again = sampler.snapshot([10], in_wait(10, 4_000_000_000)).processes[10]
    assert proc.listed == 1 and proc.reads["schedstat"] == 1
    assert again.threads is first.threads
    # A third thread: the count moved, so the threads are listed, and it is seen.
    t12 = root / "10/task/12"
    write(t12 / "stat", stat_line(12, "new", state="R", ppid=1))
    write(t12 / "schedstat", "5 0 1\n")
    write(root / "10/stat", stat_line(10, "server", ppid=1, threads=3))
    moved = sampler.snapshot([10], in_wait(10, 4_000_000_000)).processes[10]
    assert proc.listed == 2 and [t.tid for t in moved.threads] == [10, 11, 12]


def test_a_wait_that_ended_means_the_threads_are_listed_again(tmp_path):
    root = make_proc(tmp_path)
    parked_only(root)
    write(root / "10/stat", stat_line(10, "server", ppid=1, threads=2))
    proc = TaskListings(str(root))
    sampler = Sampler(proc, clock_ns=lambda: 6_000_000_000)
    sampler.snapshot([10], in_wait(10, 4_000_000_000))
    sampler.snapshot([10], in_wait(10, 4_500_000_000))  # another wait of thread 10
    assert proc.listed == 2
    # Thread 11 is gone though the count says two (another came): listed again.
    for name in ("stat", "schedstat", "sched", "syscall"):
        (root / f"10/task/11/{name}").unlink()
    (root / "10/task/11").rmdir()
    snap = sampler.snapshot([10], in_wait(10, 4_500_000_000))
    assert proc.listed == 3 and [t.tid for t in snap.processes[10].threads] == [10]


def test_the_main_threads_stat_reads_as_the_process_stat():
    """On the real /proc: the process's own fields (comm, state, parent, start, thread
    count) read from its main thread's stat, which skips the sums over every thread. Not the
    major faults, which are the main thread's own there (another thread's page-in makes them
    differ: it did under a parallel run), nor the CPU last run on, which can change between
    two reads."""
    stop = threading.Event()
    pool = [threading.Thread(target=stop.wait) for _ in range(20)]
    for t in pool:
        t.start()
    try:
        proc = ProcFS()
        main, whole = proc.main_stat(os.getpid()), proc.stat(os.getpid())
        assert main is not None and whole is not None
        assert replace(main, major_faults=None, cpu=None) == replace(
            whole, major_faults=None, cpu=None
        )
        assert proc.stat(os.getpid()).num_threads >= 21
    finally:
        stop.set()
        for t in pool:
            t.join()
    assert ProcFS().main_stat(2**22 + 1) is None  # beyond pid_max: no such process


def test_cgroup_path_and_real_uid():
    from agent.sources.procfs import parse_cgroup_path, parse_real_uid

    hybrid = "2:cpu:/\n1:name=systemd:/system.slice/a.service\n0::/system.slice/a.service\n"
    assert parse_cgroup_path(hybrid) == "/system.slice/a.service"
    assert parse_cgroup_path("0::/user.slice/user-1.slice/session-2.scope\n") == (
        "/user.slice/user-1.slice/session-2.scope"
    )
    legacy = "3:memory:/docker/x\n1:name=systemd:/docker/abc\n"  # cgroup v1 only: systemd's
    assert parse_cgroup_path(legacy) == "/docker/abc"
    assert parse_cgroup_path("2:cpu:/a\n") is None
    # A name with ':' in it is part of the path (split at the first two only).
    assert parse_cgroup_path("0::/a:b/c\n") == "/a:b/c"
    # Real, effective, saved, fs: a setuid image changes only the effective one.
    assert parse_real_uid("Name:\tsu\nUid:\t1000\t0\t0\t0\n") == 1000
    assert parse_real_uid("Uid:\n") is None and parse_real_uid("Uid:\tx\n") is None


def test_a_comm_cannot_forge_the_uid_or_the_cgroup():
    """A comm (prctl) of "\\x1cUid:\\t0..." is printed raw in status' Name line (the kernel
    escapes only "\\n" and spaces); a delegated cgroup may be named with \\r or U+2028."""
    from agent.sources.procfs import parse_cgroup_path, parse_real_uid

    for sep in ("\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\r", "\x0b", "\x0c"):
        status = f"Name:\t{sep}Uid:\t0\t0\t0\t0\nUmask:\t0022\nUid:\t65534\t65534\t65534\t65534\n"
        assert parse_real_uid(status) == 65534, repr(sep)
        forged = f"1:name=systemd:/user.slice/u/x{sep}1:name=systemd:/system.slice/v.service\n"
        assert (
            parse_cgroup_path(forged)
            == f"/user.slice/u/x{sep}1:name=systemd:/system.slice/v.service"
        )


def test_a_thread_name_cannot_forge_its_tgid(tmp_path):
    root = tmp_path / "proc"
    write(root / "501/status", "Name:\t\x1cTgid:\t1\nUmask:\t0022\nState:\tS\nTgid:\t500\n")
    assert ProcFS(str(root)).tgid_of(501) == 500
