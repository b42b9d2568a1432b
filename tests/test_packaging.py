"""`make package`'s rules, without building: the version and the dependencies kept in one place
each, the unit the .deb is given, the mirrors its test root is made from. What a build holds is
tests/host/test_package_build.py's; installing the .deb and running it is
tests/privileged/test_package.py's."""

from __future__ import annotations

import re
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
