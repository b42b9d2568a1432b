"""End to end: ``python -m agent diagnose`` gives each fixture the verdict it deserves.

Each test starts a fixture (tests/fixtures, checked by tests/host/test_fixtures.py), runs the real
tool against it with ``--json --threshold 1 --duration 2`` and checks the state from the
JSON contract (README, `hangwatch diagnose`). Failures print the whole JSON report and the tool's stderr.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from scripts.daemonproc import free_port
from scripts.fixturelib import REPO_ROOT, Fixture, tasks
from tests.limits import HANG_S
from tests.privileged import harness
from tests.privileged.harness import DIAGNOSE_LIMIT_S, Diagnosis, RunningDiagnose, diagnose_argv

Diagnose = Callable[..., Diagnosis]
StartDiagnose = Callable[..., RunningDiagnose]

ATTACH_TIMEOUT_S = DIAGNOSE_LIMIT_S  # BPF compile and load included: see the harness


def verdict(d: Diagnosis, pid: int, *states: str) -> dict[str, Any]:
    """The service rooted at ``pid``, asserted to be in one of ``states``."""
    svc = d.service(pid)
    assert svc.get("state") in states, d.explain(f"service {pid}: want {' or '.join(states)}")
    return svc


def cycles_of(d: Diagnosis, svc: dict[str, Any]) -> list[set[int]]:
    cycles = svc.get("cycles")
    assert isinstance(cycles, list), d.explain("'cycles' is not a list")
    return [set(c) for c in cycles]


# --- deadlocks: a cycle of owned locks ----------------------------------------------------


@pytest.mark.parametrize("busy", [False, True], ids=["plain", "busy-thread"])
def test_deadlock_mutex(diagnose: Diagnose, busy: bool) -> None:
    with Fixture.c("deadlock_mutex", *(["--busy"] if busy else [])) as fx:
        d = diagnose(fx.pid)
    svc = verdict(d, fx.pid, "deadlocked")
    want = set(fx.info.get_ints("tids"))
    if busy:
        assert want in cycles_of(d, svc), d.explain(f"want a cycle of {want}")
    else:
        assert cycles_of(d, svc) == [want], d.explain(f"want exactly one cycle, of {want}")


def test_ring_mutex(diagnose: Diagnose) -> None:
    with Fixture.c("ring_mutex", "3") as fx:
        d = diagnose(fx.pid)
    svc = verdict(d, fx.pid, "deadlocked")
    want = set(fx.info.get_ints("tids"))
    assert want in cycles_of(d, svc), d.explain(f"want a cycle of the 3 ring threads {want}")


def test_pshared_deadlock_crosses_processes(diagnose: Diagnose) -> None:
    with Fixture.c("pshared_deadlock") as fx:
        parent, child = fx.pid, fx.info.get_int("child")
        parent_tids, child_tids = set(tasks(parent)), set(tasks(child))
        d = diagnose(parent)
    svc = verdict(d, parent, "deadlocked")
    crossing = [c for c in cycles_of(d, svc) if len(c & parent_tids) == 1 == len(c & child_tids)]
    assert crossing, d.explain(
        f"want a cycle with one TID of parent {parent} {sorted(parent_tids)} "
        f"and one of child {child} {sorted(child_tids)}"
    )


def test_pi_deadlock_formed_while_watched(start_diagnose: StartDiagnose) -> None:
    """The kernel refuses the PI lock that closes the cycle (EDEADLK) while the probe is on."""
    with Fixture.c("pi_deadlock", "--wait-for-go", ready="HOLDING") as fx:
        run = start_diagnose(fx.pid, duration=6)
        run.wait_stderr(r"\battached\b", timeout=ATTACH_TIMEOUT_S)
        fx.send("go")
        fx.wait_for("READY")
        d = run.finish()
    svc = verdict(d, fx.pid, "deadlocked")
    tids = set(fx.info.get_ints("tids"))
    cycles = cycles_of(d, svc)
    assert cycles and all(c <= tids for c in cycles), d.explain(f"want cycles within {tids}")
    assert "pi-refused" in {e["kind"] for e in svc["edges"]}, d.explain("want a pi-refused edge")
    # The refusal also came through the ring buffer, decoded from the shared header.
    probe = d.report["probe"] if d.report else {}
    refused = {r["tid"] for r in probe.get("edeadlk", [])}
    assert refused and refused <= tids, d.explain(f"want EDEADLK events for threads of {tids}")
    assert probe["counters"]["events_dropped"] == 0, d.explain("no ring-buffer drops expected")


def test_pi_deadlock_formed_before_attach(diagnose: Diagnose) -> None:
    """The EDEADLK was missed: the parked thread's dummy word has no owner to follow, so no
    cycle can be drawn. Every thread (the two lockers, the main thread joining) waits with no
    timeout on a private word: proven to have no waker, deadlocked without a cycle."""
    with Fixture.c("pi_deadlock") as fx:
        d = diagnose(fx.pid)
    svc = verdict(d, fx.pid, "deadlocked")
    tids = set(fx.info.get_ints("tids"))
    cycles = cycles_of(d, svc)
    assert all(c <= tids for c in cycles), d.explain(f"want cycles within {tids}")
    kinds = {e["kind"] for e in svc["evidence"]}
    assert cycles or "no_waker" in kinds, d.explain("deadlocked with neither cycle nor proof")


# --- parked without an owner: stalled, never a guessed cycle -------------------------------


def test_condvar_pool_is_stalled(diagnose: Diagnose) -> None:
    with Fixture.c("condvar_pool", "8") as fx:
        d = diagnose(fx.pid)
    svc = verdict(d, fx.pid, "stalled")
    assert svc["cycles"] == [], d.explain("a condvar has no owner: want no cycles")
    proc = d.process(svc, fx.pid)
    assert proc.get("threads") == proc.get("parked_threads") == 9, d.explain(
        "want threads == parked_threads == 9 (8 workers and the joining main thread)"
    )


def test_barrier_with_a_computing_rank_is_progressing(diagnose: Diagnose) -> None:
    with Fixture.c("barrier_ranks", "4") as fx:
        d = diagnose(fx.pid)
    verdict(d, fx.pid, "progressing")


def test_barrier_with_a_rank_with_no_waker_is_deadlocked_without_a_cycle(
    diagnose: Diagnose,
) -> None:
    """The last rank waits on a private condvar nobody can signal (its only thread): proven
    to have no waker, so deadlocked at once, held up by it. The others wait on a shared barrier, which
    has no owner: no cycle is drawn."""
    with Fixture.c("barrier_ranks", "4", "--last-rank-parks") as fx:
        d = diagnose(fx.pid)
    svc = verdict(d, fx.pid, "deadlocked")
    assert svc["cycles"] == [], d.explain("a barrier has no owner: want no cycles")
    last = fx.info.get_int("last")
    assert (svc.get("culprit") or {}).get("pid") == last, d.explain(f"want the last rank {last}")


def test_python_lock_deadlock_is_never_a_wrong_cycle(diagnose: Diagnose) -> None:
    """threading.Lock has no visible owner: stalled, or a cycle of exactly those threads."""
    with Fixture.py("pylocks") as fx:
        d = diagnose(fx.pid)
    svc = verdict(d, fx.pid, "stalled", "deadlocked")
    tids = set(fx.info.get_ints("tids"))
    cycles = cycles_of(d, svc)
    if svc["state"] == "stalled":
        assert cycles == [], d.explain("stalled with cycles")
    else:  # deadlocked: proven without an owner (no cycle drawn), or a cycle of those threads
        assert all(c <= tids for c in cycles), d.explain(f"want cycles within {tids}")


def test_python_lock_cycle_with_main_joining_is_proven_deadlocked(diagnose: Diagnose) -> None:
    """Every thread (two lockers, the main thread joining them) waits with no timeout on a
    process-private futex: no thread can wake another, so deadlocked, with no owner known."""
    with Fixture.py("pylocks") as fx:
        d = diagnose(fx.pid)
    svc = verdict(d, fx.pid, "deadlocked")
    kinds = [e["kind"] for e in svc["evidence"]]
    assert "no_waker" in kinds, d.explain(f"want the proof without an owner, got {kinds}")
    assert (svc.get("culprit") or {}).get("pid") == fx.pid, d.explain("the culprit")
    # Where: both lock threads at the line that takes their second lock, named as a hint.
    line = line_of("pylocks", ".acquire()")
    stacks = d.process(svc, fx.pid)["stacks"] or {}
    hint = stacks.get("lock_hint") or []
    assert {(h["tid"], h["line"]) for h in hint} == {(t, line) for t in tids_of(fx)}, d.explain(
        f"want both lock threads at pylocks.py:{line} in the lock hint"
    )


def test_a_child_forked_with_a_lock_held_is_proven_deadlocked(diagnose: Diagnose) -> None:
    """The child waits for a lock whose holder it does not have; the parent waits for the
    child in wait4. The child has no waker, so the service is deadlocked, held up by it."""
    with Fixture.py("fork_locked") as fx:
        child = fx.info.get_int("child")
        d = diagnose(fx.pid)
    svc = verdict(d, fx.pid, "deadlocked")
    assert (svc.get("culprit") or {}).get("pid") == child, d.explain("the child is the culprit")
    line = line_of("fork_locked", "with lock:  # a copy")
    groups = (d.process(svc, child)["stacks"] or {}).get("groups") or []
    assert [g["frames"][0]["line"] for g in groups] == [line], d.explain(
        f"want the child's one thread at fork_locked.py:{line}, where it takes the lock"
    )


def line_of(fixture: str, text: str) -> int:
    """The line of a Python fixture's source that holds ``text`` (first match)."""
    return harness.line_of(f"tests/fixtures/{fixture}.py", text)


def tids_of(fx: Fixture) -> set[int]:
    return set(fx.info.get_ints("tids"))


def test_a_python_pool_of_2000_threads_is_grouped_and_never_without_a_waker(
    diagnose: Diagnose,
) -> None:
    """2,000 workers in Queue.get and an I/O thread in select: one group at the worker's
    line, no lock hint (each waits on a condition of its own, inside the standard library),
    never deadlocked (the I/O thread can be woken from outside). The time it took is printed
    (-rA) for the record; the benchmark measures it."""
    n = 2000
    with Fixture.py("py_pool", str(n), timeout=HANG_S) as fx:
        d = diagnose(fx.pid, duration=3)
    svc = verdict(d, fx.pid, "stalled", "idle", "progressing")
    stacks = d.process(svc, fx.pid)["stacks"] or {}
    groups = stacks.get("groups") or []
    line = line_of("py_pool", "job = jobs.get()")
    pool = [g for g in groups if any(f["line"] == line for f in g["frames"])]
    assert [len(g["tids"]) for g in pool] == [n], d.explain(f"want one group of {n} workers")
    assert stacks.get("lock_hint") == [], d.explain("a pool waiting for work is no lock cycle")
    print(
        f"py_pool {n}: diagnose --duration 3 took {d.seconds:.1f} s, stacks {stacks['seconds']} s"
    )


# --- progress and idleness -------------------------------------------------------------------


def test_busy_is_progressing(diagnose: Diagnose) -> None:
    with Fixture.c("busy", "2") as fx:
        d = diagnose(fx.pid)
    verdict(d, fx.pid, "progressing")


def test_idle_http_server_is_idle(diagnose: Diagnose) -> None:
    """Its accept loop wakes twice a second and does no work: idle, not progressing."""
    with Fixture.py("idle_http", "--port", free_port()) as fx:
        time.sleep(1)
        d = diagnose(fx.pid)
    verdict(d, fx.pid, "idle")


@pytest.mark.parametrize("flags", [(), ("--sleep-on-idle",)], ids=["spinning", "sleeping"])
def test_a_poll_loop_at_an_idle_front_door_is_idle(diagnose: Diagnose, flags: tuple[str]) -> None:
    """CPU that serves no one is not progress: a loop polling its sockets without sleeping,
    a whole CPU's worth, with nothing at its front door, is idle; as is the same loop
    sleeping in poll while idle."""
    with Fixture.c("poll_loop", "--port", free_port(), *flags) as fx:
        d = diagnose(fx.pid)
    svc = verdict(d, fx.pid, "idle")
    spun = [r for r in svc.get("reasons", []) if "spun" in r]
    if flags:
        assert not spun, d.explain("a loop parked in poll does not spin")
    else:
        assert spun and "CPU that serves no one" in spun[0], d.explain("no spin in the reasons")


def test_a_poll_loop_computing_for_a_request_is_progressing(diagnose: Diagnose) -> None:
    """The same loop with a request in hand computes for it between its polls: where a
    request waits, the CPU may be serving it, and here it is."""
    port = free_port()
    with (
        Fixture.c("poll_loop", "--port", port, "--compute-ms", "600000") as fx,
        socket.create_connection(("127.0.0.1", port), timeout=5) as c,
    ):
        c.sendall(b"GET /\n")
        time.sleep(0.5)
        d = diagnose(fx.pid)
    svc = verdict(d, fx.pid, "progressing")
    assert any("used CPU" in r for r in svc.get("reasons", [])), d.explain("not by its CPU")


def test_a_poll_loop_with_no_front_door_is_progressing(diagnose: Diagnose) -> None:
    """With no front door no client can be waiting for it: its CPU is the job's own work,
    and nothing says it serves no one."""
    with Fixture.c("poll_loop", "--no-listen") as fx:
        d = diagnose(fx.pid)
    verdict(d, fx.pid, "progressing")


def test_loader_progresses_then_idles(diagnose: Diagnose, tmp_path: Path) -> None:
    log = tmp_path / "load.log"
    # It loads until told: diagnose's start-up (a BPF compile) can take any time.
    with Fixture.py(
        "loader", "--until-go", "--log", log, "--port", free_port(), ready="LOADING"
    ) as fx:
        loading = diagnose(fx.pid)
        verdict(loading, fx.pid, "progressing")

        fx.send("go")
        fx.wait_for("LISTENING")
        time.sleep(1.5)
        listening = diagnose(fx.pid)
    verdict(listening, fx.pid, "idle")


# --- the target goes away, bad input ---------------------------------------------------------


def test_target_exits_while_watched(start_diagnose: StartDiagnose) -> None:
    # --wait-for-go: the 2 s countdown starts once diagnose is attached, so the target
    # is alive when diagnose checks its PID and gone before the 4 s window ends.
    with Fixture.c("exits_soon", "2", "--wait-for-go") as fx:
        run = start_diagnose(fx.pid, duration=4)
        run.wait_stderr(r"\battached\b", timeout=ATTACH_TIMEOUT_S)
        fx.send("go")
        d = run.finish()
        assert fx.wait_exit(timeout=5) == 0
    svc = d.service(fx.pid)
    words = [*svc.get("reasons", [])]
    for p in svc.get("processes", []):
        words += p.get("reasons", [])
    gone = re.compile(r"gone|exit|no longer|vanish|disappear|terminat|died", re.IGNORECASE)
    assert any(gone.search(str(r)) for r in words), d.explain("no reason says the target is gone")


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agent", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=HANG_S,
        check=False,
    )


def free_pid() -> int:
    """A PID that no process has: that of a child we just reaped."""
    child = subprocess.Popen(["true"])
    child.wait()
    assert not os.path.exists(f"/proc/{child.pid}")
    return child.pid


def test_missing_pid_is_a_usage_error() -> None:
    pid = free_pid()
    argv = diagnose_argv([pid])
    r = run_cli(*argv[3:])
    msg = f"{argv}\nexit {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    assert r.returncode == 2, msg
    assert re.search(rf"\b{pid}\b", r.stderr), msg
    assert "Traceback" not in r.stderr, msg


def test_negative_threshold_is_a_usage_error() -> None:
    argv = diagnose_argv([os.getpid()], threshold=-1)
    r = run_cli(*argv[3:])
    msg = f"{argv}\nexit {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    assert r.returncode == 2, msg
    assert "threshold" in r.stderr, msg
    assert "Traceback" not in r.stderr, msg


# --- missing privilege or kernel feature: exit 3, naming it ------------------------------


def test_without_capabilities_exit_3_names_them() -> None:
    """Run as nobody with no capabilities: the error says which are missing and how to fix it."""
    with Fixture.c("condvar_pool", "2") as fx:
        argv = diagnose_argv([fx.pid])
        drop = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all"]
        r = subprocess.run(
            [*drop, *argv],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=HANG_S,
            check=False,
        )
    msg = f"{argv}\nexit {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    assert r.returncode == 3, msg
    assert "CAP_BPF" in r.stderr and "CAP_SYS_PTRACE" in r.stderr, msg
    assert "root" in r.stderr, msg
    assert "Traceback" not in r.stderr, msg


def test_missing_kernel_headers_exit_3_names_them() -> None:
    with Fixture.c("condvar_pool", "2") as fx:
        argv = diagnose_argv([fx.pid])
        env = {**os.environ, "BCC_KERNEL_SOURCE": "/nonexistent/headers"}
        r = subprocess.run(
            argv,
            cwd=REPO_ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=HANG_S,
            check=False,
        )
    msg = f"{argv}\nexit {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    assert r.returncode == 3, msg
    assert "kernel headers" in r.stderr and "/nonexistent/headers" in r.stderr, msg


def test_kernel_without_btf_is_refused(tmp_path) -> None:
    from agent.errors import KernelFeatureError
    from agent.preflight import check

    with pytest.raises(KernelFeatureError, match="BTF") as e:
        check(btf_path=str(tmp_path / "vmlinux"))
    assert e.value.exit_code == 3


def test_thread_id_instead_of_pid_is_a_usage_error() -> None:
    with Fixture.c("condvar_pool", "2") as fx:
        tid = fx.info.get_ints("tids")[0]
        argv = diagnose_argv([tid])
        r = run_cli(*argv[3:])
    msg = f"{argv}\nexit {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    assert r.returncode == 2, msg
    assert f"--pid {tid} is a thread of process {fx.pid}" in r.stderr, msg


def test_diagnose_says_why_there_is_no_gpu_section(diagnose: Diagnose) -> None:
    with Fixture.c("busy", "1") as fx:
        d = diagnose(fx.pid)
    d.service(fx.pid)  # a clean run
    gpu = d.report["gpu"] if d.report else {}
    assert gpu.get("ok") is False and "NVML not available" in (gpu.get("error") or ""), d.explain(
        "no GPU here: want the reason in the gpu section"
    )


# --- the report in words ---------------------------------------------------------------------


def diagnose_text(pid: int, duration: float = 2) -> Diagnosis:
    run = RunningDiagnose(diagnose_argv([pid], threshold=5, duration=duration, json_out=False))
    try:
        return run.finish(60)
    finally:
        run.kill()


def test_the_text_report_shows_python_threads_by_their_lines() -> None:
    """A Python process is told by its stacks: the lock threads at the line that takes the
    second lock, the hint naming it, the main thread at its join; raw futex words with no
    owner give way to them."""
    with Fixture.py("pylocks") as fx:
        d = diagnose_text(fx.pid)
    out = d.stdout
    line = line_of("pylocks", ".acquire()")
    assert d.returncode == 0, d.explain("diagnose failed")
    assert "Python stacks (read in" in out and "without stopping it" in out, d.explain("stacks")
    assert re.search(
        rf"2 threads at `locks\[1 - i\]\.acquire\(\).*` \(pylocks\.py:{line}\) in "
        r"`main\.<locals>\.worker`, in futex \w+ with no timeout",
        out,
    ), d.explain("want both lock threads at their acquiring line")
    assert f"(pylocks.py:{line}) on 2 lock words" in out, d.explain("want the lock hint")
    assert "`Thread.join`" in out, d.explain("want the main thread at its join")
    assert "parked on one word" not in out, d.explain("ownerless words give way to stacks")


def test_the_text_report_names_native_lock_words_by_symbol() -> None:
    """A C mutex cycle: each lock word by the symbol that holds it in the executable."""
    with Fixture.c("deadlock_mutex") as fx:
        d = diagnose_text(fx.pid)
    out = d.stdout
    assert d.returncode == 0, d.explain("diagnose failed")
    assert "DEADLOCKED" in out, d.explain("want deadlocked")
    named = re.findall(
        r"waits for mutex 0x[0-9a-f]+ \(`locks` in deadlock_mutex\+0x[0-9a-f]+\)", out
    )
    assert len(named) == 2, d.explain("want both links of the cycle named `locks`")
    assert "Python stacks" not in out, d.explain("a C program has no Python stacks")
