"""`make package` without root: what the wheel, the sdist and the .deb it builds hold, and the
control files the .deb is given. Installing the .deb and running it is
tests/privileged/test_package.py's."""

from __future__ import annotations

import re
import shutil
import subprocess
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from agent import __version__
from tests.packagebuild import make_package

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Built:
    wheel: Path
    sdist: Path
    deb: Path
    status_before: str  # `git status --ignored` of the checkout before the build, and after
    status_after: str


def git_status() -> str:
    argv = ["git", "-C", str(REPO), "status", "--porcelain", "--ignored"]
    return subprocess.run(argv, capture_output=True, text=True, check=True).stdout


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Built:
    if shutil.which("dpkg-deb") is None or shutil.which("git") is None:
        pytest.skip("dpkg-deb and git build the package")
    out = tmp_path_factory.mktemp("dist")
    before = git_status()
    wheel, sdist, deb = make_package(out)
    return Built(wheel, sdist, deb, before, git_status())


def test_the_build_leaves_the_checkout_as_it_was(artifacts: Built) -> None:
    # No build/, egg-info or agent/_build.py: the build works in a copy.
    assert artifacts.status_after == artifacts.status_before


def test_the_names_are_the_version(artifacts: Built) -> None:
    assert [p.name for p in (artifacts.wheel, artifacts.sdist, artifacts.deb)] == [
        f"hangwatch-{__version__}-py3-none-any.whl",
        f"hangwatch-{__version__}.tar.gz",
        f"hangwatch_{__version__}_all.deb",
    ]


def test_wheel_and_sdist_carry_the_bpf_sources_and_the_commit(artifacts: Built) -> None:
    wheel, sdist = artifacts.wheel, artifacts.sdist
    bpf = {p.name for p in (REPO / "bpf").iterdir()}
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        stamp = z.read("agent/_build.py").decode()
    assert {f"agent/bpf/{n}" for n in bpf} <= names
    assert "agent/default-config.yaml" in names
    assert re.search(r"^COMMIT = '[0-9a-f]{4,40}(-dirty)?'$", stamp, re.M), stamp
    with tarfile.open(sdist) as t:
        top = f"hangwatch-{__version__}/"
        members = {m.name.removeprefix(top) for m in t.getmembers()}
    assert {f"bpf/{n}" for n in bpf} | {"agent/_build.py", "pyproject.toml"} <= members


def test_the_deb_holds_the_agent_the_unit_and_the_config(artifacts: Built) -> None:
    deb = artifacts.deb
    listing = subprocess.run(["dpkg-deb", "-c", str(deb)], capture_output=True, text=True)
    paths = {ln.split()[-1].removeprefix(".") for ln in listing.stdout.splitlines()}
    for path in (
        "/usr/bin/hangwatch",
        "/usr/share/hangwatch/agent/cli.py",
        "/usr/share/hangwatch/agent/_build.py",
        "/usr/share/hangwatch/agent/bpf/hangwatch.h",
        "/lib/systemd/system/hangwatch.service",
        "/etc/hangwatch/hangwatch.yaml",
        "/usr/share/doc/hangwatch/copyright",
        "/usr/share/doc/hangwatch/changelog.gz",
    ):
        assert path in paths, path
    assert not any("__pycache__" in p for p in paths)
    lines = listing.stdout.splitlines()
    assert all(ln.split()[1] == "root/root" for ln in lines)
    assert any(ln.startswith("-rwxr-xr-x") and ln.endswith("/usr/bin/hangwatch") for ln in lines)

    def field(name: str) -> str:
        r = subprocess.run(["dpkg-deb", "-f", str(deb), name], capture_output=True, text=True)
        return r.stdout.strip()

    assert field("Package") == "hangwatch" and field("Architecture") == "all"
    assert field("Version") == __version__
    depends = field("Depends")
    for name in ("python3 (>= 3.11)", "python3-bpfcc", "python3-yaml", "python3-pyelftools"):
        assert name in depends, depends
    assert "pynvml" not in depends and "py-spy" not in depends

    with tempfile.TemporaryDirectory() as tmp:
        control = Path(tmp)
        subprocess.run(["dpkg-deb", "-e", str(deb), str(control)], check=True)
        assert (control / "conffiles").read_text() == "/etc/hangwatch/hangwatch.yaml\n"
        for script in ("postinst", "prerm", "postrm"):
            path = control / script
            assert path.stat().st_mode & 0o111, script
            subprocess.run(["sh", "-n", str(path)], check=True)
            text = path.read_text()
            # Nothing starts or stops without a running systemd (a chroot, an image build).
            for call in re.findall(r"systemctl (?:--system )?(start|stop|try-restart)", text):
                assert "[ -d /run/systemd/system ]" in text, (script, call)
