"""The pure tier's write guard (tests/nowrites.py): a name made or removed where a stray write
lands fails the test that ran, and pytest's own directories and the kept caches do not."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import nowrites

pytest_plugins = ("pytester",)


def test_a_name_made_or_removed_is_named(tmp_path: Path) -> None:
    root, other = tmp_path / "root", tmp_path / "other"
    root.mkdir()
    other.mkdir()
    (root / "gone").write_text("")
    before = nowrites.take([root, other, tmp_path / "missing"])
    (root / "gone").unlink()
    (root / "a").mkdir()
    (other / "b").symlink_to("./b/.")  # the loop a test once left in pytest's root
    assert nowrites.changes(before, nowrites.take([root, other])) == [
        f"made {root / 'a'}",
        f"removed {root / 'gone'}",
        f"made {other / 'b'}",
    ]


def test_a_name_removed_from_a_shared_temporary_directory_is_not_a_write(tmp_path: Path) -> None:
    """A tmp cleaner or another program removes names from /tmp at any time."""
    before = {Path("/tmp"): frozenset({"theirs", "mine"}), tmp_path: frozenset({"kept"})}
    after = {Path("/tmp"): frozenset({"mine", "new"}), tmp_path: frozenset()}
    assert nowrites.changes(before, after) == ["made /tmp/new", f"removed {tmp_path / 'kept'}"]


def test_pytest_own_directories_and_the_kept_caches_are_not_writes(tmp_path: Path) -> None:
    before = nowrites.take([tmp_path])
    for name in ("pytest-7", "pytest-current", *nowrites.KEPT):
        (tmp_path / name).mkdir()
    assert nowrites.changes(before, nowrites.take([tmp_path])) == []
    (tmp_path / "pytest-of-root").mkdir()  # not pytest's numbered directory
    assert nowrites.changes(before, nowrites.take([tmp_path])) == [
        f"made {tmp_path / 'pytest-of-root'}"
    ]


def test_the_places_watched_hold_the_root_and_pytest_root_once(tmp_path: Path) -> None:
    places = nowrites.watched(tmp_path, Path("/tmp"))
    assert places[0] == Path("/")
    assert places.count(Path("/tmp")) == 1
    assert tmp_path in places and tmp_path / "tests" in places
    assert Path("/tmp") not in nowrites.watched(tmp_path, None)[2:]


SESSION = """
import os, pathlib

def test_writes_beside(tmp_path):
    os.symlink(".", os.path.join({outside!r}, "a"))

def test_writes_inside(tmp_path):
    (tmp_path / "a").mkdir()
    os.symlink(".", tmp_path / "a" / "b")

def test_fails_on_its_own(tmp_path):
    os.mkdir(os.path.join({outside!r}, "c"))
    assert False
"""


def test_the_guard_fails_the_test_that_wrote_and_only_it(pytester: pytest.Pytester) -> None:
    """The plugin itself, in a session of its own: a write beside the temporary directory
    fails that test's teardown; one inside does not; a test that failed on its own still has
    its write named."""
    outside = pytester.path / "outside"
    outside.mkdir()
    pytester.makepyfile(test_guarded=SESSION.format(outside=str(outside)))
    guard = nowrites.WriteGuard([outside], lambda item: True)
    result = pytester.inline_run("-p", "no:cacheprovider", plugins=[guard])
    reports = {
        (r.nodeid.split("::")[-1], r.when): r for r in result.getreports("pytest_runtest_logreport")
    }
    beside = reports["test_writes_beside", "teardown"]
    assert beside.failed
    assert f"made {outside / 'a'}" in str(beside.longrepr)
    assert "tests/nowrites.py" in str(beside.longrepr)
    assert reports["test_writes_inside", "teardown"].passed
    assert reports["test_fails_on_its_own", "call"].failed
    assert f"made {outside / 'c'}" in str(reports["test_fails_on_its_own", "teardown"].longrepr)
