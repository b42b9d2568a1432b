"""No flapping: one daemon watching three real-software services at once must, once each has
reached its state, say that state and only it in every scrape for two minutes.

The three, started side by side and watched as three targets of one config:

- ``torch``: a torchrun ``allreduce_peer_gone`` job (truth: stalled);
- ``abba``: the serving stack in shape ``abba``, one request waiting (truth: stalled;
  deadlocked is accepted too, but whichever it reaches first must then hold);
- ``idle``: the serving stack in shape ``idle`` (truth: idle).

The daemon runs at its own pace (``interval_seconds: 1``, ``park_threshold_seconds: 10``),
not the fast one of ``test_verdicts.py``. Every scrape after a service first reached its state
counts, the ones while waiting for the others included; and the daemon's log, which has a line
for every state change of every service (scraped or not), must have none for the three after
all of them got there. The state changes are printed (``-rA``), and shown on failure.

Needs root and bcc (as ``tests/privileged``) besides the real-software venv: skipped locally
without them, failed under ``CI=true``.
"""

from __future__ import annotations

import contextlib
import re
import time
from pathlib import Path

import pytest

from scripts import realsw
from scripts.fixturelib import wait_until
from tests.limits import MIN_SCRAPES
from tests.privileged import daemonlib
from tests.privileged.daemonlib import Daemon, Samples, running_daemon
from tests.realsw.servinglib import serving_stack, weight_server
from tests.realsw.test_verdicts import SYS_FUTEX, states_of, targets_config

# hangwatch attaches: root and bcc, as tests/privileged (conftest.needs_bpf)
pytestmark = [pytest.mark.privileged, pytest.mark.usefixtures("needs_bpf")]

INTERVAL = 1.0  # the daemon's tick, and how often the hold scrapes
THRESHOLD = 10.0  # park_threshold_seconds
HOLD_S = 120.0
ABBA_STATES = ("stalled", "deadlocked")

Want = dict[str, tuple[int, tuple[str, ...]]]  # service -> (root pid, the states it may reach)


def config(tmp_path: Path, targets: dict[str, str]) -> tuple[Path, int]:
    """A config watching each ``name: cmdline regex`` of ``targets`` at this file's pace."""
    return targets_config(tmp_path, targets, INTERVAL, THRESHOLD)


def serving_cmdline(shape: str, run_dir: Path) -> str:
    """The stack's root process only: the spawned children run multiprocessing's command
    line, the client ``serving.client``'s."""
    return rf"serving\.server --shape {shape} .*{re.escape(str(run_dir))}"


class Watch:
    """Every scrape's states of the watched services, from the one where each first reached
    one of its states (which it must then keep)."""

    def __init__(self, want: Want) -> None:
        self.want = want
        self.started = time.monotonic()
        self.reached: dict[str, str] = {}  # service -> the state it reached first
        self.seen: dict[str, list[tuple[float, list[str]]]] = {n: [] for n in want}
        self.upgraded: set[str] = set()  # stalled, then proven deadlocked

    def record(self, s: Samples) -> bool:
        """Note this scrape; whether every service has reached its state by now."""
        t = round(time.monotonic() - self.started, 1)
        for name, (pid, states) in self.want.items():
            now = states_of(s, name, pid)
            if name not in self.reached and len(now) == 1 and now[0] in states:
                self.reached[name] = now[0]
            elif self.reached.get(name) == "stalled" and now == ["deadlocked"] and now[0] in states:
                # A stall later proven to have no waker (agent/analysis/nowaker.py): knowledge grows, one way;
                # going back would be a flap.
                self.reached[name] = "deadlocked"
                self.upgraded.add(name)
            if name in self.reached:
                self.seen[name].append((t, now))
        return len(self.reached) == len(self.want)

    def wrong(self) -> dict[str, list[tuple[float, list[str]]]]:
        """Per service, the scrapes since it reached its state that said anything else."""
        out = {}
        for n, seen in self.seen.items():
            if n in self.upgraded:  # stalled until proven, then deadlocked for good
                i = next(i for i, (_, st) in enumerate(seen) if st == ["deadlocked"])
                bad = [(t, st) for t, st in seen[:i] if st != ["stalled"]]
                bad += [(t, st) for t, st in seen[i:] if st != ["deadlocked"]]
            else:
                bad = [(t, st) for t, st in seen if st != [self.reached[n]]]
            if bad:
                out[n] = bad
        return out


def changes(log: str, want: Want) -> list[str]:
    """The daemon's state-change lines of the watched services (daemon.py ``_log_changes``)."""
    keys = tuple(f"service {n} pid {pid}:" for n, (pid, _) in want.items())
    return [ln for ln in log.splitlines() if any(k in ln for k in keys)]


@pytest.mark.serial  # a no-flap check: timing, with the host to itself
def test_three_services_hold_one_state_each_for_two_minutes(tmp_path: Path) -> None:
    began = time.monotonic()
    abba_dir, idle_dir = tmp_path / "abba", tmp_path / "idle"
    abba_dir.mkdir()
    idle_dir.mkdir()
    with contextlib.ExitStack() as stack:
        # torchrun first: it imports torch (three processes) while the stacks start.
        job = stack.enter_context(realsw.torchrun_job("allreduce_peer_gone"))
        abba = stack.enter_context(serving_stack("abba", abba_dir, client=["--mode", "once"]))
        idle = stack.enter_context(serving_stack("idle", idle_dir))
        waiter = job.ranks(2)[0].get_int("pid")
        wait_until(
            lambda: realsw.main_thread_in(waiter, SYS_FUTEX), 30, "rank 0 parked in all_reduce"
        )
        want: Want = {
            "torch": (job.pid, ("stalled",)),
            "abba": (abba.pid, ABBA_STATES),
            "idle": (idle.pid, ("idle",)),
        }
        cfg, port = config(
            tmp_path,
            {
                # torchrun's own command line (the ranks' lacks "torchrun" and the port).
                "torch": rf"bin/torchrun .*--master_port={job.port}\b",
                "abba": serving_cmdline("abba", abba_dir),
                "idle": serving_cmdline("idle", idle_dir),
            },
        )
        d: Daemon = stack.enter_context(running_daemon(cfg, port))
        ready_s = time.monotonic() - began

        watch = Watch(want)
        daemonlib.wait_until(
            d,
            watch.record,
            "torch stalled, abba stalled or deadlocked, idle idle",
        )
        reached_s = time.monotonic() - watch.started
        # Each change's line is written beside the loop once its stacks are read (a moment
        # after /metrics has it): the log from the last of them on must have no state
        # change of the three.
        for name, state in watch.reached.items():
            pid = want[name][0]
            daemonlib.wait_for_log(
                d, rf"service {name} pid {pid}: \S+ -> {state}:", f"{name}'s change to {state}"
            )
        mark = len(d.output())

        scrapes = 0
        hold_start = time.monotonic()
        while time.monotonic() - hold_start < HOLD_S:
            assert d.running(), f"the daemon exited during the hold:\n{d.output()}"
            s = d.scrape()
            if s is not None:
                scrapes += 1
                watch.record(s)
            time.sleep(INTERVAL)

        log = d.output()
        # The services must still be there: a flap-free hold of a dead process proves nothing.
        assert job.proc is not None and job.proc.poll() is None, job.describe("torchrun exited")
        for st in (abba, idle):
            server = st.server
            assert server.proc is not None and server.proc.poll() is None, server.describe(
                "the serving stack exited"
            )

    shown = "\n".join(changes(log, want))
    after = changes(log[mark:], want)
    print(  # shown with -rA: what was reached, when, and every state change
        f"started in {ready_s:.0f} s; all reached {watch.reached} {reached_s:.0f} s after the "
        f"daemon's first tick; held {HOLD_S:.0f} s, {scrapes} scrapes\n"
        f"state changes:\n{shown}"
    )
    assert scrapes >= MIN_SCRAPES, f"only {scrapes} scrapes answered in {HOLD_S} s"
    wrong = watch.wrong()
    assert not wrong and not after, (
        f"want one state per service for {HOLD_S:.0f} s after reaching it ({watch.reached});\n"
        f"scrapes that said otherwise (s since the first tick, states): {wrong}\n"
        f"state changes logged after all three reached theirs:\n" + "\n".join(after) + "\n"
        f"all state changes of the three (with their reasons):\n{shown}"
    )


ROWS_HOLD_S = 20.0


def test_the_daemon_gives_the_other_rows_their_verdicts(tmp_path: Path) -> None:
    """The rows of the issue's table that the tests above leave to ``diagnose``, watched by one
    daemon at its own pace (1 s, threshold 10 s): each reaches its true state and holds it for
    ROWS_HOLD_S. A rank waiting in the rendezvous for a peer that never comes, a DataLoader
    worker stuck, a helper forked with a lock held, the abba server with a client retrying, an
    event loop blocked with the accept queue full: stalled. A loader that logs every 32 MiB
    while it receives weights at 2 MiB/s: progressing."""
    dirs = {name: tmp_path / name for name in ("fork", "retry", "blocked", "loading")}
    for run_dir in dirs.values():
        run_dir.mkdir()
    with contextlib.ExitStack() as stack:
        rdzv = stack.enter_context(realsw.direct_job("rendezvous_peer_missing"))
        loader = stack.enter_context(realsw.direct_job("dataloader_worker_stuck"))
        # loading until the stack ends: past the harness's bound twice (servinglib)
        ws = stack.enter_context(weight_server(rate_mib=2))
        weights = f"tcp:127.0.0.1:{ws.info.get_int('port')}"
        stacks = {
            "fork": stack.enter_context(
                serving_stack("fork-lock", dirs["fork"], client=["--mode", "once"])
            ),
            "retry": stack.enter_context(
                serving_stack(
                    "abba-retry", dirs["retry"], client=["--mode", "retry", "--timeout", "1"]
                )
            ),
            "blocked": stack.enter_context(
                serving_stack(
                    "blocked-loop",
                    dirs["blocked"],
                    client=["--mode", "queue", "--connections", "8"],
                    server_args=["--backlog", "4"],
                )
            ),
            "loading": stack.enter_context(
                serving_stack(
                    "loading",
                    dirs["loading"],
                    server_args=["--weights", weights, "--log-every-mib", "32"],
                )
            ),
        }
        (line,) = rdzv.ready_lines(1)
        main = {ln["role"]: ln.get_int("pid") for ln in loader.ready_lines(2)}["main"]
        shapes = {"fork": "fork-lock", "retry": "abba-retry", "blocked": "blocked-loop"}
        shapes["loading"] = "loading"
        want: Want = {
            "rdzv": (line.get_int("pid"), ("stalled",)),
            "loader": (main, ABBA_STATES),  # deadlocked once the worker is proven to have no waker
            "fork": (stacks["fork"].pid, ABBA_STATES),
            "retry": (stacks["retry"].pid, ABBA_STATES),
            "blocked": (stacks["blocked"].pid, ("stalled",)),
            "loading": (stacks["loading"].pid, ("progressing",)),
        }
        targets = {
            "rdzv": r"torch_jobs\.py --shape rendezvous_peer_missing",
            "loader": r"torch_jobs\.py --shape dataloader_worker_stuck",
            **{n: serving_cmdline(shapes[n], dirs[n]) for n in stacks},
        }
        # Let every hang settle past the threshold before the daemon first looks, as it meets
        # them in the field: a job's processes announce READY a few seconds apart, and a
        # daemon started among them sees the last ones arrive.
        time.sleep(THRESHOLD + 5)
        cfg, port = config(tmp_path, targets)
        d: Daemon = stack.enter_context(running_daemon(cfg, port))
        watch = Watch(want)
        daemonlib.wait_until(d, watch.record, f"each of {want} in its state")
        hold_start = time.monotonic()
        while time.monotonic() - hold_start < ROWS_HOLD_S:
            s = d.scrape()
            if s is not None:
                watch.record(s)
            time.sleep(INTERVAL)
        loaded = "Load weight end" in stacks["loading"].log.read_text()
        log = d.output()
    print(f"reached {watch.reached}\n" + "\n".join(changes(log, want)))  # shown with -rA
    assert not loaded, "the load ended during the hold: the loading row was not watched loading"
    wrong = watch.wrong()
    assert not wrong, (
        f"want each state held for {ROWS_HOLD_S:.0f} s after reaching it ({watch.reached});\n"
        f"scrapes that said otherwise: {wrong}\nstate changes:\n" + "\n".join(changes(log, want))
    )
