"""Verdicts from synthetic facts: precedence, thresholds, listeners, services."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from agent.analysis import evidence as ev
from agent.analysis.classify import classify_process, classify_service
from agent.analysis.progress import ProcessProgress
from agent.analysis.verdict import (
    DEADLOCKED,
    IDLE,
    PROGRESSING,
    STALLED,
    ProcessFacts,
    ServiceFacts,
    incomplete,
)
from agent.analysis.waits import process_waits
from agent.model import Connection, Listener, ProbeShare
from agent.report.sentences import reasons
from tests.synth import parked, process

LISTEN = Listener("tcp", "0.0.0.0", 8000, queued=0, backlog=128)


def facts(
    pid=10,
    n=3,
    parked_n=None,
    parked_s=120.0,
    cycles=(),
    work=None,
    listeners=(),
    unread=0,
    doors=None,
) -> ProcessFacts:
    sample = process(pid, *(parked(pid * 100 + i) for i in range(n)), listeners=listeners)
    if unread:  # a client's request, not yet read, on the first listener's port
        port = listeners[0].port
        request = Connection("127.0.0.1", port, "10.0.0.9", 50000, 1, rx_queue=unread, tx_queue=0)
        sample = sample.__class__(**{**sample.__dict__, "connections": (request,)})
    prog = ProcessProgress(
        pid=pid,
        window_ns=5 * 10**9,
        working_tids=(pid * 100,) if work in ("cpu", "spin") else (),
        spinning_tids=(pid * 100,) if work == "spin" else (),  # its polls found nothing
        spin_cpu_ns=4 * 10**9 if work == "spin" else 0,
        empty_polls=57660 if work == "spin" else 0,
        cpu_ns=4 * 10**9 if work in ("cpu", "spin") else 0,
        write_bytes={"write": 4096, "answer": 4096, "bigwrite": 2**20}.get(work or ""),
        answered_bytes=4096 if work == "answer" else 0,
        written_to="/var/log/engine.log" if work in ("write", "bigwrite") else None,
        logged_to=1 if work in ("write", "bigwrite") else 0,
        logged_calls=1 if work in ("write", "bigwrite") else None,
    )
    return ProcessFacts(
        sample, prog, n if parked_n is None else parked_n, parked_s, cycles, front_door_ports=doors
    )


def test_cycle_wins_over_work():
    v = classify_process(facts(cycles=[(1000, 1001)], work="cpu"), 60)
    assert v.state == DEADLOCKED


def test_work_in_the_window_is_progressing_with_the_signal_in_words():
    v = classify_process(facts(work="answer"), 60)
    assert v.state == PROGRESSING
    assert any("wrote 4.0 KiB" in r for r in reasons(v.reasons))
    v = classify_process(facts(work="bigwrite"), 60)
    assert v.state == PROGRESSING
    assert any("wrote 1.0 MiB" in r for r in reasons(v.reasons))


def test_a_small_file_write_and_nothing_else_is_a_heartbeat_not_progress():
    """Ray's monitor.log every 5 s, vLLM's EngineCore warning each minute: a status line
    on a timer from a process that does nothing else does not make it progress."""
    v = classify_process(facts(work="write", parked_s=61), 60)
    assert v.state == STALLED
    assert any(
        "wrote only 4.0 KiB to /var/log/engine.log in 5.0 s and did nothing else" in r
        for r in reasons(v.reasons)
    ), reasons(v.reasons)
    # The same write beside CPU work is the work's log: progress
    cpu = facts(work="cpu", parked_s=61)
    p = cpu.progress
    with_log = cpu.__class__(
        **{**cpu.__dict__, "progress": p.__class__(**{**p.__dict__, "write_bytes": 4096})}
    )
    v = classify_process(with_log, 60)
    assert v.state == PROGRESSING and any("wrote 4.0 KiB" in r for r in reasons(v.reasons)), (
        reasons(v.reasons)
    )


def test_all_parked_past_threshold_is_stalled():
    v = classify_process(facts(parked_s=61), 60)
    assert v.state == STALLED
    assert "all 3 threads parked for 61 s" in reasons(v.reasons)[0]


def test_all_parked_under_threshold_is_not_yet_stalled():
    v = classify_process(facts(parked_s=59), 60)
    assert v.state == PROGRESSING  # idle is only ever a front door with nothing waiting
    assert "no progress for 59 s, under the 60 s threshold" in reasons(v.reasons)


def test_plumbing_listeners_are_no_front_door():
    """A rank's store and collective ports: parked past the threshold is stalled, not idle."""
    store = Listener("tcp", "0.0.0.0", 29500, queued=0, backlog=128)
    v = classify_process(facts(parked_s=61, listeners=(store,), doors=frozenset()), 60)
    assert v.state == STALLED
    assert any("no front door" in r for r in reasons(v.reasons))
    both = (store, LISTEN)
    assert classify_process(facts(listeners=both, doors=frozenset({8000})), 60).state == IDLE


def test_waiting_processes_take_the_services_state():
    """The scheduler of an idle server is idle; a rank behind a computing peer progresses."""
    server = [facts(pid=11, listeners=(LISTEN,)), facts(pid=12)]
    v = classify_service(10, server, 60)
    assert v.state == IDLE and {p.state for p in v.processes} == {IDLE}
    scheduler = v.processes[1]  # its own reasons ("no front door") no longer apply
    assert reasons(scheduler.reasons)[-1] == "waits with its service, which is idle"
    assert not any("front door" in r for r in reasons(scheduler.reasons))
    ranks = [facts(pid=11, work="cpu", parked_n=2), facts(pid=12)]
    v = classify_service(10, ranks, 60)
    assert {p.pid: p.state for p in v.processes} == {11: PROGRESSING, 12: PROGRESSING}
    hung = [facts(pid=11, cycles=[(1100, 1101)]), facts(pid=12)]
    assert [p.state for p in classify_service(10, hung, 60).processes] == [DEADLOCKED] * 2


def test_listener_with_empty_queue_is_idle_however_long_parked():
    v = classify_process(facts(parked_s=3600, listeners=(LISTEN,)), 60)
    assert v.state == IDLE
    assert any("port 8000 with an empty accept queue" in r for r in reasons(v.reasons))


def test_a_request_that_waited_in_the_window_keeps_a_server_from_idle():
    """A client that retries: between its tries nothing waits at the door, but a request
    waited 2 s ago and nothing was written since. Not idle: stalled past the threshold."""
    f = facts(parked_s=90, listeners=(LISTEN,))
    assert classify_service(10, [f], 60).state == IDLE
    v = classify_service(10, [f], 60, evidence=ServiceFacts(demand_age_s=2.0))
    assert v.state == STALLED, reasons(v.reasons)
    assert any("a request waited 2.0 s ago" in r for r in reasons(v.reasons))
    assert (
        classify_service(10, [f], 120, evidence=ServiceFacts(demand_age_s=2.0)).state == PROGRESSING
    )


def test_listener_with_queued_connections_past_threshold_is_stalled():
    q = Listener("tcp", "0.0.0.0", 8000, queued=3, backlog=128)
    assert classify_process(facts(parked_s=61, listeners=(q,)), 60).state == STALLED
    assert classify_process(facts(parked_s=61, listeners=(LISTEN,), unread=10), 60).state == STALLED


def test_unread_chatter_on_internal_connections_is_no_request():
    """Ray: ~95 loopback gRPC messages a second between its own processes; one caught in a
    receive queue is not a request at the front door."""
    f = facts(parked_s=61, listeners=(LISTEN,))
    grpc = Connection("127.0.0.1", 41000, "127.0.0.1", 46000, 2, rx_queue=218, tx_queue=0)
    sample = f.sample.__class__(**{**f.sample.__dict__, "connections": (grpc,)})
    v = classify_process(f.__class__(**{**f.__dict__, "sample": sample}), 60)
    assert v.state == IDLE, reasons(v.reasons)


def test_cpu_that_serves_no_one_is_not_progress():
    """A scheduler polling its sockets without sleeping, behind a front door with nothing
    waiting at it, is idle however much CPU it burns; its process too, in words."""
    server = [facts(pid=11, listeners=(LISTEN,)), facts(pid=12, work="spin", parked_n=2)]
    v = classify_service(10, server, 60)
    assert v.state == IDLE, reasons(v.reasons)
    assert reasons(v.reasons)[:2] == [
        "listening on port 8000 with an empty accept queue: waiting for requests",
        "process 12 (proc): 1 thread spun (4.00 CPU-s in 5.0 s, 57660 polls that found "
        "nothing): CPU that serves no one",
    ]
    assert [p.state for p in v.processes] == [IDLE, IDLE] and not any(p.worked for p in v.processes)
    assert reasons(v.processes[1].reasons)[-1] == "waits with its service, which is idle"
    # The same CPU without the probe's count of empty polls is work
    cpu = [server[0], facts(pid=12, work="cpu", parked_n=2)]
    assert classify_service(10, cpu, 60).state == PROGRESSING


def test_a_spin_counts_where_someone_waits_or_no_one_can():
    """Where a request waits, the spinning thread may be the one serving it; where there is
    no front door, the CPU is the job's own; beside other work, the service works anyway."""
    spin = facts(pid=12, work="spin", parked_n=2)
    waiting = [
        facts(pid=11, listeners=(Listener("tcp", "0.0.0.0", 8000, queued=2, backlog=128),)),
        facts(pid=11, listeners=(LISTEN,), unread=10),
    ]
    for front in waiting:
        v = classify_service(10, [front, spin], 60)
        assert v.state == PROGRESSING, reasons(v.reasons)
        assert any("spun" not in r and "used CPU" in r for r in reasons(v.reasons))
    idle = facts(pid=11, listeners=(LISTEN,))
    v = classify_service(10, [idle, spin], 60, evidence=ServiceFacts(demand_age_s=2.0))
    assert v.state == PROGRESSING  # a request waited in the window
    assert classify_service(10, [facts(pid=11), spin], 60).state == PROGRESSING  # no door
    plumbing = facts(pid=11, listeners=(LISTEN,), doors=frozenset())
    assert classify_service(10, [plumbing, spin], 60).state == PROGRESSING
    for other in ("cpu", "answer", "bigwrite"):
        busy = facts(pid=13, work=other)
        assert classify_service(10, [idle, spin, busy], 60).state == PROGRESSING, other


def test_a_thread_not_parked_is_not_a_stall():
    assert classify_process(facts(parked_n=2), 60).state == PROGRESSING


def test_service_parked_rank_with_a_working_peer_is_progressing():
    ranks = [facts(pid=p) for p in (11, 12, 13)] + [facts(pid=14, work="cpu", parked_n=2)]
    v = classify_service(10, ranks, 60)
    assert v.state == PROGRESSING
    assert any("parked while a peer works" in r for r in reasons(v.reasons))
    assert (v.unanswered_requests, v.seconds_since_progress) == (0, 0.0)  # it progresses


def test_service_all_ranks_parked_is_stalled_and_a_cycle_anywhere_is_deadlocked():
    assert classify_service(10, [facts(pid=p) for p in (11, 12)], 60).state == STALLED
    mixed = [facts(pid=11, work="cpu"), facts(pid=12, cycles=[(1200, 1201)])]
    v = classify_service(10, mixed, 60)
    assert v.state == DEADLOCKED and v.cycles == [(1200, 1201)]


def test_service_listening_anywhere_is_idle_when_all_parked():
    procs = [facts(pid=11), facts(pid=12, listeners=(LISTEN,))]
    assert classify_service(10, procs, 60).state == IDLE


@given(st.integers(0, 3), st.integers(0, 3))
def test_a_process_over_its_kernel_share_carries_it_in_its_verdict(refused, dropped):
    """Whatever the verdict, a process whose entries or events the kernel side did not keep
    says so, in its own reasons and its service's; the verdict itself is the same."""
    lost = incomplete(12, ProbeShare(refused, dropped))
    assert (lost is None) == (refused == dropped == 0)
    for work in (None, "cpu"):
        plain = [facts(pid=11, work=work), facts(pid=12)]
        marked = [plain[0], ProcessFacts(**{**plain[1].__dict__, "incomplete": lost})]
        a, b = classify_service(10, plain, 60), classify_service(10, marked, 60)
        assert a.state == b.state
        if lost is not None:
            assert b.reasons == [*a.reasons, lost] and lost in b.processes[1].reasons
            said = reasons(b.reasons)[-1]
            assert said.startswith("process 12: evidence incomplete"), said
        else:
            assert b.reasons == a.reasons


def test_service_whose_root_exited_is_reported_gone():
    v = classify_service(10, [], 60, gone=[10], root_gone=True)
    assert v.gone and v.processes[0].gone
    assert "exited" in reasons(v.reasons)[0]


@given(
    st.lists(
        st.tuples(
            st.booleans(),
            st.sampled_from([None, "cpu", "answer", "bigwrite", "write", "spin"]),
            st.floats(0, 1e4),
            st.booleans(),
        ),
        min_size=1,
        max_size=6,
    ),
    st.floats(0.1, 1e3),
)
def test_service_state_follows_the_precedence(procs, threshold):
    fs = [
        facts(
            pid=20 + i,
            cycles=[(9000 + i, 9100 + i)] if cyc else (),
            work=work,
            parked_s=ps,
            listeners=(LISTEN,) if listen else (),
        )
        for i, (cyc, work, ps, listen) in enumerate(procs)
    ]
    v = classify_service(10, fs, threshold)
    if any(c for c, *_ in procs):
        assert v.state == DEADLOCKED
    elif any(w not in (None, "write", "spin") for _, w, *_ in procs):  # a heartbeat: no work
        assert v.state == PROGRESSING
    elif any(w == "spin" for _, w, *_ in procs):  # CPU that serves someone only where one waits
        assert v.state == (IDLE if any(listen for *_, listen in procs) else PROGRESSING)
    elif any(listen for *_, listen in procs):
        assert v.state == IDLE
    elif min(ps for _, _, ps, _ in procs) < threshold:
        assert v.state == PROGRESSING
    else:
        assert v.state == STALLED
    for p in v.processes:  # a process either works, is in a cycle, or takes the service's state
        assert p.worked or p.state in (v.state, DEADLOCKED)
    assert reasons(v.reasons)


def _process_waits_by_definition(s, now_ns):
    """process_waits as its docstring defines it, thread by thread: the reference."""
    from collections import Counter

    from agent.analysis.waits import STARTUP_S
    from agent.syscalls import FUTEX, syscall_name, wait_kind

    counts: Counter = Counter()
    running, oldest, main, ages = 0, None, None, []
    for t in s.threads:
        if not t.blocked:
            running += 1
            continue
        name = syscall_name(t.syscall) if t.syscall is not None and t.syscall >= 0 else "no syscall"
        counts[(name, t.timed)] += 1
        if wait_kind(t.syscall) == FUTEX and t.timed is False and t.quiet_since_ns is not None:
            age = max(0.0, (now_ns - t.quiet_since_ns) / 1e9)
            oldest = age if oldest is None else max(oldest, age)
            if s.age_s is None or age <= s.age_s - STARTUP_S:
                ages.append(age)
                if t.tid == s.pid:
                    main = age
    waits = tuple((n, tm, k) for (n, tm), k in sorted(counts.items(), key=lambda x: -x[1]))
    return ev.ProcessWaits(waits, running, oldest, tuple(sorted(ages, reverse=True)), main)


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["S", "R", "D"]),
            st.sampled_from([202, 232, 7, 230, None]),
            st.sampled_from([True, False, None]),
            st.one_of(st.none(), st.integers(1, 900)),
        ),
        max_size=12,
    ),
    st.one_of(st.none(), st.floats(0, 1000)),
)
def test_process_waits_counts_as_its_definition(threads, age_s):
    from dataclasses import replace

    from agent.model import Threads, ThreadSample

    now = 1000 * 10**9
    ts = [
        ThreadSample(
            100 + i,
            "t",
            state,
            0,
            last_ran_ns=None if ago is None else now - ago * 10**9,
            syscall=nr,
            timed=timed,
        )
        for i, (state, nr, timed, ago) in enumerate(threads)
    ]
    for threads_ in (tuple(ts), Threads(ts)):  # computed, and kept on a Threads
        p = replace(process(100, *threads_), age_s=age_s)
        p = replace(p, threads=threads_)
        assert process_waits(p, now) == _process_waits_by_definition(p, now)
        assert process_waits(p, now) == _process_waits_by_definition(p, now)  # kept: the same
