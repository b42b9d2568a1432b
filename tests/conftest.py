"""Hypothesis profiles: CI replays the same examples every run, so a landing is never decided
by the luck of a random draw; runs elsewhere explore new ones (and keep what fails in
.hypothesis/ to replay it). The pure tier's rules: a test in tests/*.py that starts a process
fails (tests/noprocess.py), and so does one that writes outside its temporary directory while
the tier runs alone (tests/nowrites.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Generator
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import pytest
from hypothesis import settings

from tests import nowrites
from tests.noprocess import RULE, no_processes

PURE = Path(__file__).resolve().parent
ATTEMPTS = pytest.StashKey[list[str]]()
PURE_ALONE = pytest.StashKey[bool]()

settings.register_profile("ci", derandomize=True, deadline=None)
if os.environ.get("CI") == "true":
    settings.load_profile("ci")


def _doors_closed(item: pytest.Item) -> AbstractContextManager[object]:
    """No process may start while a test of the pure tier (tests/*.py) runs; others, as is."""
    if Path(item.path).parent != PURE:
        return nullcontext()
    return no_processes(item.stash.setdefault(ATTEMPTS, []))


def _is_pure(item: pytest.Item) -> bool:
    return Path(item.path).parent == PURE


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """trylast: the selection after -k and -m is what runs."""
    config.stash[PURE_ALONE] = bool(items) and all(_is_pure(item) for item in items)


def pytest_sessionstart(session: pytest.Session) -> None:
    """The write guard (tests/nowrites.py), over pytest's temporary root too where pytest
    chose it (a --basetemp given, by make test or by xdist to its workers, is a directory that
    other sessions or workers share). The base is made here, before the first listing: pytest
    makes it (and rotates old ones) on the first test that asks for a temporary path."""
    config = session.config
    factory = getattr(config, "_tmp_path_factory", None)  # pytest's tmp_path plugin's
    pytest_root = None
    if factory is not None and config.option.basetemp is None:
        pytest_root = factory.getbasetemp().parent
    places = nowrites.watched(PURE.parent, pytest_root)

    def applies(item: pytest.Item) -> bool:
        return _is_pure(item) and item.config.stash.get(PURE_ALONE, False)

    config.pluginmanager.register(nowrites.WriteGuard(places, applies), "hangwatch-nowrites")


# Each phase of a pure test (its fixtures' setup and teardown included) runs with the doors
# closed. Wrappers around the phases, not an autouse fixture: a module-scoped fixture is set up
# before any function-scoped one.
@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, None, None]:
    with _doors_closed(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    with _doors_closed(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(
    item: pytest.Item, nextitem: pytest.Item | None
) -> Generator[None, None, None]:
    with _doors_closed(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A start that the code under test caught and swallowed still fails the phase."""
    report = yield
    attempts = item.stash.get(ATTEMPTS, [])
    if attempts and not report.failed:
        report.outcome = "failed"
        report.longrepr = f"{item.nodeid} started a process ({', '.join(attempts)}). {RULE}"
    attempts.clear()
    return report


@pytest.fixture(scope="module")
def promtool() -> str:
    """Prometheus's promtool (the rules' tests and the queries of `hangwatch job` and the
    dashboard run in its engine); a failure under CI=true, not a skip."""
    path = shutil.which("promtool")
    if path is None:
        reason = "promtool is not installed (Debian package `prometheus`; `make setup`)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true and {reason}", pytrace=False)
        pytest.skip(reason)
    return path


def run_promtool(promtool: str, *args: str, timeout: float = 120) -> None:
    """``promtool ARGS``, failing the test with its output unless it exits 0."""
    done = subprocess.run(
        [promtool, *args], capture_output=True, text=True, check=False, timeout=timeout
    )
    assert done.returncode == 0, (
        f"promtool {' '.join(args)} exited {done.returncode}:\n{done.stdout}{done.stderr}"
    )
