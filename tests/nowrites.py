"""The pure tier's second rule: a test writes only under its own temporary directory.

A pure test (tests/*.py) runs between two listings of the places a stray write lands (the file
system's root, the shared temporary directories, the home directory, the checkout and pytest's
temporary root); a name that appears or disappears in one of them fails the test that ran, in
its teardown. Names, not contents, one level deep: cheap enough for every test (a few
``listdir`` calls), and what a path built through a link the test made (``/a``, ``../..``)
leaves behind. What the pure tier may keep there is named in ``KEPT``.

The guard is on only when the session holds the pure tier alone: beside the other tiers (in one
pytest run), their fixtures and engines write to /tmp while a pure test runs, and the pure test
would be blamed. `make check` and `make test`'s first step run the pure tier alone.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Generator, Iterable, Mapping
from pathlib import Path

import pytest

RULE = (
    "a test in tests/*.py writes only under its own temporary directory (tmp_path, "
    "tmp_path_factory): make each entry relative to a directory descriptor, with O_NOFOLLOW, "
    "so that a link the test made cannot lead the write elsewhere (tests/nowrites.py)"
)

# name -> why the pure tier may make or remove it while a test runs
KEPT: Mapping[str, str] = {
    # Hypothesis's example database, in the checkout (gitignored), outside CI's profile: the
    # failing examples a developer's next run replays
    ".hypothesis": "Hypothesis's example database",
}

# pytest's own numbered temporary directories (and the link to the newest) in its temporary
# root: a second pytest session on the host makes and rotates them, not a test of ours
PYTEST_OWN = re.compile(r"pytest-(\d+|current)")

# Shared temporary directories, where what others remove (a tmp cleaner, another user's
# program) is no sign of a test's: there only a name made counts. A stray write, which is
# what a path led through a link leaves, makes names.
SHARED_TMP = (Path("/tmp"), Path("/var/tmp"), Path("/dev/shm"))

Listing = dict[Path, frozenset[str]]


def watched(checkout: Path, pytest_root: Path | None) -> list[Path]:
    """Where a stray write lands: the root, the shared temporary directories, /run (the
    daemon's default status socket lives under it), the home directory, the checkout and its
    tests, pytest's temporary root. Each path once, as given."""
    places = [
        Path("/"),
        Path("/tmp"),
        Path("/var/tmp"),
        Path("/dev/shm"),
        Path("/run"),
        Path.home(),
        checkout,
        checkout / "tests",
    ]
    if pytest_root is not None:
        places.append(pytest_root)
    seen: list[Path] = []
    for place in places:
        if place not in seen:
            seen.append(place)
    return seen


def take(places: Iterable[Path]) -> Listing:
    """The names in each place; a place that cannot be listed is left out of the comparison."""
    listing: Listing = {}
    for place in places:
        try:
            listing[place] = frozenset(os.listdir(place))
        except OSError:
            continue
    return listing


def changes(before: Listing, after: Listing) -> list[str]:
    """``made PATH`` / ``removed PATH`` for each name that differs, but those in KEPT,
    pytest's own directories and names removed from the shared temporary directories."""
    found: list[str] = []
    for place, names in before.items():
        now = after.get(place)
        if now is None:
            continue
        removed = set() if place in SHARED_TMP else names - now
        for word, differ in (("made", now - names), ("removed", removed)):
            for name in sorted(differ):
                if name in KEPT or PYTEST_OWN.fullmatch(name):
                    continue
                found.append(f"{word} {place / name}")
    return found


class WriteGuard:
    """A pytest plugin: each test ``applies`` selects is run between two listings of
    ``places``; a difference fails its teardown, naming the paths."""

    def __init__(self, places: list[Path], applies: Callable[[pytest.Item], bool]) -> None:
        self.places = places
        self.applies = applies
        self._before: dict[str, Listing] = {}
        self._found: dict[str, list[str]] = {}

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> Generator[None, None, None]:
        if self.applies(item):
            self._before[item.nodeid] = take(self.places)
        return (yield)

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_teardown(
        self, item: pytest.Item, nextitem: pytest.Item | None
    ) -> Generator[None, None, None]:
        try:
            return (yield)
        finally:
            before = self._before.pop(item.nodeid, None)
            if before is not None:
                self._found[item.nodeid] = changes(before, take(self.places))

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo[None]
    ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
        report = yield
        if call.when == "teardown":
            found = self._found.pop(item.nodeid, [])
            if found and not report.failed:
                report.outcome = "failed"
                report.longrepr = (
                    f"{item.nodeid} wrote outside its temporary directory: "
                    f"{'; '.join(found)}. {RULE}"
                )
        return report
