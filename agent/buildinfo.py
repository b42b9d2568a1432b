"""Which hangwatch runs: its version and the git commit it was built from.

A package build (scripts/package.py) writes the commit into ``agent/_build.py``; that file is
never in the repository. Run from a checkout instead, the commit is asked of git, once, with a
time limit; anything else (no git, not a checkout, git refusing a checkout owned by another
user) gives "unknown". Never raises.
"""

from __future__ import annotations

import functools
import importlib
import os
import re
import subprocess
from pathlib import Path

from . import __version__

UNKNOWN = "unknown"
GIT_TIMEOUT_S = 2.0
# What `git rev-parse --short` prints, with the "-dirty" a build from a modified tree adds.
_COMMIT = re.compile(r"[0-9a-f]{4,40}(-dirty)?")
_CHECKOUT = Path(__file__).resolve().parent.parent


def version() -> str:
    return __version__


@functools.lru_cache(maxsize=1)
def commit() -> str:
    """The stamped commit, else the checkout's HEAD, else "unknown"."""
    try:
        stamped = getattr(importlib.import_module(f"{__package__}._build"), "COMMIT", None)
    except Exception:  # absent in a checkout; a broken stamp must not stop the agent either
        stamped = None
    if isinstance(stamped, str) and _COMMIT.fullmatch(stamped):
        return stamped
    return git_commit(_CHECKOUT) or UNKNOWN


def git_commit(root: Path, *, dirty: bool = False) -> str | None:
    """``git rev-parse --short HEAD`` in ``root`` (with "-dirty" when ``dirty`` and a tracked
    file differs from HEAD), or None when ``root`` is no checkout or git does not answer in
    time."""
    if not (root / ".git").exists():  # a file in a worktree, a directory otherwise
        return None
    head = _git(root, "rev-parse", "--short", "HEAD")
    if head is None or not _COMMIT.fullmatch(head):
        return None
    if dirty:
        changed = _git(root, "status", "--porcelain", "--untracked-files=no")
        if changed is None:
            return None
        if changed:
            head += "-dirty"
    return head


def _git(root: Path, *args: str) -> str | None:
    # No prompt, and no lock on the index: status would otherwise write it back refreshed.
    env = {**os.environ, "GIT_TERMINAL_PROMPT": "0", "GIT_OPTIONAL_LOCKS": "0"}
    try:
        r = subprocess.run(
            ["git", "-C", str(root), *args],
            capture_output=True,
            text=True,
            timeout=GIT_TIMEOUT_S,
            env=env,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def describe() -> str:
    """What --version and the daemon's first line say: 0.1.0 (commit 41dcb18)."""
    return f"{version()} (commit {commit()})"
