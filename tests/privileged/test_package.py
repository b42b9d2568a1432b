"""The release as a user installs it: `make package`'s .deb put into a clean Debian root by
apt, run there as its systemd unit runs it, asked `hangwatch status` as root, as a member of
the group the package makes and as an outsider, removed leaving only its config (and the
group) and purged leaving nothing; and its wheel in a fresh venv that sees the distribution's bcc.

The root is tests/privileged/debroot.py's: made by mmdebstrap from this machine's apt mirror
once, then cached (the first run needs the mirror). The wheel's venv installs its
dependencies with pip (PyPI). 30 to 40 s on 2 cores once the root is cached.
"""

from __future__ import annotations

import configparser
import functools
import json
import shlex
import shutil
import signal
import stat
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from agent import __version__
from scripts.daemonproc import Samples, first_tick_done, free_port, parse, value
from scripts.fixturelib import REPO_ROOT, Fixture
from tests.gate import require
from tests.limits import HANG_S
from tests.packagebuild import make_package
from tests.privileged import debroot
from tests.privileged.harness import RunningDiagnose

CANNOT = "the package test cannot run"
UNIT = "lib/systemd/system/hangwatch.service"
CONFIG = "etc/hangwatch/hangwatch.yaml"


@dataclass(frozen=True)
class Built:
    wheel: Path
    sdist: Path
    deb: Path
    version: str
    commit: str


def git(*args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True, check=True
    ).stdout.strip()


def expected_commit() -> str:
    """What the build must have stamped: HEAD, "-dirty" when a tracked file differs."""
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return git("rev-parse", "--short", "HEAD") + ("-dirty" if dirty else "")


@functools.lru_cache(maxsize=1)
def build(out: Path) -> Built:
    """The script `make package` runs, into ``out`` (not the checkout's dist/), once."""
    began = time.monotonic()
    wheel, sdist, deb = make_package(out)
    print(f"package built in {time.monotonic() - began:.1f} s")
    assert deb.name == f"hangwatch_{__version__}_all.deb", deb
    return Built(wheel, sdist, deb, __version__, expected_commit())


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("dist")


def ok(r: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert r.returncode == 0, f"{shlex.join(r.args)} exited {r.returncode}:\n{r.stdout}\n{r.stderr}"
    return r


def dependency_names(deb: Path) -> list[str]:
    """The packages the .deb's Depends and Recommends name (first of any alternatives)."""
    fields = ok(
        subprocess.run(
            ["dpkg-deb", "-f", str(deb), "Depends", "Recommends"],
            capture_output=True,
            text=True,
            check=False,
        )
    ).stdout
    names = []
    for line in fields.splitlines():
        for dep in line.split(":", 1)[1].split(","):
            names.append(dep.split("|")[0].split("(")[0].strip())
    return sorted(set(filter(None, names)))


def unit_service(path: Path) -> configparser.SectionProxy:
    parser = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # keys are case-sensitive
    parser.read_string(path.read_text())
    return parser["Service"]


def unit_environment(svc: configparser.SectionProxy) -> dict[str, str]:
    """The unit's Environment= assignments (one line here; systemd allows several)."""
    return dict(w.split("=", 1) for w in shlex.split(svc.get("Environment", "")) if "=" in w)


def scrape(port: int) -> Samples | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return parse(r.read().decode())
    except OSError:
        return None


def first_tick(proc: subprocess.Popen[bytes], port: int, log: Path, timeout: float) -> Samples:
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, f"the daemon exited {proc.returncode}:\n{log.read_text()}"
        samples = scrape(port)
        if samples is not None and first_tick_done(samples):
            return samples
        assert time.monotonic() < deadline, f"no first tick in {timeout} s:\n{log.read_text()}"
        time.sleep(0.2)


def stop(proc: subprocess.Popen[bytes]) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def preconditions() -> tuple[str, list[str]]:
    """The host's suite and mirrors; skipped (failed under CI) without them or the tools."""
    require(debroot.missing_tools(), CANNOT)
    suite = debroot.host_suite()
    require(None if suite else "this machine is not Debian: no suite to make a root of", CANNOT)
    assert suite is not None
    mirrors = debroot.host_mirrors(suite)
    require(None if mirrors else f"no 'deb ... {suite} main' in /etc/apt/sources.list*", CANNOT)
    return suite, mirrors


def group_line(root: debroot.Root) -> str | None:
    """The root's /etc/group line for the status socket's group, or None."""
    r = root.run(["getent", "group", "hangwatch"])
    return r.stdout.strip() if r.returncode == 0 else None


def status_as_the_package_made_it(root: debroot.Root, daemon_pid: int) -> None:
    """`hangwatch status` on the socket the default config names: answered to root and to a
    member of the group postinst made, without root; refused, with the fix, to others."""
    line = group_line(root)
    assert line is not None, "postinst made no hangwatch group"
    gid = int(line.split(":")[2])
    r = ok(root.run(["hangwatch", "status", "--json"], timeout=HANG_S))
    doc = json.loads(r.stdout)
    assert doc["version"] == 1 and doc["daemon"]["pid"] == daemon_pid, doc
    sock = root.path / "run/hangwatch/status.sock"
    st = sock.lstat()
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o660, oct(st.st_mode)
    assert (st.st_uid, st.st_gid) == (0, gid)
    member = ["setpriv", "--reuid=65534", "--regid=65534", f"--groups={gid}"]
    r = ok(root.run([*member, "hangwatch", "status", "--json"], timeout=HANG_S))
    assert json.loads(r.stdout)["daemon"]["pid"] == daemon_pid
    outsider = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    r = root.run([*outsider, "hangwatch", "status"], timeout=HANG_S)
    assert r.returncode == 3, f"{r.returncode}:\n{r.stdout}\n{r.stderr}"
    assert "usermod -aG hangwatch " in r.stderr, r.stderr


def test_the_deb_installs_runs_as_its_unit_and_leaves_only_its_config(
    dist: Path, tmp_path: Path
) -> None:
    suite, mirrors = preconditions()
    b = build(dist)
    deps = dependency_names(b.deb)
    assert {"python3", "python3-bpfcc", "python3-yaml", "python3-prometheus-client"} <= set(deps)
    tarball = debroot.base_tarball(suite, mirrors, deps)
    began = time.monotonic()
    with debroot.fresh_root(tarball) as root, Fixture.c("deadlock_mutex") as fx:
        # The dependencies first, by the names the .deb gives, so that "before" has them:
        # what the comparisons below must find is the package's own files, nothing else.
        ok(root.run(["apt-get", "install", "-y", "-q", *deps]))
        before = root.files()
        shutil.copy(b.deb, root.path / "tmp")
        r = ok(root.run(["apt-get", "install", "-y", "-q", f"/tmp/{b.deb.name}"]))
        assert "0 upgraded, 1 newly installed" in r.stdout, r.stdout

        # The command, and the build it says it is.
        said = ok(root.run(["hangwatch", "--version"])).stdout
        assert said == f"hangwatch {b.version} (commit {b.commit})\n"
        ok(root.run(["hangwatch", "diagnose", "--help"]))
        conffiles = ok(root.run(["dpkg-query", "-W", "-f=${Conffiles}", "hangwatch"])).stdout
        assert f"/{CONFIG} " in conffiles, conffiles
        assert (root.path / CONFIG).read_bytes() == (
            REPO_ROOT / "deploy/systemd/hangwatch.yaml"
        ).read_bytes()

        # The unit: systemd accepts it as installed (its ExecStart exists and runs).
        verify = root.run(["systemd-analyze", "verify", f"/{UNIT}"])
        assert verify.returncode == 0 and not verify.stderr.strip(), verify.stderr
        svc = unit_service(root.path / UNIT)
        exec_start = shlex.split(svc["ExecStart"])
        assert exec_start[:2] == ["/usr/bin/hangwatch", "run"], exec_start

        # The daemon as the unit starts it, on a free port instead of :9817.
        port = free_port()
        log = tmp_path / "daemon.log"
        with log.open("wb") as out:
            daemon = subprocess.Popen(
                root.argv([*exec_start, "--listen", f"127.0.0.1:{port}"], unit_environment(svc)),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        try:
            samples = first_tick(daemon, port, log, timeout=HANG_S)
            build_info = value(samples, "hangwatch_build_info", version=b.version, commit=b.commit)
            assert build_info == 1, {k: v for k, v in samples.items() if "build_info" in k[0]}
            status_as_the_package_made_it(root, daemon.pid)
        finally:
            status = stop(daemon)
        assert status == 0, log.read_text()
        assert f"hangwatch {b.version} (commit {b.commit})" in log.read_text()

        # diagnose from inside the root, of a process outside it (the host's /proc).
        argv = ["hangwatch", "diagnose", "--pid", str(fx.pid), "--json", "--threshold", "1"]
        d = RunningDiagnose(root.argv([*argv, "--duration", "2"])).finish(timeout=HANG_S)
        assert d.service(fx.pid).get("state") == "deadlocked", d.explain("want deadlocked")

        # Enabled offline, as an image build would: removal must take the link too.
        ok(root.run(["systemctl", "enable", "hangwatch.service"]))
        wants = root.path / "etc/systemd/system/multi-user.target.wants/hangwatch.service"
        assert wants.is_symlink()

        ok(root.run(["apt-get", "remove", "-y", "-q", "hangwatch"]))
        after = root.files()
        assert (after - before, before - after) == ({"etc/hangwatch/", CONFIG}, set())
        assert group_line(root), "remove took the group; only purge does"

        ok(root.run(["apt-get", "purge", "-y", "-q", "hangwatch"]))
        after = root.files()
        assert (after - before, before - after) == (set(), set())
        assert group_line(root) is None, "purge left the group postinst made"
        status_word = root.run(["dpkg-query", "-W", "-f=${db:Status-Status}", "hangwatch"])
        assert status_word.stdout in ("", "not-installed"), status_word
    print(f"root: install, run, diagnose, remove and purge in {time.monotonic() - began:.1f} s")


def test_the_wheel_installs_into_a_venv_that_sees_the_distributions_bcc(
    dist: Path, tmp_path: Path
) -> None:
    require(None if shutil.which("dpkg-deb") else "dpkg-deb is missing", CANNOT)
    b = build(dist)
    venv = tmp_path / "venv"
    ok(
        subprocess.run(
            ["/usr/bin/python3", "-m", "venv", "--system-site-packages", str(venv)],
            capture_output=True,
            text=True,
            check=False,
        )
    )
    # Its dependencies from PyPI where the distribution has none (py-spy, nvidia-ml-py).
    ok(
        subprocess.run(
            [
                *(str(venv / "bin/pip"), "install", "-q", "--disable-pip-version-check"),
                *("--no-cache-dir", str(b.wheel)),  # no cache in the home directory
            ],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
    )

    def venv_run(*argv: str) -> str:
        # Outside the checkout, so that nothing of it can be imported by accident.
        r = subprocess.run(
            argv, cwd=tmp_path, capture_output=True, text=True, timeout=HANG_S, check=False
        )
        return ok(r).stdout

    assert venv_run(str(venv / "bin/hangwatch"), "--version") == (
        f"hangwatch {b.version} (commit {b.commit})\n"
    )
    assert "--pid PID" in venv_run(str(venv / "bin/hangwatch"), "diagnose", "--help")
    where = venv_run(
        str(venv / "bin/python"),
        "-c",
        "import bcc, agent.abi as a, agent.sources.probe as p; print(bcc.__file__); "
        "print(a.BPF_DIR); print(all((a.BPF_DIR / n).is_file() for n in p.BPF_SOURCES))",
    ).split()
    assert where[0].startswith("/usr/lib/python3/dist-packages/"), where
    assert where[1].startswith(str(venv)) and where[1].endswith("/agent/bpf"), where
    assert where[2] == "True", where
