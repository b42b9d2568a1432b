"""The daemon end to end: real BPF, real fixtures, real scrapes of /metrics.

A daemon started before the fixtures, watching them by cmdline selectors, must export the
right state for each within a few intervals, and leave no BPF program behind on SIGTERM.
"""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agent import __version__
from scripts.bpfobjs import leaked, prog_ids
from scripts.fixturelib import REPO_ROOT, Fixture
from tests.privileged.daemonlib import (
    INTERVAL,
    Daemon,
    Samples,
    free_port,
    pids_in,
    running_daemon,
    value,
    wait_for_log,
    wait_until,
)
from tests.privileged.harness import line_of

# serial: its daemon selects fixture programs by name, so it would watch other tests' copies too
pytestmark = pytest.mark.serial

THRESHOLD = 2
CONFIG = f"""
listen: "127.0.0.1:{{port}}"
interval_seconds: {INTERVAL}
park_threshold_seconds: {THRESHOLD}
targets:
  - name: mutex-cycle
    cmdline: "fixtures/build/deadlock_mutex"
  - name: pi-cycle
    cmdline: "fixtures/build/pi_deadlock"
  - name: pool
    cmdline: "fixtures/build/condvar_pool"
  - name: loader
    cmdline: "fixtures/loader\\\\.py"
  - name: pylocks
    cmdline: "fixtures/pylocks\\\\.py"
  - name: fork-locked
    cmdline: "fixtures/fork_locked\\\\.py"
"""


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    port = free_port()
    cfg = tmp_path / "hangwatch.yaml"
    cfg.write_text(CONFIG.format(port=port))
    with running_daemon(cfg, port) as d:
        yield d


def state_is(service: str, state: str) -> Callable[[Samples], bool]:
    return lambda s: value(s, "hangwatch_service_state", service=service, state=state) == 1


def test_daemon_reports_each_fixture_and_detaches_on_sigterm(
    daemon: Daemon, tmp_path: Path
) -> None:
    log = tmp_path / "loader.log"
    with (
        Fixture.c("deadlock_mutex") as mutex,
        Fixture.c("pi_deadlock", "--wait-for-go", ready="HOLDING") as pi,
        Fixture.c("condvar_pool", "8") as pool,
        Fixture.py(
            "loader", "--until-go", "--port", free_port(), "--log", log, ready="LOADING"
        ) as loader,
    ):
        # Discovery must pick the new PI process up before it locks, so the EDEADLK is seen.
        wait_until(
            daemon,
            lambda s: value(s, "hangwatch_process_threads", pid=str(pi.pid)) is not None,
            "the PI fixture to be watched",
        )
        pi.send("go")
        pi.wait_for("READY")

        s = wait_until(daemon, state_is("mutex-cycle", "deadlocked"), "the mutex cycle")
        assert value(s, "hangwatch_process_lock_cycles", pid=str(mutex.pid)) == 1
        assert value(s, "hangwatch_service_state", service="mutex-cycle", state="stalled") == 0

        wait_until(daemon, state_is("pi-cycle", "deadlocked"), "the PI cycle")

        s = wait_until(daemon, state_is("pool", "stalled"), "the parked pool to stall")
        pid = str(pool.pid)
        threads = value(s, "hangwatch_process_threads", pid=pid)
        assert threads == 9 and value(s, "hangwatch_process_parked_threads", pid=pid) == threads
        # Stalled once the time without progress passes the threshold; that time may be dated
        # from before the daemon looked (agent/analysis/last_progress.py), so the pool's own park time, which
        # counts from when the daemon first saw it, can still be just under it.
        parked = value(s, "hangwatch_process_parked_seconds", pid=pid)
        assert parked is not None and parked > 0
        quiet = value(s, "hangwatch_service_seconds_since_progress", service="pool", pid=pid)
        assert quiet is not None and quiet >= THRESHOLD

        # The loader loads until told: its writes are counted first, however late discovery
        # found it (they count only once it is watched).
        wait_until(
            daemon,
            lambda s: (
                (value(s, "hangwatch_process_write_bytes_total", pid=str(loader.pid)) or 0) > 0
            ),
            "the loader's log writes to be counted",
        )
        loader.send("go")
        s = wait_until(daemon, state_is("loader", "idle"), "the loader to finish and listen")
        pid = str(loader.pid)
        assert (value(s, "hangwatch_process_listening_ports", pid=pid) or 0) >= 1
        written = value(s, "hangwatch_process_write_bytes_total", pid=pid)
        assert written is not None and written > 0, "the loader's log writes were not counted"

        # No TID label anywhere, whatever the exposition holds.
        assert not any("tid" in dict(ls) for (_, ls) in s)
        # BPF run-time accounting costs every program on the host: off unless configured.
        assert not any(name == "hangwatch_bpf_program_runs_total" for (name, _) in s)

    # Exited fixtures disappear from the metrics within a few intervals.
    gone = {str(p.pid) for p in (mutex, pi, pool, loader)}
    wait_until(
        daemon,
        lambda s: not any(dict(ls).get("pid") in gone for (_, ls) in s),
        "exited fixtures to leave the metrics",
    )
    log = daemon.output()
    assert "service mutex-cycle pid" in log and "-> deadlocked" in log, log
    # The loader's verdict carries the evidence the probes gathered: when its port began
    # listening (a bind to port 0, resolved from /proc) and where its last write went.
    idle = next(line for line in log.splitlines() if "service loader" in line and "-> idle" in line)
    assert re.search(r"port \d+ listening since \d\d:\d\d:\d\d", idle), idle
    assert re.search(r"last write \d+ s ago, to /\S+ \(pid \d+\)", idle), idle


# --- bad input changes nothing; SIGHUP reloads or keeps the old config ----------------------


def run_daemon(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agent", "run", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_bad_config_exits_2_naming_the_key_and_attaches_nothing(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("targets:\n  - name: a\n    cmdline: 'sglang('\n")
    before = prog_ids()
    r = run_daemon("--config", str(cfg))
    assert r.returncode == 2, r.stderr
    assert "targets[0].cmdline" in r.stderr and "sglang(" in r.stderr, r.stderr
    # The journal's first line names the build that ran (daemon.run); the error is one line.
    build, *rest = r.stderr.strip().splitlines()
    assert f" INFO hangwatch {__version__} (commit " in build, r.stderr
    assert len(rest) == 1 and rest[0].startswith("hangwatch: config "), r.stderr
    assert not leaked(prog_ids() - before, grace_s=3)


def test_listen_address_in_use_exits_2_and_attaches_nothing() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        before = prog_ids()
        r = run_daemon("--listen", f"127.0.0.1:{port}")
    assert r.returncode == 2, r.stderr
    assert f"listen 127.0.0.1:{port}" in r.stderr and "in use" in r.stderr, r.stderr
    assert not leaked(prog_ids() - before, grace_s=3)


def test_bad_listen_flag_exits_2() -> None:
    r = run_daemon("--listen", "nowhere")
    assert r.returncode == 2 and "--listen" in r.stderr and "nowhere" in r.stderr, r.stderr


def test_sighup_keeps_the_old_config_when_the_new_one_is_bad(
    daemon: Daemon, tmp_path: Path
) -> None:
    cfg = tmp_path / "hangwatch.yaml"
    good = cfg.read_text()
    cfg.write_text(good + "  - name: broken\n    cmdline: '('\n")
    daemon.proc.send_signal(signal.SIGHUP)
    wait_for_log(daemon, "reload failed, keeping the running config", "the failed reload")
    assert f"targets[{CONFIG.count('- name:')}].cmdline" in daemon.output()  # the one appended
    # Still serving, with the old targets: a new pool is picked up by the old selector.
    with Fixture.c("condvar_pool", "2") as pool:
        wait_until(
            daemon,
            lambda s: value(s, "hangwatch_process_threads", pid=str(pool.pid)) == 3,
            "the old config to keep working",
        )
    # A good new config is taken: a new target name appears for a new process.
    cfg.write_text(good + "  - name: busy\n    cmdline: 'fixtures/build/busy'\n")
    daemon.proc.send_signal(signal.SIGHUP)
    with Fixture.c("busy", "1") as busy:
        wait_until(daemon, state_is("busy", "progressing"), "the reloaded config's new target")
        assert str(busy.pid)
    assert "reloaded" in daemon.output()


def test_gpu_target_on_a_host_without_nvml(tmp_path: Path) -> None:
    """No GPU here: the daemon serves on, says so once, and exports the GPU collector failed."""
    port = free_port()
    cfg = tmp_path / "gpu.yaml"
    cfg.write_text(
        f'listen: "127.0.0.1:{port}"\ninterval_seconds: {INTERVAL}\n'
        "targets:\n  - name: any-gpu\n    gpu: true\n"
    )
    d = Daemon(cfg, port)
    try:
        s = wait_until(
            d,
            lambda s: value(s, "hangwatch_collector_success", collector="gpu") == 0,
            "the GPU collector to report failure",
        )
        assert value(s, "hangwatch_collector_success", collector="proc") == 1
        time.sleep(6 * INTERVAL)  # several more ticks: still one line about NVML
        assert d.scrape() is not None
    finally:
        rc = d.stop()
    log = d.output()
    assert rc == 0, log
    assert log.count("NVML not available") == 1, log


def last_tick(s: Samples) -> float:
    return value(s, "hangwatch_last_tick_timestamp_seconds") or 0.0


CHANGES = {
    # how: (the fixture and its arguments, the target's selector, what it prints once changed)
    "exec": (("exec_launcher",), 'cmdline: "exec_launcher\\\\.py --target"', "TARGET"),
    "rename": (("renamer", "hw-renamed"), 'comm: "hw-renamed"', "RENAMED"),
}


@pytest.mark.parametrize("how", sorted(CHANGES))
def test_a_process_seen_before_it_becomes_the_target_is_watched(tmp_path: Path, how: str) -> None:
    """A process the daemon has read, and, told of every exec and rename, reads no more, then
    becomes the target: a launcher (python) that execs it (python again: the same comm and
    PID), or a process that renames itself to the target's comm without an exec. Only the
    probe's exec or rename event tells discovery to read it again."""
    fixture, selector, changed = CHANGES[how]
    port = free_port()
    cfg = tmp_path / "change.yaml"
    cfg.write_text(
        f'listen: "127.0.0.1:{port}"\ninterval_seconds: {INTERVAL}\n'
        f"targets:\n  - name: changed\n    {selector}\n"
    )
    with running_daemon(cfg, port) as d, Fixture.py(*fixture, ready="STARTED") as fx:
        # A tick that ended after the process started, then a later one: that one's discovery
        # began after the first ended, so it has read the process as it was.
        started = time.time()
        s = wait_until(d, lambda s: last_tick(s) > started, "a tick after the process started")
        after = last_tick(s)
        s = wait_until(d, lambda s: last_tick(s) > after, "the tick after that")
        assert fx.pid not in pids_in(s), "the process matched before it changed"
        fx.send("go")
        fx.wait_for(changed)
        wait_until(
            d,
            lambda s: (
                value(s, "hangwatch_process_threads", pid=str(fx.pid), service="changed")
                is not None
            ),
            f"the changed process {fx.pid} ({how}) to be watched",
        )


@pytest.mark.parametrize("name", ["pylocks", "fork-locked"])
def test_daemon_proves_a_python_hang_without_an_owner(daemon: Daemon, name: str) -> None:
    """A Python two-lock cycle with the main thread joining, and a child forked while a lock
    was held: deadlocked by the proof without an owner (two reads; the threshold alone makes
    a service stalled, never deadlocked), with the process with no waker as the culprit in the
    state-change log."""
    fixture = name.replace("-", "_")
    taking = ".acquire()" if name == "pylocks" else "with lock:  # a copy"
    at = f"({fixture}.py:{line_of(f'tests/fixtures/{fixture}.py', taking)})"
    with Fixture.py(fixture) as fx:
        formed = time.monotonic()
        wait_until(daemon, state_is(name, "deadlocked"), f"{name} to be deadlocked")
        took = time.monotonic() - formed
        culprit = fx.info.get_int("child") if name == "fork-locked" else fx.pid
        # The change's line and its flight record (the Python stacks at the change, with the
        # line that takes the lock) are written beside the loop, once the stacks are read:
        # a moment after /metrics says deadlocked, and while the fixture lives.
        wait_for_log(daemon, re.escape(at), f"the flight record's stack line at {at}")
    print(f"{name}: deadlocked {took:.2f} s after READY (interval {INTERVAL} s)")  # -rA
    log = daemon.output()
    assert f"held up by process {culprit}" in log, log
    stack_lines = [ln for ln in log.splitlines() if at in ln and "thread" in ln]
    assert stack_lines, f"no stack line at {at} in the daemon's log:\n{log}"
    if name == "pylocks":
        assert any("a Python lock cycle?" in ln for ln in stack_lines), log
