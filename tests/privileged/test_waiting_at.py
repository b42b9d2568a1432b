"""Where a parked process waits, as the daemon exports it (hangwatch_process_waiting_at): read
once per park with the real stack readers, from the rank's own process and not its helpers,
and following the process when it parks somewhere else."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from scripts.fixturelib import Fixture
from tests.privileged.daemonlib import Daemon, Samples, free_port, running_daemon, wait_until
from tests.privileged.harness import line_of

# serial: its daemon selects fixture programs by name, so it would watch other tests' copies too
pytestmark = pytest.mark.serial

THRESHOLD = 2  # a site is read once a park has lasted half of it
CONFIG = f"""
listen: "127.0.0.1:{{port}}"
interval_seconds: 0.5
park_threshold_seconds: {THRESHOLD}
targets:
  - name: rank
    cmdline: "fixtures/rank_waits\\\\.py"
  - name: barrier
    cmdline: "fixtures/build/barrier_ranks"
"""
FIXTURE = "tests/fixtures/rank_waits.py"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    port = free_port()
    cfg = tmp_path_factory.mktemp("waiting-at") / "hangwatch.yaml"
    cfg.write_text(CONFIG.format(port=port))
    with running_daemon(cfg, port) as d:
        yield d


def sites(samples: Samples, pid: int) -> list[str]:
    return [
        dict(ls)["site"]
        for (name, ls), v in samples.items()
        if name == "hangwatch_process_waiting_at" and dict(ls)["pid"] == str(pid) and v == 1
    ]


def site_of(daemon: Daemon, pid: int, site: str) -> Samples:
    return wait_until(daemon, lambda s: sites(s, pid) == [site], f"pid {pid} waiting at {site}")


def test_a_rank_waits_where_its_own_code_called_and_its_helper_has_no_site(daemon: Daemon):
    env = {**os.environ, "RANK": "1", "WORLD_SIZE": "4"}
    # readline is C: the line waits in native code, so its own function is the call. Event.wait
    # is Python (the standard library's): the call it made.
    first = f"first_wait (rank_waits.py:{line_of(FIXTURE, 'sys.stdin.readline()')})"
    second = f"Event.wait (rank_waits.py:{line_of(FIXTURE, 'second wait')})"
    with Fixture.py("rank_waits", env=env) as fx:
        child = fx.info.get_int("child")
        s = site_of(daemon, fx.pid, first)
        assert sites(s, child) == [], "a helper that inherits RANK has a site of its own"
        labels = {
            dict(ls)["pid"]: v for (n, ls), v in s.items() if n == "hangwatch_process_world_size"
        }
        assert labels == {str(fx.pid): 4.0, str(child): 4.0}
        fx.send("go")
        fx.wait_for("WORKING")
        # While it works (until the test says): no site.
        wait_until(daemon, lambda s: sites(s, fx.pid) == [], f"pid {fx.pid} with no site")
        fx.send("park")
        fx.wait_for("MOVED")
        site_of(daemon, fx.pid, second)


def test_a_native_process_waits_at_its_first_caller_outside_libc(daemon: Daemon):
    with Fixture.c("barrier_ranks", "--last-rank-parks") as fx:
        # The fixture's rank code is inlined into main (-O2): the symbol that covers the call.
        # Never an address: the last rank waits at another instruction of main than the rest.
        for pid in (*fx.info.get_ints("ranks"), fx.pid):
            site_of(daemon, pid, "main (barrier_ranks)")


def test_no_site_is_read_with_stacks_off(tmp_path: Path):
    port = free_port()
    cfg = tmp_path / "hangwatch.yaml"
    cfg.write_text(CONFIG.format(port=port) + "stacks: false\n")
    with running_daemon(cfg, port) as d, Fixture.py("rank_waits") as fx:
        s = wait_until(
            d,
            lambda s: any(
                n == "hangwatch_process_parked_seconds" and dict(ls)["pid"] == str(fx.pid) and v > 2
                for (n, ls), v in s.items()
            ),
            "the fixture parked past the threshold",
        )
        assert sites(s, fx.pid) == []
