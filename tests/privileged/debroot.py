"""A clean Debian root to install a package into: made once by the distribution's mmdebstrap
from this machine's own apt mirror, cached as a tarball, unpacked fresh for every use.

The cached tarball (``$HANGWATCH_ROOTFS_DIR``, default /var/cache/hangwatch/rootfs) is keyed by
suite, architecture, mirrors and the packages it was asked to carry: minbase with systemd (so
that ``systemctl`` and ``systemd-analyze`` work offline in it), apt's package lists, and the
.debs of the packages named, downloaded but not installed. Installing those later needs no
network. The first creation needs the mirror (about 25 s here); later runs only unpack.

A root's mounts (/proc, /dev, /sys, tracefs, debugfs, /usr/src, /usr/lib/modules: what bcc
needs to compile in it) are undone in ``Root.close``, and the tree is deleted only once
/proc/self/mountinfo shows nothing mounted below it: a bind mount left there would take the
host's files with it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

CACHE_DIR = Path(os.environ.get("HANGWATCH_ROOTFS_DIR", "/var/cache/hangwatch/rootfs"))
CREATE_TIMEOUT_S = 900
ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG": "C.UTF-8",
    "DEBIAN_FRONTEND": "noninteractive",
}
# Mounted into the root in this order (unmounted in reverse); those the host lacks are skipped.
MOUNTS = (
    "proc",
    "dev",
    "dev/pts",
    "sys",
    "sys/kernel/tracing",
    "sys/kernel/debug",
    "usr/src",  # kernel headers: linux-headers-*, and setup's merged fallback tree
    "usr/lib/modules",  # /lib/modules/$(uname -r)/build, where the running kernel has one
)
# Not compared before and after an install: mounts, apt's and dpkg's own state, caches, logs.
VOLATILE = {
    *MOUNTS,
    "run",
    "tmp",
    "var/tmp",
    "var/cache",
    "var/log",
    "var/lib/apt",
    "var/lib/dpkg",
}
REQUIRED_TOOLS = ("mmdebstrap", "dpkg-deb", "chroot", "mount", "umount", "tar", "git")


def missing_tools() -> str | None:
    gone = [t for t in REQUIRED_TOOLS if shutil.which(t) is None]
    if gone:
        return f"missing {', '.join(gone)} (scripts/setup.sh --tests installs mmdebstrap)"
    return None


def host_suite() -> str | None:
    """This machine's Debian codename (bookworm) from /etc/os-release; None if not Debian."""
    fields = {}
    for line in Path("/etc/os-release").read_text().splitlines():
        key, _, value = line.partition("=")
        fields[key] = value.strip().strip('"')
    if fields.get("ID") != "debian":
        return None
    return fields.get("VERSION_CODENAME") or None


def _sources_entries(apt_dir: Path) -> Iterator[tuple[str, list[str], list[str], list[str]]]:
    """(type, URIs, suites, components) of every entry, one-line and deb822 formats alike."""
    files = [apt_dir / "sources.list", *sorted((apt_dir / "sources.list.d").glob("*"))]
    for f in files:
        if not f.is_file():
            continue
        text = f.read_text(errors="replace")
        if f.suffix == ".sources":
            for stanza in re.split(r"\n\s*\n", text):
                fields: dict[str, str] = {}
                for line in stanza.splitlines():
                    if line.startswith("#") or ":" not in line or line[:1].isspace():
                        continue
                    key, value = line.split(":", 1)
                    fields[key.strip().lower()] = value.strip()
                if fields.get("enabled", "yes").lower() == "no":
                    continue
                for kind in fields.get("types", "").split():
                    yield (
                        kind,
                        fields.get("uris", "").split(),
                        fields.get("suites", "").split(),
                        fields.get("components", "").split(),
                    )
        elif f.suffix == ".list":
            for line in text.splitlines():
                line = re.sub(r"\[[^]]*\]", " ", line.split("#", 1)[0]).split()
                if len(line) >= 4:
                    yield line[0], [line[1]], [line[2]], line[3:]


def host_mirrors(suite: str, apt_dir: Path = Path("/etc/apt")) -> list[str]:
    """One-line sources of ``suite``, ``suite``-updates and ``suite``-security, component main,
    as this machine's apt has them: the mirror it uses, not one picked here."""
    wanted = (suite, f"{suite}-updates", f"{suite}-security")
    found: list[str] = []
    for kind, uris, suites, comps in _sources_entries(apt_dir):
        if kind != "deb" or "main" not in comps:
            continue
        for uri in uris:
            for s in suites:
                line = f"deb {uri} {s} main"
                if s in wanted and line not in found:
                    found.append(line)
    # The suite itself first: mmdebstrap takes its first mirror's suite as the one to make.
    return sorted(found, key=lambda ln: wanted.index(ln.split()[2]))


def _arch() -> str:
    return subprocess.run(
        ["dpkg", "--print-architecture"], capture_output=True, text=True, check=True
    ).stdout.strip()


def base_tarball(suite: str, mirrors: Sequence[str], packages: Sequence[str]) -> Path:
    """The cached root of ``suite``, made now if there is none; ``packages`` are downloaded
    into it (with their dependencies and recommends), not installed."""
    arch = _arch()
    key = hashlib.sha256("\n".join([*mirrors, *sorted(packages)]).encode()).hexdigest()[:12]
    path = CACHE_DIR / f"{suite}-{arch}-{key}.tar"
    if path.is_file():
        return path
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    with (CACHE_DIR / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another run may be making the same one
        if path.is_file():
            return path
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        hook = (
            'chroot "$1" env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin apt-get install -qq '
            "--download-only -y -o APT::Install-Recommends=true " + " ".join(sorted(packages))
        )
        argv = [
            "mmdebstrap",
            "--variant=minbase",
            "--include=systemd",
            "--skip=cleanup/apt/lists",  # so that apt inside can resolve without the network
            "--skip=cleanup/apt/cache",  # and install what the hook downloaded
            f"--customize-hook={hook}",
            "--format=tar",
            suite,
            str(tmp),
            *mirrors,
        ]
        try:
            r = subprocess.run(
                argv, capture_output=True, text=True, timeout=CREATE_TIMEOUT_S, check=False
            )
            if r.returncode != 0:
                raise RuntimeError(
                    f"mmdebstrap failed ({r.returncode}): {' '.join(argv)}\n{r.stderr[-4000:]}"
                )
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        # One per suite and architecture: the others were made for other packages or mirrors.
        for old in CACHE_DIR.glob(f"{suite}-{arch}-*.tar"):
            if old != path:
                old.unlink(missing_ok=True)
    return path


def mounts_below(root: Path) -> list[str]:
    """Mount points at or below ``root``, from /proc/self/mountinfo (octal escapes undone)."""
    prefix = str(root).rstrip("/")
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), line.split()[4])
        if point == prefix or point.startswith(prefix + "/"):
            found.append(point)
    return found


class Root:
    """A fresh copy of a cached root, with the mounts bcc needs; ``close`` undoes them."""

    def __init__(self, tarball: Path) -> None:
        # Not under pytest's tmp_path: pytest deletes old ones by itself, and a mount left
        # in one would take the host's files with it. Here only close() deletes it.
        self.path = Path(tempfile.mkdtemp(prefix="hangwatch-root-", dir="/var/tmp")).resolve()
        self.mounted: list[Path] = []
        try:
            subprocess.run(
                ["tar", "-xf", str(tarball), "-C", str(self.path), "--numeric-owner"],
                check=True,
                capture_output=True,
                timeout=300,
            )
        except BaseException:
            shutil.rmtree(self.path)  # nothing is mounted yet
            raise
        for rel in MOUNTS:
            # Made now, before anything is compared: they are part of the root's "before".
            (self.path / rel).mkdir(parents=True, exist_ok=True)

    def mount(self) -> None:
        for rel in MOUNTS:
            host = Path("/") / rel
            if not host.is_dir() or (rel.startswith("sys/kernel/") and not _is_mounted(host)):
                continue
            target = self.path / rel
            subprocess.run(["mount", "--bind", str(host), str(target)], check=True, timeout=30)
            self.mounted.append(target)

    def unmount(self) -> None:
        while self.mounted:
            target = self.mounted.pop()
            r = subprocess.run(["umount", str(target)], capture_output=True, timeout=30)
            if r.returncode != 0:  # busy: detach it now, it goes when its last user does
                subprocess.run(["umount", "-l", str(target)], capture_output=True, timeout=30)

    def close(self) -> None:
        self.unmount()
        left = mounts_below(self.path)
        if left:
            raise RuntimeError(f"still mounted, so {self.path} was NOT deleted: {left}")
        shutil.rmtree(self.path)

    def run(
        self, argv: Sequence[str], *, timeout: float = 300, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """``argv`` inside the root, with a clean environment; never raises on its status."""
        return subprocess.run(
            self.argv(argv, env),
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
            check=False,
        )

    def argv(self, argv: Sequence[str], env: dict[str, str] | None = None) -> list[str]:
        pairs = [f"{k}={v}" for k, v in {**ENV, **(env or {})}.items()]
        return ["chroot", str(self.path), "env", "-i", *pairs, *argv]

    def files(self) -> set[str]:
        """Every path in the root but the VOLATILE ones, relative, directories with a '/'."""
        found: set[str] = set()
        for dirpath, dirnames, filenames in os.walk(self.path):
            rel_dir = os.path.relpath(dirpath, self.path)
            rel_dir = "" if rel_dir == "." else rel_dir + "/"
            dirnames[:] = [d for d in dirnames if rel_dir + d not in VOLATILE]
            found.update(rel_dir + d + "/" for d in dirnames)
            found.update(rel_dir + f for f in filenames)
        return found


def _is_mounted(path: Path) -> bool:
    return str(path) in mounts_below(path)


@contextlib.contextmanager
def fresh_root(tarball: Path) -> Iterator[Root]:
    root = Root(tarball)
    try:
        root.mount()
        yield root
    finally:
        root.close()
