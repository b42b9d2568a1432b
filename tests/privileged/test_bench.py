"""The benchmark suite runs and reports every row (its figures are not asserted: benchmarks
are not tests, and this machine is shared). It runs as ``--smoke``: every part and row, with
the shortest periods and smallest sizes; checked only for being there and sane."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from scripts.fixturelib import REPO_ROOT

pytestmark = pytest.mark.serial  # serial: it measures the daemon's CPU and latency, on a quiet host

NUM = r"[\d,]+(?:\.\d+)?"

# (workload title, mode) of every row of the overhead table.
OVERHEAD_ROWS = [
    ("futex WAIT returning at once (EAGAIN)", "none"),
    ("futex WAIT returning at once (EAGAIN)", "unwatched"),
    ("futex WAIT returning at once (EAGAIN)", "watched"),
    ("futex WAKE, nobody waiting", "none"),
    ("futex WAKE, nobody waiting", "unwatched"),
    ("futex WAKE, nobody waiting", "watched"),
    ("mutex+condvar ping-pong, per hand-off", "none"),
    ("mutex+condvar ping-pong, per hand-off", "strace -f"),
    ("mutex+condvar ping-pong, per hand-off", "watched"),
    ("uncontended pthread mutex lock+unlock", "none"),
    ("uncontended pthread mutex lock+unlock", "watched"),
    ("getppid(2)", "none"),
    ("getppid(2)", "unwatched"),
    ("pread(2) of 64 bytes of a cached regular file", "unwatched"),
    ("pread(2) of 64 bytes of a cached regular file", "watched"),
    ("read(2) of 1 byte of /dev/zero (not a regular file)", "watched"),
    ("Python, 4 threads contending for the GIL, per step", "none"),
    ("Python, 4 threads contending for the GIL, per step", "watched"),
]


def test_bench_suite_smoke_reports_every_row() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "bench", "--smoke"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
    )
    out = r.stdout
    msg = f"exit {r.returncode}\nstdout:\n{out}\nstderr:\n{r.stderr}"
    assert r.returncode == 0, msg
    for title, mode in OVERHEAD_ROWS:
        row = rf"^{re.escape(title)}\s+{re.escape(mode)}\s+({NUM})\s+({NUM})x\b"
        m = re.search(row, out, re.M)
        assert m, f"no row for {title}, {mode}\n{msg}"
        # Sane: a call takes time, and the no-agent row is its own baseline.
        assert float(m[1].replace(",", "")) > 0, f"{title}, {mode}: no time per call\n{msg}"
        assert mode != "none" or m[2] == "1.00", f"{title}: baseline ratio {m[2]}\n{msg}"
    # Targets are judged, never hard-coded: each row with one says met or NOT met.
    judged = re.findall(r"<= [\d.]+x\s+(met|NOT met)$", out, re.M)
    assert len(judged) == 5, msg
    assert re.search(r"^no-agent runs while .*: \d+ of \d+$", out, re.M), msg
    for what in ("idle \\(watching nothing\\)", "watching [\\d,]+ futex calls/s",
                 "watching [\\d,]+ parked threads"):  # fmt: skip
        assert re.search(rf"^{what}\s+{NUM}\s+{NUM}\s+{NUM}", out, re.M), f"{what}\n{msg}"
    assert re.search(rf"^{NUM}\s+{NUM}\s+\d+$", out, re.M), msg  # a ring-buffer step
    assert re.search(rf"highest sustained rate with 0 drops: (below )?{NUM} events/s", out), msg
    assert re.search(rf"^1\s+{NUM}\s+{NUM}$", out, re.M), msg  # startup: 1 run, median, max
    assert re.search(rf"^1\s+{NUM}\s+{NUM}\s+max <= 2 s\s+(met|NOT met)$", out, re.M), msg
    assert re.search(rf"^100 threads\s+{NUM}\s+{NUM}\s+{NUM}\s+{NUM}$", out, re.M), msg  # stacks
    assert re.search(r"^take us\s+check us.*\n\d+\s+\d+\s+\d+$", out, re.M), msg  # reads
    assert re.search(rf"^100,000\s+\d+\s+100,\d+\s+{NUM}\s+\d+$", out, re.M), msg
    # scaling: the idle row, then each shape against it, the target judged
    assert re.search(rf"^watching nothing\s+{NUM}\s+\+0\.00\s+{NUM}", out, re.M), msg
    others = "50 other processes \\(not watched\\)"
    for what in ("200 parked threads \\(1 x 200\\)", "100 idle connections", others):
        assert re.search(rf"^{what}\s+{NUM}\s+[+-]{NUM}\s+{NUM}\s+{NUM}", out, re.M), msg
    for who in ("alone", "140 slow clients"):  # slowclients: scrapes, latencies, threads, fds
        assert re.search(rf"^{who}\s+\d+\s+{NUM}\s+{NUM}\s+{NUM}\s+\d+\s+\d+$", out, re.M), msg
    assert re.search(rf"^/proc/PID/io: wchar \+ read_bytes\s+\d+\s+{NUM}x$", out, re.M), msg
    for target in ("pool of 200 threads", "6,200 mappings"):  # maps: the three reads each
        for way in ("whole file \\(before\\)", "streamed, capped", "PROCMAP_QUERY"):
            assert re.search(rf"^{target}\s+\d+\s+\d+\s+{way}\s+{NUM}\s+{NUM}$", out, re.M), msg
    # ... each also up before the daemon started, and the shapes that move: every row beside
    # node_exporter (installed by make setup-tests), the target judged against it
    for what in ("200 parked threads \\(1 x 200\\)", "100 idle connections"):
        before = f"{what}, up before the daemon"
        assert re.search(rf"^{before}\s+{NUM}\s+[+-]{NUM}\s+{NUM}\s+{NUM}", out, re.M), msg
    for what in ("1 idle connection \\+ 20 short connections/s", "a service turning deadlocked"):
        # CPU, over idle, per unit (a rate row only), node_exporter's CPU (0 in a 1 s smoke
        # period leaves the ratio n/a)
        assert re.search(rf"^{what}\s+{NUM}\s+[+-]{NUM}\s+({NUM}\s+)?{NUM}\s", out, re.M), msg
    target = r"^1,600 parked threads \(8 x 200\) \+ 1,000 idle connections{}\s.*" + (
        r"\sCPU < node_exporter's, RSS <= 150 MB\s+(met|NOT met)$"
    )
    for when in ("", ", up before the daemon"):
        assert re.search(target.format(when), out, re.M), msg
