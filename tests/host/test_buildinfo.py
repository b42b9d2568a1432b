"""The build's identity: the stamped commit first, the checkout's HEAD next, "unknown" last;
git is asked with a time limit and nothing it does (missing, slow, failing) raises."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent import __version__, buildinfo
from agent.cli import main

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    buildinfo.commit.cache_clear()
    yield
    buildinfo.commit.cache_clear()


def git(root: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(root), *args], capture_output=True, text=True, check=True
    ).stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    root.mkdir()
    git(root, "init", "-q")
    (root / "a.txt").write_text("a\n")
    git(root, "add", "a.txt")
    git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "a")
    return root


def test_a_stamp_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    stamp = types.ModuleType("agent._build")
    stamp.COMMIT = "abc1234-dirty"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "agent._build", stamp)
    monkeypatch.setattr(buildinfo, "git_commit", lambda *a, **k: pytest.fail("git was asked"))
    assert buildinfo.commit() == "abc1234-dirty"
    assert buildinfo.describe() == f"{__version__} (commit abc1234-dirty)"


def test_a_malformed_stamp_is_not_believed(monkeypatch: pytest.MonkeyPatch) -> None:
    stamp = types.ModuleType("agent._build")
    stamp.COMMIT = 'x"} 1\nevil'  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "agent._build", stamp)
    monkeypatch.setattr(buildinfo, "git_commit", lambda *a, **k: None)
    assert buildinfo.commit() == buildinfo.UNKNOWN


def test_without_a_stamp_a_checkout_says_its_head(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "agent._build", None)  # import raises ImportError
    assert buildinfo.commit() == git(REPO, "rev-parse", "--short", "HEAD")


def test_head_and_dirty(repo: Path) -> None:
    head = git(repo, "rev-parse", "--short", "HEAD")
    assert buildinfo.git_commit(repo) == head
    assert buildinfo.git_commit(repo, dirty=True) == head
    (repo / "untracked.txt").write_text("not a change to the build\n")
    assert buildinfo.git_commit(repo, dirty=True) == head
    (repo / "a.txt").write_text("b\n")
    assert buildinfo.git_commit(repo, dirty=True) == f"{head}-dirty"
    assert buildinfo.git_commit(repo) == head


def test_not_a_checkout(tmp_path: Path) -> None:
    assert buildinfo.git_commit(tmp_path) is None


def test_no_git(repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(repo / "nowhere"))
    assert buildinfo.git_commit(repo) is None


def test_a_repository_without_commits(tmp_path: Path) -> None:
    git(tmp_path, "init", "-q")
    assert buildinfo.git_commit(tmp_path) is None


def test_a_git_that_hangs_is_given_up(repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir = repo / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "git"
    fake.write_text("#!/bin/sh\nexec sleep 30\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(buildinfo, "GIT_TIMEOUT_S", 0.2)
    began = time.monotonic()
    assert buildinfo.git_commit(repo) is None
    assert time.monotonic() - began < 5


def test_version_flag(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(buildinfo, "commit", lambda: "feed123")
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    out = capsys.readouterr()
    assert out.out == f"hangwatch {__version__} (commit feed123)\n"
    assert out.err == ""
