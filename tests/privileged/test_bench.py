"""The benchmark runs and reports (its figures are not asserted: benchmarks are not tests)."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.fixturelib import REPO_ROOT


def test_futex_overhead_benchmark_runs_and_reports() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "bench.futex_overhead", "--rounds", "1", "--calls", "20000"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    msg = f"exit {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    assert r.returncode == 0, msg
    rows = re.findall(
        r"^futex (WAIT|WAKE).*, (none|unwatched|watched)\s+[\d.]+\s+[\d.]+x$", r.stdout, re.M
    )
    assert len(rows) == 6, msg
    # The watched WAIT runs went through the probe: 20000 waits were seen.
    assert re.search(r"probe counters: 20000 waits seen, 0 lost", r.stdout), msg
