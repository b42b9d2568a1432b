"""The process that holds a service up (agent.analysis.culprit.find_culprit): properties over a few
hundred seeded random services, and one test per shape behind its criteria, named for the shape
(the run it was seen in is in its docstring)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace

import pytest

from agent.analysis import evidence as ev
from agent.analysis.culprit import find_culprit
from agent.analysis.progress import ProcessProgress
from agent.analysis.verdict import STALLED, ProcessFacts, ServiceVerdict
from agent.analysis.waits import process_waits
from agent.model import Connection, Listener, ProcessSample, ThreadSample
from agent.report import sentences as words
from tests.synth import S, parked, process

CASES = 400
NOW = 1000 * S

FUTEXES = ("futex", "futex_wait", "futex_waitv")
OTHERS = ("epoll_wait", "poll", "read", "clock_nanosleep", "wait4", "accept4", "no syscall")


def facts(sample: ProcessSample, waits: ev.ProcessWaits | None) -> ProcessFacts:
    return ProcessFacts(
        sample=sample,
        progress=ProcessProgress(pid=sample.pid, window_ns=5 * S),
        parked_threads=len(sample.threads),
        parked_seconds=100.0,
        waits=waits,
    )


def verdict(
    procs: Sequence[ProcessFacts], cycles: Sequence[tuple[int, ...]] = ()
) -> ServiceVerdict:
    return ServiceVerdict(procs[0].sample.pid if procs else 1, STALLED, [], list(cycles), [])


def culprit(
    procs: Sequence[ProcessFacts], cycles: Sequence[tuple[int, ...]] = ()
) -> ev.Culprit | None:
    return find_culprit(verdict(procs, cycles), procs)


def score(w: ev.ProcessWaits) -> int:
    """Untimed futex waits less timed waits, as the docstring defines it."""
    own = sum(n for name, timed, n in w.waits if name in FUTEXES and timed is False)
    return own - sum(n for _, timed, n in w.waits if timed is True)


def untimed(tid: int, ago_s: float, uaddr: int | None = None) -> ThreadSample:
    """A thread in an untimed futex wait that began ``ago_s`` before NOW, on a word of its own
    unless one is given."""
    word = 0x5000 + 8 * tid if uaddr is None else uaddr
    return replace(parked(tid, uaddr=word, since=NOW - int(ago_s * S)), timed=False)


def timed(tid: int, ago_s: float, uaddr: int) -> ThreadSample:
    """A thread in a futex wait with a timeout (ray.get's) that began ``ago_s`` before NOW."""
    return replace(parked(tid, uaddr=uaddr, since=NOW - int(ago_s * S)), timed=True)


def stopped(
    samples: Sequence[ProcessSample],
    since_s: float,
    write: tuple[str, int] | None = None,
    request: bool = False,
) -> tuple[ServiceVerdict, list[ProcessFacts]]:
    """The verdict on ``samples`` (their waits taken at NOW) and their facts, with no progress
    for ``since_s``, dated by a write (target, pid) where one is given, or by an unanswered
    request that came then (``request``)."""
    procs = [facts(p, process_waits(p, NOW)) for p in samples]
    v = verdict(procs)
    v.seconds_since_progress = since_s
    if request:
        v.oldest_request_s = since_s
    if write is not None:
        v.reasons = [ev.LastProgress("write", write[0], write[1], since_s)]
    return v, procs


UP_S = 75.0  # a cluster up this long: no wait began in its processes' first seconds


def up(sample: ProcessSample) -> ProcessSample:
    return replace(sample, age_s=UP_S)


# --- random services -------------------------------------------------------------------------


def random_waits(rng: random.Random) -> ev.ProcessWaits:
    entries = []
    for _ in range(rng.randint(0, 4)):
        name = rng.choice(FUTEXES + OTHERS)
        entries.append((name, rng.choice((True, False, None)), rng.randint(1, 4)))
    oldest = rng.choice((None, round(rng.uniform(0, 500), 1)))
    return ev.ProcessWaits(tuple(entries), rng.randint(0, 2), oldest)


def random_service(rng: random.Random, with_cycles: bool) -> tuple[list[ProcessFacts], list]:
    pids = rng.sample(range(100, 200), rng.randint(1, 5))
    procs, tids = [], []
    for pid in pids:
        threads = [ThreadSample(pid * 100 + i, f"t{i}", "S", 0) for i in range(rng.randint(1, 4))]
        tids += [t.tid for t in threads]
        sample = process(pid, *threads, comm=f"p{pid}")
        procs.append(facts(sample, None if rng.random() < 0.15 else random_waits(rng)))
    cycles = []
    if with_cycles:
        for _ in range(rng.randint(1, 2)):
            r = rng.random()
            if r < 0.15:  # threads outside the service only (unwatched owners)
                cycles.append((99_998, 99_999))
                continue
            # Threads of the service, with or without one outside it.
            pool = [*tids, 99_999] if r < 0.4 else tids
            cycles.append(tuple(rng.sample(pool, min(len(pool), rng.randint(2, 3)))))
    return procs, cycles


def holders(procs: Sequence[ProcessFacts], cycles: Sequence[tuple[int, ...]]) -> set[int]:
    in_cycle = {tid for c in cycles for tid in c}
    return {f.sample.pid for f in procs if in_cycle & {t.tid for t in f.sample.threads}}


def test_by_own_waits_properties() -> None:
    rng = random.Random(20240611)
    named = nobody = 0
    for case in range(CASES):
        procs, _ = random_service(rng, with_cycles=False)
        got = culprit(procs)
        scores = sorted(
            ((score(f.waits), f.sample.pid) for f in procs if f.waits is not None), reverse=True
        )
        top = scores[0][0] if scores else None
        tied = len(scores) > 1 and scores[1][0] == top
        if got is None:
            nobody += 1
            assert top is None or top < 1 or tied, (case, scores)
            continue
        named += 1
        by_pid = {f.sample.pid: f for f in procs}
        assert got.pid in by_pid, (case, got)  # a process of the service
        f = by_pid[got.pid]
        assert f.waits is not None
        assert not tied and top is not None and top >= 1, (case, scores)
        assert score(f.waits) == top
        assert (got.comm, got.why) == (f.sample.comm, "own waits")
        assert got.threads == sum(
            n for name, timed, n in f.waits.waits if name in FUTEXES and timed is False
        )
        assert got.age_s == f.waits.oldest_untimed_s
        for _ in range(3):  # the order of the processes never matters
            shuffled = rng.sample(procs, len(procs))
            assert culprit(shuffled) == got, case
    # Both outcomes were explored, not one of them only.
    assert named > CASES // 10 and nobody > CASES // 10, (named, nobody)


def test_with_cycles_properties() -> None:
    rng = random.Random(7)
    named = outside = 0
    for case in range(CASES):
        procs, cycles = random_service(rng, with_cycles=True)
        got = culprit(procs, cycles)
        held_by = holders(procs, cycles)
        if not held_by:
            outside += 1
            assert got is None, case  # a cycle of nobody in the service: no guess by waits
            continue
        named += 1
        assert got is not None, case
        assert got.why == "cycle" and got.pid in held_by, (case, got, cycles)
        if len(held_by) == 1:
            for _ in range(3):
                assert culprit(rng.sample(procs, len(procs)), cycles) == got, case
    assert named > CASES // 2 and outside > 10, (named, outside)


def test_a_cycle_across_two_processes_does_not_depend_on_their_order() -> None:
    """A lock cycle across two processes (shared-memory mutexes; waitgraph draws such edges):
    both hold it; the answer must not change with the order of ``procs``."""
    a = facts(process(10, ThreadSample(10, "a", "S", 0), comm="a"), None)
    b = facts(process(20, ThreadSample(20, "b", "S", 0), comm="b"), None)
    assert culprit([a, b], [(10, 20)]) == culprit([b, a], [(10, 20)])


def test_no_processes_no_culprit() -> None:
    assert find_culprit(ServiceVerdict(1, STALLED, [], [], []), []) is None
    assert find_culprit(ServiceVerdict(1, STALLED, [], [(5, 6)], []), []) is None


# --- the shapes behind the rule, from threads as the sampler sees them ------------------------


def waiting(tid: int, syscall: int, timed: bool | None, since_s: float = 0) -> ThreadSample:
    last = NOW - int(since_s * S) if since_s else None
    return ThreadSample(tid, f"t{tid}", "S", 0, last_ran_ns=last, syscall=syscall, timed=timed)


def proc(pid: int, comm: str, *threads: ThreadSample) -> ProcessFacts:
    sample = process(pid, *threads, comm=comm)
    return facts(sample, process_waits(sample, NOW))


def test_undated_a_process_waiting_on_itself_leads_one_that_polls_with_a_timeout() -> None:
    """A DataLoader worker stuck in ``__getitem__`` against its main process polling it."""
    main = proc(
        100,
        "python",
        waiting(100, 202, True),  # the main thread: queue.get(timeout=5)
        waiting(101, 202, True),  # pin_memory thread: also polls
        waiting(102, 202, False, 300),  # an idle OpenMP thread
    )
    worker = proc(200, "pt_data_worker", waiting(200, 202, False, 95))  # __getitem__'s lock
    got = culprit([main, worker])
    assert got == ev.Culprit(200, "pt_data_worker", "own waits", threads=1, age_s=95.0)
    assert culprit([worker, main]) == got


def test_undated_idle_pool_threads_lead_a_process_waiting_with_a_timeout_for_data() -> None:
    """A torch rank that stopped taking part against the rank waiting in the collective."""
    launcher = proc(10, "torchrun", waiting(10, 230, True))  # its monitor's sleep
    stopped = proc(
        20,
        "python",
        waiting(20, 202, False, 400),  # main thread: on a lock of its own
        waiting(21, 202, False, 410),  # gloo threads idle on their work queues
        waiting(22, 202, False, 410),
        waiting(23, 232, False),  # its store client's epoll
    )
    in_collective = proc(
        30,
        "python",
        waiting(30, 202, False, 400),  # main thread waits for the collective's work
        waiting(31, 202, True),  # the gloo thread waiting, with its timeout, for data
        waiting(32, 202, False, 410),  # the other gloo thread, idle
        waiting(33, 232, False),
    )
    got = culprit([launcher, in_collective, stopped])
    assert got is not None
    assert (got.pid, got.why, got.threads) == (20, "own waits", 3)
    assert got.age_s == pytest.approx(410.0)
    assert "3 threads wait with no timeout" in words.render(got)


def test_undated_a_child_on_a_copied_lock_leads_a_parent_joining_it_with_a_timeout() -> None:
    """A child forked with a lock held, against the parent joining it 5 s at a time."""
    parent = proc(
        50,
        "python",
        waiting(50, 7, True),  # p.join(timeout=5): poll on the sentinel, 5 s at a time
        waiting(51, 202, False, 120),  # its queue feeder thread, idle
    )
    child = proc(60, "python", waiting(60, 202, False, 118))  # the copied lock, held forever
    got = culprit([parent, child])
    assert got == ev.Culprit(60, "python", "own waits", threads=1, age_s=118.0)
    # Had the parent joined with no timeout (wait4), it would tie with the child: no culprit.
    untimed_parent = proc(50, "python", waiting(50, 61, False), waiting(51, 202, False, 120))
    assert culprit([untimed_parent, child]) is None


def test_thread_pools_parked_since_start_up_are_background() -> None:
    """Real Ray: the autoscaler monitor carries 9 gRPC threads in untimed waits since it
    started, 90 s ago; the Serve replica's one request thread has waited on an Event since
    the request came, 41 s ago. By counts alone the monitor leads; by when the waits began,
    the replica holds the service up, and the age quoted is the hang's."""

    monitor = process(
        10, *(untimed(100 + i, 90, uaddr=0x2000 + 8 * i) for i in range(9)), comm="monitor.py"
    )
    replica = process(
        20,
        untimed(200, 41, uaddr=0x3000),
        *(untimed(201 + i, 88, uaddr=0x4000 + 8 * i) for i in range(6)),
        comm="ServeReplica",
    )
    procs = [facts(p, process_waits(p, NOW)) for p in (monitor, replica)]
    v = verdict(procs)
    v.seconds_since_progress = v.oldest_request_s = 41.5  # the pending request's age
    got = find_culprit(v, procs)
    assert got is not None and (got.pid, got.threads) == (20, 1), got
    assert got.age_s == pytest.approx(41.0)
    # Without a time since progress the counts decide, as before: the monitor
    v.seconds_since_progress = v.oldest_request_s = 0.0
    got = find_culprit(v, procs)
    assert got is not None and got.pid == 10, got


def test_the_most_waits_begun_when_the_request_came_lead_fewer_begun_then() -> None:
    """Real vLLM, a request hung in the Worker's step, 36 s ago by tcp_info: the API server's
    4 request threads began to wait then; so did the Worker's main thread and the 26 gloo
    run-loop threads the step had woken, read 1.9 s older through se.exec_start (another CPU's
    task clock, dated then by the agent's own CPU's offset); the EngineCore's 2. The Worker is where it stopped."""

    api = process(314, *(untimed(3140 + i, 35.8) for i in range(4)), comm="python")
    engine = process(382, *(untimed(3820 + i, 36.8) for i in range(2)), comm="VLLM::EngineCor")
    worker = process(398, *(untimed(3980 + i, 37.7) for i in range(27)), comm="VLLM::Worker")
    v, procs = stopped((api, engine, worker), 35.84, request=True)
    got = find_culprit(v, procs)
    assert got is not None and (got.pid, got.threads) == (398, 27), got


def test_a_main_thread_stopped_with_the_request_leads_pool_threads_that_parked_with_it() -> None:
    """Real vLLM, a request hung in the Worker's step on an Event (a CI run's numbers): the
    API server read it 41.6 s ago and passed it to the EngineCore over a unix socket (no
    connection shows it); its event loop runs on, and the 4 pool threads the request left
    parked then. The Worker's main thread stopped then, on the Event, with one more thread.
    By count the API server led, and was named; the Worker, whose loop stopped, is. Where
    two main threads stopped then, the counts decide between them."""

    api = up(process(314, *(untimed(3140 + i, 41.6) for i in range(4)), comm="python"))
    engine = up(process(382, *(untimed(3820 + i, 41.0) for i in range(2)), comm="VLLM::EngineCor"))
    worker = up(process(398, untimed(398, 41.3), untimed(3990, 41.2), comm="VLLM::Worker"))
    v, procs = stopped((api, engine, worker), 41.6, request=True)
    got = find_culprit(v, procs)
    assert got is not None and (got.pid, got.threads) == (398, 2), got
    engine = up(process(382, *(untimed(382 + i, 41.0) for i in range(3)), comm="VLLM::EngineCor"))
    v, procs = stopped((api, engine, worker), 41.6, request=True)
    got = find_culprit(v, procs)
    assert got is not None and (got.pid, got.threads) == (382, 3), got
    # Two main threads stopped then with as many waits: which holds it is unknown.
    engine = up(process(382, *(untimed(382 + i, 41.0) for i in range(2)), comm="VLLM::EngineCor"))
    v, procs = stopped((api, engine, worker), 41.6, request=True)
    assert find_culprit(v, procs) is None


def test_a_write_dates_the_stop_of_the_process_that_made_it_if_its_main_thread_stopped() -> None:
    """Real Ray, an actor whose method ray.get()s another method of itself: its one untimed
    wait began when it logged its last line, 36 s ago; so did the log monitor's, woken by
    that line. A status writer's thread parks again after each line just so (a Ray driver
    was named, in a local run, by the wait its thread began after its event stats): no one
    is named. Where the actor's main thread stopped then too, as in a hang of its own, the
    actor is named, ahead of the log monitor."""

    actor = process(14532, untimed(14540, 35.7), comm="ray::Selfish.ou")
    log_monitor = process(14402, untimed(14410, 33.6), comm="python")
    v, procs = stopped((log_monitor, actor), 36.0, ("python-core-worker.log", 14532))
    assert find_culprit(v, procs) is None
    actor = process(14532, untimed(14532, 35.9), untimed(14540, 35.7), comm="ray::Selfish.ou")
    v, procs = stopped((log_monitor, actor), 36.0, ("python-core-worker.log", 14532))
    got = find_culprit(v, procs)
    assert got is not None and (got.pid, got.threads) == (14532, 2), got


def test_a_status_write_after_the_hang_does_not_hide_the_one_main_thread_that_stopped() -> None:
    """Real Ray, the driver in ray.get on an actor method that waits on an Event: the GCS
    dumped its event stats (every 60 s) 10.3 s ago, just before the observation, so that
    write dates the service's last progress; no wait began then. The actor's main thread
    stopped 41 s ago, the only main thread in an untimed wait: the actor is named. With a
    second main thread stopped at another time, which one began the hang is unknown."""

    gcs = up(process(7307, *(untimed(7310 + i, 70.0) for i in range(3)), comm="gcs_server"))
    actor = up(process(7484, untimed(7484, 41.2), untimed(7490, 41.0), comm="ray::Stuck.bloc"))
    v, procs = stopped((gcs, actor), 10.3, ("gcs_server.out", 7307))
    got = find_culprit(v, procs)
    assert got is not None and got.pid == 7484, got
    assert got.age_s == pytest.approx(41.2, abs=0.01)
    # A request waiting dates the stop itself: no second guess.
    v.oldest_request_s = 10.3
    assert find_culprit(v, procs) is None
    v.oldest_request_s = 0.0
    # Two main threads stopped, 41 s and 25 s ago: none named, as before.
    helper = up(process(7500, untimed(7500, 25.0), comm="python"))
    procs.append(facts(helper, process_waits(helper, NOW)))
    assert find_culprit(v, procs) is None


def test_at_a_main_threads_date_the_process_that_made_the_last_progress_leads_that_main_thread() -> (
    None
):
    """Real Ray, an actor calling itself (a CI run's numbers): the actor logged its last line
    35.9 s ago and one of its threads began an untimed wait then (its main thread waits in
    ray.get with a timeout); an idle worker's main thread woke and parked again 36.2 s ago, as
    the actor blocked and gave its CPU back. Neither both wrote and stopped its main thread
    then; the idle worker's main thread is the only one stopped in an untimed wait, so its
    stop dates the hang, and at that date the actor, which made the last progress, leads."""

    main = timed(2630, 35.9, 0x9000)
    actor = up(process(2630, main, untimed(2655, 35.6), comm="ray::Selfish"))
    idle = up(process(2629, untimed(2629, 36.2), comm="ray::IDLE"))
    v, procs = stopped((idle, actor), 35.867, ("python-core-worker_2630.log", 2630))
    got = find_culprit(v, procs)
    assert got is not None and got.pid == 2630, got


def test_the_one_main_thread_stopped_breaks_a_tie_with_the_pool_threads_that_parked_with_it():
    """Real Ray, the driver in ray.get on an actor blocked on an Event (a local run's
    numbers): the GCS's event stats dated the stop 10.7 s ago. The actor's main thread, the
    only one stopped in an untimed wait, stopped 41.6 s ago; an idle worker's pool thread
    parked 41.5 s ago and a helper's 39.3 s ago, with it. Three waits at that date, one in
    each: the main thread's stop breaks the tie, and the actor is named."""

    actor = up(process(1534, untimed(1534, 41.56), untimed(1540, 11.23), comm="ray::Stuck.bloc"))
    idle = up(process(1535, untimed(1541, 41.50), untimed(1542, 1.56), comm="ray::IDLE"))
    helper = up(process(1410, untimed(1411, 39.25), untimed(1412, 8.0), comm="python"))
    gcs = up(process(1338, untimed(1339, 14.16), untimed(1343, 0.84), comm="gcs_server"))
    v, procs = stopped((gcs, helper, idle, actor), 10.653, ("gcs_server.out", 1338))
    got = find_culprit(v, procs)
    assert got is not None and got.pid == 1534, got
    assert got.age_s == pytest.approx(41.56, abs=0.01)


def test_the_waits_a_status_write_woke_do_not_hide_the_one_main_thread_that_stopped() -> None:
    """Real Ray, the driver in ray.get on an actor blocked on an Event (a CI run's numbers):
    the GCS's status write dated the stop 11.4 s ago, and one thread of each of four
    processes (the actor, an idle worker, two helpers) parked again 9.3-10.8 s ago, woken
    with it: four-way tie. The actor's main thread, the only one stopped in an untimed
    wait, stopped 41.2 s ago: that dates the hang, and the actor is named."""

    actor = up(process(11443, untimed(11443, 41.19), untimed(11450, 10.58), comm="ray::Stuck.bloc"))
    idle = up(process(11442, untimed(11449, 31.35), untimed(11451, 10.77), comm="ray::IDLE"))
    helpers = [
        up(process(pid, untimed(pid * 10, ago))) for pid, ago in ((11319, 9.3), (11258, 9.32))
    ]
    gcs = up(process(11200, untimed(11210, 2.76)))
    v, procs = stopped((gcs, idle, actor, *helpers), 11.355, ("gcs_server.out", 11200))
    got = find_culprit(v, procs)
    assert got is not None and got.pid == 11443, got
    assert got.age_s == pytest.approx(41.19, abs=0.01)


def test_status_write_by_another_process_does_not_date_the_hang() -> None:
    """Real Ray, an actor calling itself (a second CI run's numbers): the GCS dumped its event
    stats 10.4 s ago, just before the observation, so that write dates the stop. An idle
    worker's two pool threads had parked 11.3 and 10.5 s ago and the actor's one 10.3 s ago:
    in local runs the two processes' pool threads re-park within 0.2 s of each other, at 1, 5
    and 15 s ago. By count the idle worker led, and was named. No one is named: neither made
    that write, nor has a main thread that stopped then (the actor's waits in ray.get with a
    timeout). Nor where the driver's event stats dated the stop (a local run: 10.9 s before
    the read) and its own thread parked again after writing them."""

    gcs = up(process(14943, untimed(14950, 0.9), untimed(14951, 1.6), comm="gcs_server"))
    idle = up(process(15120, untimed(15130, 11.33), untimed(15131, 10.48), comm="ray::IDLE"))
    main = timed(15121, 41.0, 0x9000)
    actor = up(process(15121, main, untimed(15140, 10.33), comm="ray::Selfish.ou"))
    v, procs = stopped((gcs, idle, actor), 10.402, ("gcs_server.out", 14943))
    assert find_culprit(v, procs) is None
    driver_main = timed(14940, 41.5, 0x9100)
    driver = up(process(14940, driver_main, untimed(14960, 10.9), comm="python"))
    v, procs = stopped((driver, gcs, idle, actor), 10.93, ("python-core-driver.log", 14940))
    assert find_culprit(v, procs) is None
    # A request's arrival dates the stop of its own: the counts decide, and the idle worker
    # leads (this shape never has one; the rule only ties waits to a write's date).
    v, procs = stopped((gcs, idle, actor), 10.402, request=True)
    got = find_culprit(v, procs)
    assert got is not None and got.pid == 15120, got


# --- the request's holder: followed over connections inside the service ------------------------

DOOR = 8000  # the service's front door


def link(local: int, remote: int, recv_s: float | None, sent_s: float | None) -> Connection:
    """One end of a loopback connection, with its tcp_info dates where known."""
    ms = [None if t is None else int(t * 1000) for t in (recv_s, sent_s)]
    return Connection("127.0.0.1", local, "127.0.0.1", remote, local, 0, 0, ms[0], ms[1])


def serving(pid: int, comm: str, *threads: ThreadSample, conns=(), ports=()) -> ProcessSample:
    listeners = tuple(Listener(2, "127.0.0.1", p, 0, 128) for p in ports)
    return replace(up(process(pid, *threads, comm=comm, listeners=listeners)), connections=conns)


def serve_event(
    replica_waits: int = 1, passed_on: bool = True, client_waits: int = 0, bystander_waits: int = 0
) -> list[ProcessSample]:
    """Ray Serve, a replica's request thread waiting on an Event nobody sets (a CI run's
    shape): the proxy read the request 40.2 s ago at its front door and passed it over its
    connection to the replica's server port (``passed_on``; else later traffic hid it), and
    the replica answered on its own connection that it took it. The client (the driver, a
    process of the service) and a bystander (the Serve controller) may have threads that
    parked within the band of the request's date, as pool threads re-park at any time."""
    recv = 40.0 if passed_on else 3.0
    driver = serving(
        10,
        "python",
        *(untimed(11 + i, 36.5) for i in range(client_waits)),
        conns=(link(50000, DOOR, None, 40.2),),
    )
    proxy = serving(
        20,
        "ray::ProxyActor",
        untimed(21, 9.7),
        conns=(
            link(DOOR, 50000, 40.2, 40.2),
            link(51000, 7000, None, None),  # to the replica's server: no tcp_info
            link(6000, 52000, recv, recv),
        ),
        ports=(DOOR, 6000),
    )
    replica = serving(
        30,
        "ray::ServeReplica",
        *(untimed(31 + i, 39.9) for i in range(replica_waits)),
        untimed(39, 2.6),
        conns=(link(7000, 51000, recv, recv), link(52000, 6000, None, None)),
        ports=(7000,),
    )
    controller = serving(
        40, "ray::ServeController", *(untimed(41 + i, 37.0) for i in range(bystander_waits))
    )
    return [driver, proxy, replica, controller]


def test_a_request_passed_on_inside_the_service_is_held_by_the_process_it_reached_last() -> None:
    """The request went from the proxy to the replica (and the replica's word that it took
    it back): the replica holds it, whatever another process's threads did then."""
    v, procs = stopped(serve_event(bystander_waits=2), 40.2, request=True)
    got = find_culprit(v, procs)
    assert got is not None and (got.pid, got.threads) == (30, 1), got
    assert got.age_s == pytest.approx(39.9)
    for seed in range(3):  # nor does the order of the processes matter
        assert find_culprit(v, random.Random(seed).sample(procs, len(procs))) == got
    # Not seen to pass on: the counts decide, and two waits begun then outnumber one.
    v, procs = stopped(serve_event(bystander_waits=2, passed_on=False), 40.2, request=True)
    got = find_culprit(v, procs)
    assert got is not None and got.pid == 40, got


def test_the_client_of_the_oldest_request_waits_for_it_and_does_not_hold_it() -> None:
    """The client that sent the request is a process of the service (a driver) and two of
    its threads parked then: it waits for the answer; the replica, by its one wait, leads
    those left, wherever the request is seen to have gone."""
    for passed_on in (True, False):
        v, procs = stopped(serve_event(client_waits=2, passed_on=passed_on), 40.2, request=True)
        got = find_culprit(v, procs)
        assert got is not None and got.pid == 30, (passed_on, got)


def test_a_process_the_request_reached_that_did_not_stop_then_does_not_hold_it() -> None:
    """The request reached the replica, but none of its waits began then (as if it passed
    the request on where no connection shows, a pipe or shared memory): the counts decide,
    and the one process whose threads began to wait then is named."""
    v, procs = stopped(serve_event(replica_waits=0, bystander_waits=1), 40.2, request=True)
    got = find_culprit(v, procs)
    assert got is not None and got.pid == 40, got


def test_a_request_seen_to_reach_two_processes_last_names_no_holder() -> None:
    """The proxy passed data to two replicas when the request came: which one holds it is
    not known, and the counts (one wait begun then in each) tie: no one is named."""
    driver, proxy, replica, controller = serve_event()
    other = serving(
        50,
        "ray::ServeReplica",
        untimed(51, 40.0),
        conns=(link(7100, 51100, 40.1, 40.1),),
        ports=(7100,),
    )
    proxy = replace(proxy, connections=(*proxy.connections, link(51100, 7100, None, None)))
    v, procs = stopped((driver, proxy, replica, controller, other), 40.2, request=True)
    assert find_culprit(v, procs) is None


def test_a_main_threads_stop_dates_the_hang_and_every_process_counts() -> None:
    """torch, rank 1 stopped taking part while rank 0 waits in all_reduce (a local run's
    numbers): no write; the stop is dated by the last main thread to stop in an untimed
    wait, rank 0's, 1 ms after rank 1's. That date is the hang's own, not a status line's:
    every process counts its waits begun then, and rank 1's three (its main thread and its
    two idle gloo threads) outnumber rank 0's two (its other gloo thread waits with the
    collective's timeout). Counted only in the process whose thread dated it, rank 0 was
    named."""
    rank0 = up(
        process(
            2219,
            untimed(2219, 22.0655),
            untimed(2225, 22.065),
            timed(2226, 22.0, 0x9000),
            comm="python3",
        )
    )
    rank1 = up(
        process(
            2220,
            untimed(2220, 22.066),
            untimed(2227, 22.131),
            untimed(2228, 22.0657),
            comm="python3",
        )
    )
    procs = [facts(p, process_waits(p, NOW)) for p in (rank0, rank1)]
    v = verdict(procs)
    v.seconds_since_progress = 22.065
    v.reasons = [ev.LastProgress("ran", ev.Thread(2219, "python3"), 2219, 22.065)]
    got = find_culprit(v, procs)
    assert got is not None and (got.pid, got.threads) == (2220, 3), got
