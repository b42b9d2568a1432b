"""hangwatch's real verdicts on real software: ``diagnose`` (and the daemon) against the PyTorch
jobs and the SGLang-shaped serving stack of this directory, in their hang and healthy shapes.

``test_torch_shapes.py`` and ``test_serving_shapes.py`` check from /proc that each shape is what
it claims (README.md and serving/README.md have the truth of each); here hangwatch must say the
same. Every test waits for the shape's READY line (and, where READY comes just before the wait,
for the wait itself), then runs ``python -m agent diagnose --json`` on the service's root
process. Failures print the verdict, its reasons and the whole JSON report.

The hang shapes are diagnosed as an engineer would meet them: ``--threshold 10 --duration 5``
on a hang already older than the threshold (HANG_AGE), so the verdict rests on evidence that
carries its own age (agent.analysis.last_progress), not on 10 s of watching. Where the evidence names one, the
process that holds the service up (the "culprit") must be the right one. The healthy shapes
get ``--threshold 2``: "under the threshold" cannot pass them, a healthy shape that hangwatch
thinks parked would be called stalled, not progressing.

Needs root and bcc (as ``tests/privileged``) besides the real-software venv: skipped locally
without them, failed under ``CI=true``.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from scripts import realsw
from scripts.fixturelib import REPO_ROOT, wait_until
from tests.limits import HANG_S, MIN_SCRAPES
from tests.privileged import daemonlib
from tests.privileged.daemonlib import (
    INTERVAL,
    Daemon,
    Samples,
    free_port,
    running_daemon,
    value,
)
from tests.privileged.harness import (
    DIAGNOSE_LIMIT_S,
    NO_DAEMON_SOCKET,
    Diagnosis,
    RunningDiagnose,
    Untouched,
    diagnose_argv,
)
from tests.realsw.servinglib import serving_stack, weight_server

# hangwatch attaches: root and bcc, as tests/privileged (conftest.needs_bpf)
pytestmark = [pytest.mark.privileged, pytest.mark.usefixtures("needs_bpf")]

THRESHOLD = 2.0  # the healthy shapes (and the daemon tests)
DURATION = 5.0
HANG_THRESHOLD = 10.0  # the hang shapes: diagnose --threshold 10 --duration 5 ...
HANG_AGE = 12.0  # ... on a hang this old when diagnose starts
DIAGNOSE_TIMEOUT = DIAGNOSE_LIMIT_S  # BPF compile and load included: see the harness
STATES = ("deadlocked", "stalled", "idle", "progressing")
SYS_FUTEX, SYS_CLOCK_NANOSLEEP = 202, 230
HOLD_S = 10.0  # how long the daemon's verdict must hold, scraped every INTERVAL


# --- diagnose and its verdict -------------------------------------------------------------


def diagnose(
    pid: int,
    threshold: float = THRESHOLD,
    duration: float = DURATION,
    socket: str = NO_DAEMON_SOCKET,
) -> Diagnosis:
    """``python -m agent diagnose --pid PID --json --threshold T --duration D``, to the end;
    it asks no daemon unless ``socket`` names one's status socket."""
    argv = diagnose_argv([pid], threshold=threshold, duration=duration, socket=socket)
    run = RunningDiagnose(argv)
    try:
        return run.finish(timeout=DIAGNOSE_TIMEOUT)
    finally:
        run.kill()


def diagnose_hang(pid: int, began: float) -> Diagnosis:
    """``diagnose --threshold 10 --duration 5`` once the hang that began at ``began``
    (time.monotonic) is HANG_AGE old: older than the threshold before diagnose looks."""
    time.sleep(max(0.0, began + HANG_AGE - time.monotonic()))
    return diagnose(pid, threshold=HANG_THRESHOLD)


def culprit_is(d: Diagnosis, svc: dict[str, Any], pid: int, what: str) -> None:
    """The service's verdict names ``pid`` as the process holding it up, first."""
    c = svc.get("culprit") or {}
    assert c.get("pid") == pid, d.explain(f"want {what} (pid {pid}) as the culprit, got {c}")
    assert svc["evidence"][0]["kind"] == "culprit", d.explain("the culprit leads the reasons")


def summary(svc: dict[str, Any]) -> str:
    """The service's state and reasons, and each process's, one per line."""
    rows = [f"service {svc.get('pid')}: {svc.get('state')}"]
    rows += [f"  - {r}" for r in svc.get("reasons", [])]
    for p in svc.get("processes", []):
        rows.append(f"  process {p.get('pid')} ({p.get('comm')}): {p.get('state')}")
        rows += [f"    - {r}" for r in p.get("reasons", [])]
    return "\n".join(rows)


def expect(d: Diagnosis, pid: int, shape: str, *states: str) -> dict[str, Any]:
    """The service rooted at ``pid``, asserted to be in one of ``states``."""
    svc = d.service(pid)
    print(f"{shape}: {summary(svc)}")  # shown with -rA: what hangwatch said, pass or fail
    want = " or ".join(states)
    assert svc.get("state") in states, d.explain(
        f"{shape}: want {want}, hangwatch says {svc.get('state')}\n{summary(svc)}"
    )
    return svc


# --- PyTorch: hangs ----------------------------------------------------------------------


def test_allreduce_peer_gone_is_stalled() -> None:
    """Rank 1 stopped taking part; rank 0 waits in all_reduce forever; torchrun monitors."""
    with realsw.torchrun_job("allreduce_peer_gone") as job:
        ready = job.ranks(2)
        waiter, gone = ready[0].get_int("pid"), ready[1].get_int("pid")
        wait_until(
            lambda: realsw.main_thread_in(waiter, SYS_FUTEX), 10, "rank 0 parked in all_reduce"
        )
        d = diagnose_hang(job.pid, time.monotonic())
    svc = expect(d, job.pid, job.shape, "stalled")
    culprit_is(d, svc, gone, "rank 1, which stopped taking part")
    # Each rank is named by its job labels (RANK, WORLD_SIZE, ...), torchrun by none.
    ranks = {p["pid"]: p["labels"] for p in svc["processes"] if p["labels"]}
    assert ranks.get(waiter, {}).get("rank") == "0", d.explain(f"rank labels: {ranks}")
    assert {r.get("world_size") for r in ranks.values()} == {"2"}, d.explain(f"{ranks}")
    assert len(ranks) == 2 and not svc["processes"][0]["labels"], d.explain(f"{ranks}")


def test_rendezvous_peer_missing_is_stalled() -> None:
    """Rank 0 of 2 waits in the TCPStore rendezvous for a rank 1 that never comes (it polls)."""
    with realsw.direct_job("rendezvous_peer_missing") as job:
        (line,) = job.ready_lines(1)
        pid = line.get_int("pid")
        wait_until(lambda: realsw.listening(job.port), 30, f"the TCPStore on port {job.port}")
        wait_until(
            lambda: realsw.main_thread_in(pid, SYS_CLOCK_NANOSLEEP), 10, "the rendezvous poll"
        )
        d = diagnose_hang(pid, time.monotonic())
    expect(d, pid, job.shape, "stalled")


def test_rendezvous_node_missing_is_stalled() -> None:
    """``torchrun --nnodes=2`` as node 0; node 1 never comes, so no worker starts: the agent
    waits in its rendezvous, polling its own store."""
    with realsw.missing_node_job() as job:
        wait_until(lambda: realsw.listening(job.port), 60, f"the store on port {job.port}")
        d = diagnose_hang(job.pid, time.monotonic())
    expect(d, job.pid, job.shape, "stalled")


def test_dataloader_worker_stuck_is_stalled() -> None:
    """The DataLoader's worker blocks forever in __getitem__; the main process polls for it."""
    with realsw.direct_job("dataloader_worker_stuck") as job:
        lines = {line["role"]: line.get_int("pid") for line in job.ready_lines(2)}
        main, worker = lines["main"], lines["worker"]
        assert worker in realsw.descendants(main), job.describe("the worker is not main's child")
        wait_until(lambda: realsw.main_thread_in(worker, SYS_FUTEX), 10, "the worker parked")
        d = diagnose_hang(main, time.monotonic())
    # Deadlocked once proven: the worker's threads can wake neither each other nor be reached
    svc = expect(d, main, job.shape, "stalled", "deadlocked")
    culprit_is(d, svc, worker, "the worker stuck in __getitem__")


def test_an_old_stall_is_dated_from_its_evidence() -> None:
    """The issue's case, scaled down: a hang older than the threshold, which is itself longer
    than the observation. Rank 0 waits in the rendezvous for a rank 1 that never comes; its
    last output (the READY line, on a pipe) is dated by the kernel, so ``--threshold 20
    --duration 5`` on a 25 s old hang says stalled, and counts the time without progress
    from the hang, not from when diagnose began."""
    with realsw.direct_job("rendezvous_peer_missing") as job:
        (line,) = job.ready_lines(1)
        began = time.monotonic()
        time.sleep(25)
        d = diagnose(line.get_int("pid"), threshold=20)
    svc = expect(d, line.get_int("pid"), job.shape, "stalled")
    # Dated beyond what the window saw
    assert svc["seconds_since_progress"] >= 20, d.explain("the hang's age is not dated")
    assert svc["seconds_since_progress"] <= time.monotonic() - began + 2, d.explain("too old")


def test_a_blocking_stack_dump_does_not_reset_the_stall() -> None:
    """A blocking dumper (py-spy dump, gdb) ptrace-stops every thread of the target while it
    reads: the threads leave their waits and come back, but do no work. The verdict stays
    stalled and the hang keeps its age."""
    with realsw.direct_job("rendezvous_peer_missing") as job:
        (line,) = job.ready_lines(1)
        pid = line.get_int("pid")
        began = time.monotonic()
        time.sleep(HANG_AGE)
        run = RunningDiagnose(diagnose_argv([pid], threshold=HANG_THRESHOLD))
        try:
            run.wait_stderr("watching", DIAGNOSE_TIMEOUT)
            time.sleep(1)
            realsw.ptrace_stop(pid, seconds=1.0)
            d = run.finish(timeout=DIAGNOSE_TIMEOUT)
        finally:
            run.kill()
    svc = expect(d, pid, job.shape, "stalled")
    age = time.monotonic() - began
    assert svc["seconds_since_progress"] >= HANG_AGE, d.explain(
        f"reset: the hang is {age:.0f} s old"
    )


# --- PyTorch: healthy --------------------------------------------------------------------


def test_compute_before_collective_is_progressing() -> None:
    with realsw.torchrun_job("compute_before_collective") as job:
        job.ranks(2)
        d = diagnose(job.pid)
    expect(d, job.pid, job.shape, "progressing")


def test_barrier_behind_compute_is_progressing() -> None:
    """Rank 0 waits in a barrier 2 s at a time while rank 1 computes."""
    with realsw.torchrun_job("barrier_behind_compute", "--compute-seconds", "2") as job:
        job.ranks(2)
        job.wait_for("STEP", timeout=30)  # the loop goes round: both passed a barrier
        d = diagnose(job.pid)
    expect(d, job.pid, job.shape, "progressing")


def test_training_loop_is_progressing() -> None:
    with realsw.torchrun_job("training_loop") as job:
        job.ranks(2)
        job.wait_for("STEP", timeout=30)
        d = diagnose(job.pid)
    expect(d, job.pid, job.shape, "progressing")


# --- the serving stack ---------------------------------------------------------------------
# Only where it tests what real SGLang cannot (tests/realsw/README.md): idle, serving and a
# native lock cycle in the scheduler are real SGLang's cases (test_sglang_verdicts.py).


def answers_counted(svc: dict[str, Any]) -> bool:
    """Whether a process of the service was seen answering clients in the window."""
    words = " ".join(str(r) for p in svc.get("processes", []) for r in p.get("reasons", []))
    return "of it answers to clients" in words


def test_serving_short_connections_is_progressing(tmp_path: Path) -> None:
    """~5 requests a second, each on a new connection with ``Connection: close``: the
    front-end's answers are written to fds closed long before the tick looks at them, and
    they are its only work but an access log line each. Answers, counted when written."""
    client = ["--mode", "close", "--interval", "0.2"]
    with serving_stack("serving", tmp_path, client=client) as st:
        assert st.client is not None
        st.client.wait_for("READY")
        st.client.wait_for("STATS")
        d = diagnose(st.pid)
    svc = expect(d, st.pid, "serving-close", "progressing")
    assert answers_counted(svc), d.explain("the front-end's answers were not counted")


def test_serving_loading_is_progressing(tmp_path: Path) -> None:
    """The scheduler receives its weights at 2 MiB/s over TCP, logging each MiB; the load
    lasts until the stack ends, after the diagnosis."""
    with weight_server(rate_mib=2) as ws:
        weights = f"tcp:127.0.0.1:{ws.info.get_int('port')}"
        with serving_stack("loading", tmp_path, server_args=["--weights", weights]) as st:
            d = diagnose(st.pid)
            done = "Load weight end" in st.log.read_text()
    assert not done, "the load ended during the diagnosis: the window is not a loading one"
    expect(d, st.pid, "loading", "progressing")


def test_serving_loading_quietly_is_progressing(tmp_path: Path) -> None:
    """The same load logging every 32 MiB (16 s): between its lines the scheduler writes
    nothing and uses little CPU; the data it receives from outside is its progress."""
    with weight_server(rate_mib=2) as ws:
        weights = f"tcp:127.0.0.1:{ws.info.get_int('port')}"
        args = ["--weights", weights, "--log-every-mib", "32"]
        with serving_stack("loading", tmp_path, server_args=args) as st:
            # the first MiB's line written: what the window sees next is the data received
            wait_until(lambda: "Loading weights:" in st.log.read_text(), HANG_S, "the first line")
            d = diagnose(st.pid)
            log = st.log.read_text()
    assert "Load weight end" not in log, "the load ended during the diagnosis"
    svc = expect(d, st.pid, "loading quietly", "progressing")
    kinds = {e["kind"] for p in svc["evidence"] if p["kind"] == "process_works" for e in p["facts"]}
    assert "received_in" in kinds, d.explain("progress must be the data received")


def test_serving_blocked_loop_is_stalled(tmp_path: Path) -> None:
    """uvicorn's event loop blocked on a lock held forever; clients fill the accept queue."""
    args, client = ["--backlog", "4"], ["--mode", "queue", "--connections", "8"]
    with serving_stack("blocked-loop", tmp_path, client=client, server_args=args) as st:
        d = diagnose_hang(st.pid, time.monotonic())
    svc = expect(d, st.pid, "blocked-loop", "stalled")
    culprit_is(d, svc, st.pid, "the front-end, whose event loop is blocked")


def test_serving_abba_is_stalled_not_idle(tmp_path: Path) -> None:
    """Two scheduler threads hold one threading.Lock each and wait for the other's; a request
    waits for its answer while the front-end answers /health. No owner is readable: stalled
    (the scheduler's zmq threads wait in epoll, so no proof without an owner), never idle.
    diagnose shows where: the scheduler's two acquiring lines, as a lock-cycle hint, and the
    front-end's loop with the request it owes; and it never stops or signals the stack."""
    with serving_stack("abba", tmp_path, client=["--mode", "once"]) as st:
        scheduler = st.info.get_int("scheduler")
        pids = [st.pid, scheduler, st.info.get_int("detokenizer")]
        with Untouched(pids) as watch:
            d = diagnose_hang(st.pid, time.monotonic())
    assert watch.touched is None, d.explain(f"diagnose touched the stack: {watch.touched}")
    svc = expect(d, st.pid, "abba", "stalled", "deadlocked")
    culprit_is(d, svc, scheduler, "the scheduler, its workers in a cycle")
    source = (REPO_ROOT / "tests/realsw/serving/scheduler.py").read_text().splitlines()
    acquiring = {
        n for n, text in enumerate(source, 1) if re.search(r"with self\.\w+_lock:  # held by", text)
    }
    assert len(acquiring) == 2, "scheduler.py: want the two acquiring lines"
    stacks = {p["pid"]: p.get("stacks") for p in svc["processes"]}
    hint = (stacks.get(scheduler) or {}).get("lock_hint") or []
    assert {h["line"] for h in hint} == acquiring, d.explain(
        f"want a lock hint at scheduler.py lines {sorted(acquiring)}, got {hint}"
    )
    front = stacks.get(st.pid) or {}
    assert any(g["tids"] == [st.pid] for g in front.get("groups", [])), d.explain(
        "want the front-end's event loop thread among its stacks"
    )
    assert svc["unanswered_requests"] >= 1, d.explain("want the request the front-end owes")


def test_serving_abba_retry_is_stalled(tmp_path: Path) -> None:
    """The same, and a client retrying on a new connection every second (each times out)."""
    client = ["--mode", "retry", "--timeout", "1"]
    with serving_stack("abba-retry", tmp_path, client=client) as st:
        d = diagnose_hang(st.pid, time.monotonic())
    svc = expect(d, st.pid, "abba-retry", "stalled", "deadlocked")
    culprit_is(d, svc, st.info.get_int("scheduler"), "the scheduler, its workers in a cycle")


def test_serving_fork_lock_is_stalled(tmp_path: Path) -> None:
    """A forked helper waits forever for a lock copied locked; the scheduler joins it 5 s at
    a time; the request waits."""
    with serving_stack("fork-lock", tmp_path, client=["--mode", "once"]) as st:
        d = diagnose_hang(st.pid, time.monotonic())
    svc = expect(d, st.pid, "fork-lock", "stalled", "deadlocked")
    culprit_is(d, svc, st.info.get_int("child"), "the helper waiting for a lock copied locked")


# --- the daemon ----------------------------------------------------------------------------


def targets_config(
    tmp_path: Path,
    targets: dict[str, str],
    interval: float = INTERVAL,
    threshold: float = THRESHOLD,
    status_socket: Path | None = None,
) -> tuple[Path, int]:
    """A config watching each ``name: cmdline regex`` of ``targets``; JSON is YAML (no
    escaping to get wrong). ``status_socket``: where the daemon serves `hangwatch status`
    (else the default path, which the first daemon to bind it keeps)."""
    port = free_port()
    cfg = tmp_path / "hangwatch.yaml"
    doc: dict[str, object] = {
        "listen": f"127.0.0.1:{port}",
        "interval_seconds": interval,
        "park_threshold_seconds": threshold,
        "targets": [{"name": n, "cmdline": c} for n, c in targets.items()],
    }
    if status_socket is not None:
        doc["status_socket"] = str(status_socket)
    cfg.write_text(json.dumps(doc))
    return cfg, port


def daemon_config(tmp_path: Path, name: str, cmdline: str) -> tuple[Path, int]:
    """A config watching one target by a cmdline regex."""
    return targets_config(tmp_path, {name: cmdline})


@pytest.fixture
def daemon_for(tmp_path: Path) -> Iterator[Callable[[str, str], Daemon]]:
    """Start a daemon (past its first tick) watching one target; stopped at teardown, where
    it must exit 0 and leave no BPF program behind (``running_daemon``)."""
    with contextlib.ExitStack() as stack:

        def start(name: str, cmdline: str) -> Daemon:
            cfg, port = daemon_config(tmp_path, name, cmdline)
            return stack.enter_context(running_daemon(cfg, port))

        yield start


def states_of(s: Samples, service: str, pid: int) -> list[str]:
    return [
        st
        for st in STATES
        if value(s, "hangwatch_service_state", service=service, pid=str(pid), state=st) == 1
    ]


def hold(daemon: Daemon, service: str, pid: int, state: str, seconds: float) -> None:
    """Scrape every INTERVAL for ``seconds``; every scrape must say ``state`` and only it."""
    seen: list[tuple[float, list[str]]] = []
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        s = daemon.scrape()
        if s is not None:
            seen.append((time.monotonic() - start, states_of(s, service, pid)))
        time.sleep(INTERVAL)
    changes = [ln for ln in daemon.output().splitlines() if f"service {service} pid" in ln]
    print("\n".join(changes))  # shown with -rA: the state changes and their reasons
    wrong = [(round(t, 1), st) for t, st in seen if st != [state]]
    assert len(seen) >= MIN_SCRAPES, f"only {len(seen)} scrapes answered"
    assert not wrong, (
        f"service {service} pid {pid}: want {state} in every scrape for {seconds} s; "
        f"{len(wrong)} of {len(seen)} scrapes said otherwise: {wrong}\n"
        f"daemon log (state changes with their reasons):\n{daemon.output()}"
    )


def test_daemon_allreduce_peer_gone_stays_stalled(daemon_for: Callable[[str, str], Daemon]) -> None:
    with realsw.torchrun_job("allreduce_peer_gone") as job:
        waiter = job.ranks(2)[0].get_int("pid")
        wait_until(
            lambda: realsw.main_thread_in(waiter, SYS_FUTEX), 10, "rank 0 parked in all_reduce"
        )
        # torchrun's own command line (the ranks' lacks "torchrun" and the port).
        d = daemon_for("torch", rf"bin/torchrun .*--master_port={job.port}\b")
        daemonlib.wait_until(
            d,
            lambda s: states_of(s, "torch", job.pid) == ["stalled"],
            f"the torchrun service {job.pid} to be stalled",
            timeout=20,
        )
        hold(d, "torch", job.pid, "stalled", HOLD_S)
        assert job.proc is not None and job.proc.poll() is None, job.describe("torchrun exited")


def daemon_holds_serving(
    tmp_path: Path,
    daemon_for: Callable[[str, str], Daemon],
    shape: str,
    state: str,
    client: Sequence[str] = (),
) -> None:
    """The serving stack in ``shape`` (with ``client`` if given) reaches ``state`` in the
    daemon, and every scrape says it for HOLD_S."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with serving_stack(shape, run_dir, client=client) as st:
        if st.client is not None:
            st.client.wait_for("STATS")
        # The root's command line only: the spawned children run multiprocessing's.
        regex = rf"serving\.server --shape {shape} .*{re.escape(str(run_dir))}"
        d = daemon_for("serving", regex)
        daemonlib.wait_until(
            d,
            lambda s: states_of(s, "serving", st.pid) == [state],
            f"the serving stack {st.pid} to be {state}",
            timeout=20,
        )
        hold(d, "serving", st.pid, state, HOLD_S)


def test_daemon_serving_idle_stays_idle(
    tmp_path: Path, daemon_for: Callable[[str, str], Daemon]
) -> None:
    daemon_holds_serving(tmp_path, daemon_for, "idle", "idle")


def test_daemon_serving_short_connections_stays_progressing(
    tmp_path: Path, daemon_for: Callable[[str, str], Daemon]
) -> None:
    """The daemon's view of test_serving_short_connections_is_progressing: each answer goes
    out on a connection closed before the tick, and every scrape says progressing."""
    client = ["--mode", "close", "--interval", "0.2"]
    daemon_holds_serving(tmp_path, daemon_for, "serving", "progressing", client)
