"""`make package` without root: what the wheel, the sdist and the .deb hold, the unit and the
control file they are given, and the version and dependencies kept in one place each.
Installing the .deb and running it is tests/privileged/test_package.py's."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from agent import __version__
from scripts import package
from tests.privileged.debroot import host_mirrors

REPO = Path(__file__).resolve().parent.parent


def pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 or later
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def test_the_version_is_written_once() -> None:
    project = pyproject()["project"]
    assert "version" not in project and "version" in project["dynamic"]
    dynamic = pyproject()["tool"]["setuptools"]["dynamic"]["version"]
    assert dynamic == {"attr": "agent.__version__"}
    assert package.version() == __version__


def test_the_changelog_starts_with_this_version() -> None:
    versions = re.findall(r"^## \[([^]]+)\]", (REPO / "CHANGELOG.md").read_text(), re.M)
    assert versions and versions[0] == __version__, versions


def test_every_python_dependency_has_a_debian_name_or_a_reason() -> None:
    names = {re.split(r"[<>=!~ ;\[]", d)[0] for d in pyproject()["project"]["dependencies"]}
    assert names == set(package.DEBIAN_NAMES)
    assert "python3-bpfcc" in package.DEPENDS  # bcc is the distribution's, never PyPI's


@pytest.mark.parametrize(
    ("pep440", "debian"),
    [
        ("0.1.0", "0.1.0"),
        ("1.2.0rc1", "1.2.0~rc1"),
        ("1.2.0.dev3", "1.2.0~dev3"),
        ("2.0b1", "2.0~b1"),
    ],
)
def test_debian_versions_sort_pre_releases_first(pep440: str, debian: str) -> None:
    assert package.debian_version(pep440) == debian


def _below_header(unit: str) -> list[str]:
    return unit[unit.index("# Change settings") :].splitlines()


def test_the_packaged_unit_differs_only_in_where_hangwatch_is() -> None:
    repo_unit = (REPO / "deploy/systemd/hangwatch.service").read_text()
    unit = package.packaged_unit(repo_unit)
    ours, theirs = _below_header(repo_unit), _below_header(unit)
    assert len(ours) == len(theirs)
    changed = [b for a, b in zip(ours, theirs) if a != b]
    keys = {line.split("=", 1)[0] for line in changed if not line.startswith("#")}
    assert keys == {"Documentation", "ExecStart"}, changed
    assert "ExecStart=/usr/bin/hangwatch run --config /etc/hangwatch/hangwatch.yaml" in unit
    assert "/opt/hangwatch" not in unit


def test_host_mirrors_reads_both_source_formats(tmp_path: Path) -> None:
    apt = tmp_path / "apt"
    (apt / "sources.list.d").mkdir(parents=True)
    (apt / "sources.list.d" / "debian.sources").write_text(
        "Types: deb\n# a comment\nURIs: http://mirror.example/debian\n"
        "Suites: bookworm bookworm-updates\nComponents: main contrib\n\n"
        "Types: deb deb-src\nURIs: http://mirror.example/debian-security\n"
        "Suites: bookworm-security\nComponents: main\n\n"
        "Types: deb\nURIs: http://other.example/\nSuites: nodistro\nComponents: main\n"
    )
    (apt / "sources.list").write_text(
        "deb [arch=amd64] http://local.example/debian bookworm main\n"
        "deb http://cloud.example/apt cloud-sdk-bookworm main\n# deb http://x/ bookworm main\n"
    )
    assert host_mirrors("bookworm", apt) == [
        "deb http://local.example/debian bookworm main",
        "deb http://mirror.example/debian bookworm main",
        "deb http://mirror.example/debian bookworm-updates main",
        "deb http://mirror.example/debian-security bookworm-security main",
    ]


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
    r = subprocess.run(
        [sys.executable, "-m", "scripts.package", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    wheel, sdist, deb = (out / n for n in sorted(p.name for p in out.iterdir()))
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
