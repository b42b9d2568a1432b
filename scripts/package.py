"""`make package`: a wheel, an sdist and a Debian package of the checkout, in dist/.

Built from a copy of the checkout's files (tracked, and untracked ones git does not ignore),
so the checkout gets no build/ or egg-info, and so the copy can carry the commit stamp
(agent/_build.py) that `hangwatch --version` and hangwatch_build_info report. The wheel and
the sdist come from the PEP 517 hooks of the backend pyproject.toml names (setuptools), called
in this interpreter: no isolated build environment, so nothing is downloaded. The .deb is
staged from the wheel's files and deploy/systemd, and packed by `dpkg-deb --build`.

    python3 -m scripts.package [--out DIR]
"""

from __future__ import annotations

import argparse
import ast
import gzip
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # run as a file too, not only with -m from the checkout

from agent.buildinfo import git_commit  # noqa: E402  (the agent's own reading of the commit)

NAME = "hangwatch"
# The package's Python modules are private to it, as Debian's Python policy puts an
# application's modules: "agent" is too general a top-level name to claim in dist-packages.
PRIVATE_DIR = "/usr/share/hangwatch"
UNIT = "/lib/systemd/system/hangwatch.service"
CONFIG = "/etc/hangwatch/hangwatch.yaml"
DOC_DIR = "/usr/share/doc/hangwatch"
DOCS = ("README.md", "docs")  # the README links the docs by relative paths: all of them

# pyproject's dependencies by the Debian package that provides each; None where Debian 12 has
# none and the agent works without it, saying what is missing where it would have used it.
DEBIAN_NAMES: dict[str, str | None] = {
    "prometheus-client": "python3-prometheus-client (>= 0.16)",
    "PyYAML": "python3-yaml (>= 6.0)",
    "pyelftools": "python3-pyelftools (>= 0.29)",
    # GPU evidence (memory, utilisation, the gpu target): "NVML not available: the
    # nvidia-ml-py package is not installed" in hangwatch_collector_success{collector="gpu"}.
    "nvidia-ml-py": None,
    # Python stacks: "py-spy is not installed" in the report, the verdicts unchanged.
    "py-spy": None,
}
# bcc is only ever the distribution's (the PyPI "bcc" is another project), so not in pyproject.
# procps: the unit's ExecReload= is /bin/kill (a minimal root has none). adduser: postinst
# makes the status socket's group with addgroup, as Debian's packages make system groups.
DEPENDS = (
    "python3 (>= 3.11)",
    "python3-bpfcc",
    *(d for d in DEBIAN_NAMES.values() if d),
    "procps",
    "adduser",
)
RECOMMENDS = ("python3-bcrypt",)  # basic auth on /metrics (--web-config) needs it

DESCRIPTION = """\
eBPF agent: is an inference server deadlocked, stalled, idle or progressing?
 hangwatch tells, with evidence, whether a process that looks hung (GPU memory
 held, 0% utilisation, no answer, every thread in futex) is deadlocked, stalled,
 idle or progressing. `hangwatch diagnose --pid PID` reports once;
 `hangwatch run`, the systemd unit this package installs, serves Prometheus
 metrics on :9817.
 .
 bcc compiles the BPF programs when they load and needs the running kernel's
 headers (linux-headers-$(uname -r)). Python stacks need py-spy and GPU evidence
 nvidia-ml-py, which Debian does not package; without them the verdicts stand
 and the report says what is missing."""

MAINTAINER_FALLBACK = "hangwatch maintainers"


def run(argv: list[str], cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
    r = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise SystemExit(f"package: {' '.join(argv)} failed ({r.returncode}):\n{r.stderr}")
    return r.stdout


def version() -> str:
    """agent/__init__.py's __version__, read without importing it (as setuptools does)."""
    tree = ast.parse((REPO_ROOT / "agent" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets
        ):
            value = ast.literal_eval(node.value)
            if isinstance(value, str):
                return value
    raise SystemExit("package: no __version__ in agent/__init__.py")


def debian_version(v: str) -> str:
    """PEP 440 to Debian: a pre-release sorts before its release there only after a '~'."""
    return re.sub(r"\.?(a|b|rc|dev)(\d*)", r"~\1\2", v)


def checkout_files() -> list[str]:
    if git_commit(REPO_ROOT) is None:
        raise SystemExit(f"package: {REPO_ROOT} is not a git checkout (or git is missing)")
    out = run(["git", "-C", str(REPO_ROOT), "ls-files", "-z", "-co", "--exclude-standard"])
    # A tracked file deleted in the working tree is not part of what is built.
    return sorted(p for p in set(out.split("\0")) if p and (REPO_ROOT / p).is_file())


def copy_tree(dest: Path, commit: str) -> None:
    for rel in checkout_files():
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO_ROOT / rel, target, follow_symlinks=False)
    (dest / "agent" / "_build.py").write_text(
        f'"""Written by scripts/package.py: the commit this package was built from."""\n\n'
        f"COMMIT = {commit!r}\n"
    )


def pep517(src: Path, out: Path) -> tuple[Path, Path]:
    """The sdist and the wheel, by the backend's own hooks, in a child working in ``src``."""
    code = (
        "import sys\n"
        "from setuptools import build_meta as backend\n"
        "out = sys.argv[1]\n"  # read first: each hook replaces sys.argv with its own
        "sdist = backend.build_sdist(out)\n"
        "wheel = backend.build_wheel(out)\n"
        "print('BUILT', sdist, wheel)\n"  # after setuptools' own lines on stdout
    )
    said = run([sys.executable, "-c", code, str(out)], cwd=src).splitlines()
    built = [ln.split() for ln in said if ln.startswith("BUILT ")]
    if len(built) != 1 or len(built[0]) != 3:
        raise SystemExit(f"package: the backend did not say what it built:\n{said[-20:]}")
    return out / built[0][1], out / built[0][2]


def maintainer() -> str:
    """DEBFULLNAME and DEBEMAIL, as Debian's own tools read them, for whoever ships the
    package; else the project's name alone."""
    name, email = os.environ.get("DEBFULLNAME"), os.environ.get("DEBEMAIL")
    if email:
        return f"{name or MAINTAINER_FALLBACK} <{email}>"
    return MAINTAINER_FALLBACK


def packaged_unit(text: str) -> str:
    """deploy/systemd/hangwatch.service as the package installs it: run /usr/bin/hangwatch,
    documented under /usr/share/doc. Every other line is the checkout's unit, unchanged."""
    header, sep, rest = text.partition("# Change settings with a drop-in")
    if not sep:
        raise SystemExit("package: the unit's header no longer ends where it did")
    header = (
        "# hangwatch: the daemon (`hangwatch run`), as the hangwatch package installs it.\n"
        "#\n"
        "# The package enables and starts it where systemd runs (not in a chroot or an\n"
        "# image build: there, `systemctl enable hangwatch`). Its config:\n"
        f"# {CONFIG} (a conffile). Then:\n"
        "#   systemctl reload hangwatch        # after editing the config\n"
        "#   curl -s localhost:9817/metrics | grep hangwatch_service_state\n"
        "#\n"
    )
    out = header + sep + rest
    for old, new in (
        ("/opt/hangwatch/.venv/bin/hangwatch", "/usr/bin/hangwatch"),
        (
            "Documentation=file:///opt/hangwatch/README.md file:///opt/hangwatch/docs/install.md",
            f"Documentation=file://{DOC_DIR}/README.md file://{DOC_DIR}/docs/install.md",
        ),
        (
            "# /opt/hangwatch is read-only here: do not even try to write __pycache__.",
            f"# {PRIVATE_DIR} is read-only here; the package compiled its modules at install.",
        ),
    ):
        if old not in out:
            raise SystemExit(f"package: the unit has no {old!r} any more")
        out = out.replace(old, new)
    if "/opt/hangwatch" in out:
        raise SystemExit("package: the unit still names /opt/hangwatch")
    return out


LAUNCHER = f"""\
#!/usr/bin/python3
# hangwatch, as the Debian package installs it: its modules are private to the package.
import sys

sys.path.insert(0, {PRIVATE_DIR!r})
from agent.cli import main  # noqa: E402

sys.exit(main())
"""

# Starts nothing without a running systemd: in a chroot or an image build there is none.
POSTINST = """\
#!/bin/sh
set -e
if [ "$1" = configure ]; then
    # The status socket's group (status_group's default): its members may run `hangwatch
    # status` without root. Made once; an admin's own group of that name is kept as it is.
    if ! getent group hangwatch >/dev/null; then
        addgroup --system --quiet hangwatch
    fi
    # Compiled once here, as dh_python3 does for an application's private modules; prerm
    # removes them again.
    if command -v py3compile >/dev/null 2>&1; then
        py3compile -p hangwatch /usr/share/hangwatch
    fi
    if [ -d /run/systemd/system ]; then
        systemctl --system daemon-reload >/dev/null || true
        if [ -z "$2" ]; then
            # A first install: enabled and started, like node_exporter's package.
            systemctl enable hangwatch.service >/dev/null 2>&1 || true
            systemctl start hangwatch.service || true
        else
            # An upgrade: the new code runs where the old ran; a disabled unit stays so.
            systemctl try-restart hangwatch.service || true
        fi
    fi
fi
exit 0
"""

PRERM = """\
#!/bin/sh
set -e
if [ "$1" = remove ]; then
    if [ -d /run/systemd/system ]; then
        systemctl stop hangwatch.service || true
    fi
    # Offline too (an image that enabled it): only the enablement link, no running systemd.
    if command -v systemctl >/dev/null 2>&1; then
        systemctl disable hangwatch.service >/dev/null 2>&1 || true
    fi
fi
if command -v py3clean >/dev/null 2>&1; then
    py3clean -p hangwatch
else
    find /usr/share/hangwatch -type d -name __pycache__ -prune -exec rm -rf {} +
fi
exit 0
"""

# dpkg itself removes the conffile at purge; this makes systemd forget the unit and, at purge,
# removes the group postinst made unless an admin has put someone in it.
POSTRM = """\
#!/bin/sh
set -e
if [ "$1" = remove ] || [ "$1" = purge ]; then
    if [ -d /run/systemd/system ]; then
        systemctl --system daemon-reload >/dev/null || true
    fi
fi
if [ "$1" = purge ] && command -v delgroup >/dev/null 2>&1; then
    if getent group hangwatch >/dev/null; then
        delgroup --system --only-if-empty --quiet hangwatch || true
    fi
fi
exit 0
"""

COPYRIGHT = """\
Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: hangwatch

Files: *
Copyright: the hangwatch authors
License: Apache-2.0
 On Debian systems, the full text of the Apache License, Version 2.0, is in
 /usr/share/common-licenses/Apache-2.0.
"""


def _put(root: Path, path: str, data: bytes | str, mode: int = 0o644) -> Path:
    target = root / path.lstrip("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data.encode() if isinstance(data, str) else data)
    target.chmod(mode)
    return target


def stage_deb(stage: Path, wheel: Path, deb_version: str, epoch: int) -> None:
    """The .deb's tree under ``stage``: the wheel's agent/, the launcher, the unit, the
    config, the docs, and DEBIAN/ with the control file and maintainer scripts."""
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            if info.filename.startswith("agent/") and not info.is_dir():
                _put(stage, f"{PRIVATE_DIR}/{info.filename}", z.read(info))
    _put(stage, "/usr/bin/hangwatch", LAUNCHER, 0o755)
    _put(stage, UNIT, packaged_unit((REPO_ROOT / "deploy/systemd/hangwatch.service").read_text()))
    _put(stage, CONFIG, (REPO_ROOT / "deploy/systemd/hangwatch.yaml").read_bytes())
    for doc in DOCS:
        for path in (
            [REPO_ROOT / doc] if doc.endswith(".md") else sorted((REPO_ROOT / doc).glob("*.md"))
        ):
            _put(stage, f"{DOC_DIR}/{path.relative_to(REPO_ROOT)}", path.read_bytes())
    changelog = gzip.compress((REPO_ROOT / "CHANGELOG.md").read_bytes(), 9, mtime=epoch)
    _put(stage, f"{DOC_DIR}/changelog.gz", changelog)
    _put(stage, f"{DOC_DIR}/copyright", COPYRIGHT)

    files = sorted(p for p in stage.rglob("*") if p.is_file())
    installed_kib = sum((p.stat().st_size + 1023) // 1024 for p in files) + len(
        {p.parent for p in files}
    )
    md5sums = "".join(
        f"{hashlib.md5(p.read_bytes()).hexdigest()}  {p.relative_to(stage)}\n" for p in files
    )
    control = (
        f"Package: {NAME}\n"
        f"Version: {deb_version}\n"
        "Architecture: all\n"
        f"Maintainer: {maintainer()}\n"
        f"Installed-Size: {installed_kib}\n"
        f"Depends: {', '.join(DEPENDS)}\n"
        f"Recommends: {', '.join(RECOMMENDS)}\n"
        "Section: admin\n"
        "Priority: optional\n"
        f"Description: {DESCRIPTION}\n"
    )
    _put(stage, "DEBIAN/control", control)
    _put(stage, "DEBIAN/conffiles", f"{CONFIG}\n")
    _put(stage, "DEBIAN/md5sums", md5sums)
    for script, text in (("postinst", POSTINST), ("prerm", PRERM), ("postrm", POSTRM)):
        _put(stage, f"DEBIAN/{script}", text, 0o755)
    for d in [stage, *(p for p in stage.rglob("*") if p.is_dir())]:
        d.chmod(0o755)
    for p in stage.rglob("*"):
        os.utime(p, (epoch, epoch), follow_symlinks=False)


def commit_time() -> int:
    r = subprocess.run(
        ["git", "-C", str(REPO_ROOT), "log", "-1", "--format=%ct"],
        capture_output=True,
        text=True,
        check=False,
    )
    return int(r.stdout) if r.returncode == 0 and r.stdout.strip().isdigit() else int(time.time())


def build(out: Path) -> tuple[list[Path], str]:
    """Build the three into ``out``: their paths (sdist, wheel, .deb) and the commit stamped."""
    if shutil.which("dpkg-deb") is None:
        raise SystemExit("package: dpkg-deb is missing (apt-get install dpkg)")
    # "-dirty" when a tracked file differs from HEAD: the build is not HEAD's alone.
    commit = git_commit(REPO_ROOT, dirty=True) or "unknown"
    v = version()
    # One timestamp for every file: the last commit's, so that two builds of it compare.
    epoch = int(os.environ.get("SOURCE_DATE_EPOCH") or commit_time())
    os.environ["SOURCE_DATE_EPOCH"] = str(epoch)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="hangwatch-package-") as tmp:
        src, built, stage = Path(tmp, "src"), Path(tmp, "built"), Path(tmp, "deb")
        copy_tree(src, commit)
        built.mkdir()
        sdist, wheel = pep517(src, built)
        deb_name = f"{NAME}_{debian_version(v)}_all.deb"
        stage_deb(stage, wheel, debian_version(v), epoch)
        run(
            ["dpkg-deb", "--root-owner-group", "-Zxz", "--build", str(stage), str(built / deb_name)]
        )
        results = []
        for f in (sdist, wheel, built / deb_name):
            shutil.copy2(f, out / f.name)
            results.append(out / f.name)
    return results, commit


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "dist", help="default: dist/")
    args = parser.parse_args()
    began = time.monotonic()
    paths, commit = build(args.out.resolve())
    for p in paths:
        shown = os.path.relpath(p) if p.is_relative_to(Path.cwd()) else str(p)
        print(f"package: {shown} ({p.stat().st_size // 1024} KiB)")
    print(f"package: {version()} (commit {commit}) in {time.monotonic() - began:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
