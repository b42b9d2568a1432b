"""`make package`'s script run by the tests (tests/host/test_package_build.py without root,
tests/privileged/test_package.py in a clean root), into a directory of theirs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from scripts.fixturelib import REPO_ROOT


def make_package(out: Path) -> tuple[Path, Path, Path]:
    """``python -m scripts.package --out OUT``: its wheel, sdist and .deb, the only files."""
    r = subprocess.run(
        [sys.executable, "-m", "scripts.package", "--out", str(out)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert r.returncode == 0, f"scripts/package.py failed:\n{r.stdout}\n{r.stderr}"
    built = sorted(out.iterdir())
    assert len(built) == 3, built
    (wheel,) = out.glob("hangwatch-*.whl")
    (sdist,) = out.glob("hangwatch-*.tar.gz")
    (deb,) = out.glob("hangwatch_*.deb")
    return wheel, sdist, deb
