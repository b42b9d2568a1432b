"""make test's report (scripts/testsuite.py): every failure and error as it happened, the
slowest tests of all steps, each step's time and pressure, what each step left outside the
tests' temporary directories; a step that wrote no report (it
crashed, or selected nothing) counts no tests."""

from __future__ import annotations

from pathlib import Path

from scripts import testsuite
from scripts.testsuite import Step

PARALLEL = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="4">
<testcase classname="tests.privileged.test_park" name="test_parks" time="42.5"/>
<testcase classname="tests.privileged.test_park" name="test_flaky" time="3.0">
  <failure message="AssertionError: stalled != deadlocked&#10;second line">trace</failure>
</testcase>
<testcase classname="tests.host.test_x" name="test_setup_breaks" time="0.1">
  <error message="">fixture 'gone' not found
more</error>
</testcase>
<testcase classname="tests.host.test_x" name="test_skipped" time="0.0">
  <skipped message="no promtool"/>
</testcase>
</testsuite></testsuites>
"""


def test_the_report_names_every_failure_and_the_slowest(tmp_path: Path) -> None:
    (tmp_path / "parallel.xml").write_text(PARALLEL)
    steps = [
        Step("pure", [], rc=0, seconds=30, pressure="p1", junit=tmp_path / "absent.xml"),
        Step(
            "parallel",
            [],
            rc=1,
            seconds=600,
            pressure="p2",
            junit=tmp_path / "parallel.xml",
            left=["made /tmp/torchelastic_x"],
        ),
    ]
    text = testsuite.summary(steps)
    assert "pure: exit 0 in 30 s; 0 passed, 0 failed, 0 errors; p1" in text
    assert "parallel: exit 1 in 600 s; 1 passed, 1 failed, 1 errors; p2" in text
    assert "all steps: 630 s (10.5 min)" in text
    slowest = text.split("## the 20 slowest")[1].split("##")[0].strip().splitlines()[1:]
    assert slowest[0].split()[0] == "42.5"
    assert slowest[0].endswith("tests.privileged.test_park::test_parks")
    assert (
        "left outside the tests' temporary directories: 1\nparallel  made /tmp/torchelastic_x"
        in text
    )
    assert "failures and errors, none retried: 2" in text
    assert (
        "parallel  failed  tests.privileged.test_park::test_flaky: "
        "AssertionError: stalled != deadlocked\n" in text
    )
    assert (
        "parallel  error   tests.host.test_x::test_setup_breaks: fixture 'gone' not found" in text
    )
