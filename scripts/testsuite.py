"""`make test`'s steps, and the report CI prints at the end.

    python -m scripts.testsuite [--workers N] [--report DIR] [-- PYTEST_ARGS...]

1. **pure**: tests/test_*.py alone, so that its write guard (tests/nowrites.py) is on: nothing
   else writes to /tmp while a pure test runs.
2. **parallel**: tests/host, tests/privileged and tests/realsw but the tests marked ``serial``,
   on N pytest-xdist workers (``--dist loadgroup``: an ``xdist_group`` runs on one worker).
3. **serial**: the tests marked ``serial``, alone.

Every step runs, whatever the one before gave; the exit status is the first failing step's
(pytest's 5, nothing selected, is no failure: PYTEST_ARGS may select one step only).

The report (DIR/summary.txt, default .test-report/) has each step's time, exit status and CPU
pressure (the share of the step's time in which some runnable task waited for a CPU, from
/proc/pressure/cpu: how crowded the machine was, which is what decides the worker count), the
20 slowest tests of the run, every failure and error as it happened, with its first line
(nothing is retried, so a flake shows here), and what each step left where a stray write lands
(tests/nowrites.py's places, with /var/cache/hangwatch, the real software's documented cache).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # tests.nowrites, when run as a file

from tests import nowrites  # noqa: E402

OTHER_TIERS = ["tests/host", "tests/privileged", "tests/realsw"]
SLOWEST = 20
PRESSURE = Path("/proc/pressure/cpu")
PURE_FILE = re.compile(r"tests/test_\w+\.py")
CACHE = Path("/var/cache/hangwatch")  # the real software's venvs and models, made once
# What make test and pytest make, each documented and gitignored where in the checkout: the
# report, the parallel step's --basetemp, pytest's temporary root and cache, the bench's build
OWN = (
    REPO_ROOT / ".test-report",
    REPO_ROOT / ".pytest_cache",
    REPO_ROOT / ".build",
    Path("/tmp/hw-test-"),
    Path("/tmp/pytest-of-"),
)


def ours(change: str) -> bool:
    path = change.partition(" ")[2]
    return any(path.startswith(str(own)) for own in OWN)


def pressure_some() -> dict[str, float] | None:
    """The "some" line of /proc/pressure/cpu: avg10, avg60, avg300 (percent) and total
    (microseconds in which some runnable task waited for a CPU, since boot); None without PSI
    (a kernel without CONFIG_PSI, or psi=0)."""
    try:
        for line in PRESSURE.read_text().splitlines():
            if line.startswith("some "):
                return {k: float(v) for k, _, v in (f.partition("=") for f in line.split()[1:])}
    except (OSError, ValueError):
        return None
    return None


class PressureWatch:
    """The mean and the highest 10-second CPU pressure over a step, sampled every 5 s."""

    def __init__(self) -> None:
        self.start = pressure_some()
        self.began = time.monotonic()
        self.peak10 = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(5):
            some = pressure_some()
            if some is None or "avg10" not in some:
                return
            self.peak10 = max(self.peak10, some["avg10"])

    def stop(self) -> str:
        self._stop.set()
        self._thread.join()
        end, wall = pressure_some(), time.monotonic() - self.began
        if (
            not self.start
            or not end
            or wall <= 0
            or not {"total"} <= self.start.keys() & end.keys()
        ):
            return "CPU pressure not available (/proc/pressure/cpu)"
        mean = 100 * (end["total"] - self.start["total"]) / 1e6 / wall
        return f"CPU pressure (some) {mean:.0f}% mean, {self.peak10:.0f}% highest over 10 s"


@dataclass
class Step:
    name: str
    args: list[str]
    rc: int = -1
    seconds: float = 0.0
    pressure: str = ""
    junit: Path = field(default_factory=Path)
    left: list[str] = field(default_factory=list)


def run_step(step: Step, report: Path) -> None:
    step.junit = report / f"{step.name}.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", f"--junitxml={step.junit}", *step.args]
    shown = [a for a in cmd[1:] if not PURE_FILE.fullmatch(a)]
    if len(shown) < len(cmd) - 1:
        shown.append("tests/test_*.py")
    print(f"testsuite: step {step.name}: {' '.join(shown)}", flush=True)
    places = [*nowrites.watched(REPO_ROOT, None), CACHE]
    before = nowrites.take(places)
    watch, start = PressureWatch(), time.monotonic()
    step.rc = subprocess.run(cmd, cwd=REPO_ROOT, check=False).returncode
    step.seconds = time.monotonic() - start
    step.pressure = watch.stop()
    step.left = [c for c in nowrites.changes(before, nowrites.take(places)) if not ours(c)]
    print(f"testsuite: step {step.name}: exit {step.rc} in {step.seconds:.0f} s", flush=True)


@dataclass(frozen=True)
class Case:
    step: str
    name: str
    seconds: float
    outcome: str  # "passed", "failed", "error", "skipped"
    message: str


def cases(step: str, junit: Path) -> list[Case]:
    """The test cases of one JUnit XML file; none when the step wrote none (it crashed, or
    selected nothing)."""
    try:
        root = ET.parse(junit).getroot()
    except (OSError, ET.ParseError):
        return []
    found = []
    for case in root.iter("testcase"):
        module = case.get("classname", "")
        name = f"{module}::{case.get('name', '')}" if module else case.get("name", "")
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            hit = case.find(tag)
            if hit is not None:
                outcome = "failed" if tag == "failure" else tag
                first = (hit.get("message") or hit.text or "").strip().splitlines()[:1]
                message = first[0][:300] if first else ""
                break
        found.append(Case(step, name, float(case.get("time") or 0), outcome, message))
    return found


def summary(steps: list[Step]) -> str:
    lines = ["# make test", ""]
    every: list[Case] = []
    for step in steps:
        these = cases(step.name, step.junit)
        every += these
        counts = {o: sum(c.outcome == o for c in these) for o in ("passed", "failed", "error")}
        lines.append(
            f"{step.name}: exit {step.rc} in {step.seconds:.0f} s; {counts['passed']} passed, "
            f"{counts['failed']} failed, {counts['error']} errors; {step.pressure}"
        )
    total = sum(s.seconds for s in steps)
    lines += [f"all steps: {total:.0f} s ({total / 60:.1f} min)", ""]
    lines.append(f"## the {SLOWEST} slowest tests (setup, call and teardown)")
    for case in sorted(every, key=lambda c: -c.seconds)[:SLOWEST]:
        lines.append(f"{case.seconds:8.1f} s  {case.step:8}  {case.name}")
    left = [f"{step.name:8}  {change}" for step in steps for change in step.left]
    lines += ["", f"## left outside the tests' temporary directories: {len(left)}", *left]
    bad = [c for c in every if c.outcome in ("failed", "error")]
    lines += ["", f"## failures and errors, none retried: {len(bad)}"]
    lines += [f"{c.step:8}  {c.outcome:6}  {c.name}: {c.message}" for c in bad]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=3, help="the parallel step's workers")
    parser.add_argument("--report", type=Path, default=REPO_ROOT / ".test-report")
    parser.add_argument("pytest_args", nargs="*", help="after --: passed to every step")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error(f"--workers must be 1 or more, not {args.workers}")
    shutil.rmtree(args.report, ignore_errors=True)
    args.report.mkdir(parents=True)
    # Short: xdist adds a directory per worker, and Ray's unix sockets under a test's
    # directory must stay within the 107 bytes of sun_path.
    basetemp = tempfile.mkdtemp(prefix="hw-test-")
    extra = args.pytest_args
    pure = sorted(str(p.relative_to(REPO_ROOT)) for p in (REPO_ROOT / "tests").glob("test_*.py"))
    steps = [
        Step("pure", ["-p", "no:cacheprovider", *pure, *extra]),
        Step(
            "parallel",
            [
                "--durations=15",
                f"-n{args.workers}",
                "--dist=loadgroup",
                "-m",
                "not serial",
                f"--basetemp={basetemp}",
                *OTHER_TIERS,
                *extra,
            ],
        ),
        Step("serial", ["--durations=15", "-m", "serial", *OTHER_TIERS, *extra]),
    ]
    for step in steps:
        run_step(step, args.report)
        if step.name == "parallel" and step.rc in (0, 5):
            shutil.rmtree(basetemp, ignore_errors=True)  # kept to look at when it failed
    text = summary(steps)
    (args.report / "summary.txt").write_text(text)
    print(f"\ntestsuite: the report is {args.report / 'summary.txt'}", flush=True)
    for step in steps:
        if step.rc not in (0, 5):
            return step.rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
