"""Attacks on the agent's rights: a watched process names a file it may not read, and hopes
that hangwatch, root, reads it for it.

Two targets, parked for good (each thread in ``lock.acquire()`` at line 2 of code compiled
under a file name of its choosing, the main thread joining them: a hang proven without an
owner, so the daemon's flight record is written at once):

* run as ``nobody``, naming a root-only file by its absolute path, through ``..``, and
  through a symlink to it, and naming a file of its own that it may read;
* run as root in a chroot of its own mount namespace (a container without the image),
  naming ``/app.py``, an absolute symlink to the same root-only host file: inside its root
  that leads nowhere, however many rights the target has.

No byte of the protected file may appear in ``diagnose`` (JSON or text) or in the daemon's
log; the target's own readable line must, and each withheld frame says why.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from scripts.fixturelib import AS_NOBODY, REPO_ROOT, SYSTEM_PYTHON, Fixture
from tests.limits import HANG_S
from tests.privileged.daemonlib import INTERVAL, free_port, running_daemon, value, wait_until
from tests.privileged.harness import RunningDiagnose, diagnose_argv
from tests.privileged.test_security import CAPS, with_caps

# one worker: its daemon selects its targets by a mark the other tests' targets carry
pytestmark = pytest.mark.xdist_group("privileged-confinement")

PYTHON = SYSTEM_PYTHON  # present in the chroot through its /usr
NOBODY = AS_NOBODY
MARK = "hangwatch-confinement-target"  # in the command line, for the daemon's selector
PARKED_LINE = "lock.acquire()  # parked here"
PARK = f"def park(lock):\n    {PARKED_LINE}\n"
TARGET = f"""
# {MARK}
import sys, threading, time
PARK = {PARK!r}
def run(name, lock):
    ns = {{}}
    exec(compile(PARK, name, "exec"), ns)
    ns["park"](lock)
threads = []
for name in sys.argv[1:]:
    lock = threading.Lock()
    lock.acquire()
    t = threading.Thread(target=run, args=(name, lock), name="parked")
    t.start()
    threads.append(t)
print("READY", flush=True)
for t in threads:
    t.join()
"""


def parked(pid: int, threads: int, timeout: float = 10) -> None:
    """Wait until ``threads`` threads of ``pid`` (all of them) sleep in futex(2)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        tids = os.listdir(f"/proc/{pid}/task")
        asleep = 0
        for tid in tids:
            try:
                state = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rpartition(")")[2]
                nr = Path(f"/proc/{pid}/task/{tid}/syscall").read_text().split()[0]
            except (OSError, IndexError):
                continue
            asleep += state.split()[0] == "S" and nr == "202"
        if len(tids) == threads and asleep == threads:
            return
        time.sleep(0.05)
    raise AssertionError(f"process {pid}: not all {threads} threads asleep in futex")


class World:
    """The protected file, the names that point at it, and the two targets."""

    def __init__(self, private: Path, shared: Path) -> None:
        self.token = secrets.token_hex(8)
        # Root only: mode 0600 in a directory only root may search.
        self.secret = private / "secret"
        self.secret.write_text(f"SECRET-1-{self.token}\n    {PARKED_LINE} SECRET-2-{self.token}\n")
        self.secret.chmod(0o600)
        self.own = shared / "own.py"  # the nobody target's own file: it may read it
        self.own.write_text(PARK)
        self.own.chmod(0o644)
        self.link = shared / "link.py"
        self.link.symlink_to(self.secret)
        self.names = {
            str(self.secret): "not readable by the target",
            "/usr/../" + str(self.secret).lstrip("/"): "not readable by the target",
            str(self.link): "not readable by the target",
            str(self.own): None,
        }
        # The chroot: /usr bound in, the usual merged-/usr links, its own readable file, and
        # /app.py an absolute symlink to the host's protected file.
        self.jail = shared / "jail"
        for d in ("usr", "tmp", "root"):
            (self.jail / d).mkdir(parents=True)
        for name, to in (("bin", "usr/bin"), ("lib", "usr/lib"), ("lib64", "usr/lib64")):
            (self.jail / name).symlink_to(to)
        (self.jail / "own.py").write_text(PARK)
        (self.jail / "app.py").symlink_to(self.secret)
        self.jail_names = {"/app.py": "no such file in the target's root", "/own.py": None}

    def nobody(self) -> Fixture:
        return Fixture([*NOBODY, PYTHON, "-c", TARGET, *self.names], timeout=30)

    def jailed(self) -> Fixture:
        script = f'mount --bind /usr "$1/usr" && exec chroot "$1" {PYTHON} -c "$2" /app.py /own.py'
        argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh"]
        return Fixture([*argv, str(self.jail), TARGET], timeout=30)

    def leaked(self, text: str) -> bool:
        return self.token in text or "SECRET-" in text


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    shared = Path(tempfile.mkdtemp(prefix="hangwatch-confined-"))
    shared.chmod(0o755)  # nobody may search it; tmp_path (0700, root's) it may not
    try:
        yield World(tmp_path, shared)
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_a_target_cannot_make_diagnose_read_what_it_may_not(world: World) -> None:
    with world.nobody() as nobody, world.jailed() as jailed:
        parked(nobody.pid, 1 + len(world.names))
        parked(jailed.pid, 1 + len(world.jail_names))
        argv = diagnose_argv([nobody.pid, jailed.pid], threshold=1, duration=2)
        as_json = RunningDiagnose(argv).finish(timeout=HANG_S)
        as_text = RunningDiagnose(
            diagnose_argv([nobody.pid, jailed.pid], threshold=1, duration=2, json_out=False)
        ).finish(timeout=HANG_S)
    for run in (as_json, as_text):
        assert run.returncode == 0, run.explain("diagnose failed")
        assert not world.leaked(run.stdout + run.stderr), run.explain("the protected file leaked")
    report = as_json.report
    assert report is not None, as_json.explain("no JSON")
    for pid, names in ((nobody.pid, world.names), (jailed.pid, world.jail_names)):
        frames = stack_frames(report, pid)
        for name, why in names.items():
            f = frames.get(name)
            assert f is not None, as_json.explain(f"no frame in {name} for process {pid}")
            if why is None:
                assert f["code"] == PARKED_LINE, as_json.explain(f"{name}: its own line")
            else:
                assert f["code"] is None and f.get("code_withheld") == why, as_json.explain(name)
    # The text report shows the line where it holds the call: the readable file's, no other.
    assert f"`{PARKED_LINE}`" in as_text.stdout, as_text.explain("the own line is not shown")


def stack_frames(report: dict, pid: int) -> dict[str, dict]:
    """file -> its frame, of every stack group of process ``pid`` in a --json report."""
    out: dict[str, dict] = {}
    for svc in report.get("services", []):
        for proc in svc.get("processes", []):
            if proc.get("pid") != pid:
                continue
            for g in (proc.get("stacks") or {}).get("groups", []):
                for f in g["frames"]:
                    out[f["file"]] = f
    return out


def test_a_target_cannot_make_the_daemons_flight_record_read_it(
    world: World, tmp_path: Path
) -> None:
    port = free_port()
    cfg = tmp_path / "hangwatch.yaml"
    cfg.write_text(
        f'listen: "127.0.0.1:{port}"\ninterval_seconds: {INTERVAL}\n'
        f"park_threshold_seconds: 2\ntargets:\n  - name: confined\n    cmdline: {MARK!r}\n"
    )
    with running_daemon(cfg, port) as d, world.nobody() as nobody, world.jailed() as jailed:
        for fx in (nobody, jailed):
            wait_until(
                d,
                lambda s, pid=str(fx.pid): (
                    value(s, "hangwatch_process_state", pid=pid, state="deadlocked") == 1
                ),
                f"process {fx.pid} to be deadlocked",
                timeout=30,
            )
        deadline = time.monotonic() + 20
        while d.output().count(f"`{PARKED_LINE}`") < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        log = d.output()
    assert not world.leaked(log), log
    # Both targets' own files are read and shown; the names that point elsewhere are not.
    assert log.count(f"`{PARKED_LINE}`") >= 2, log


def test_an_agent_that_cannot_become_the_target_shows_no_line(world: World) -> None:
    """The documented four capabilities without CAP_SETUID and CAP_SETGID, as a user that owns
    nothing: the verdict stands, no line of the target's files is shown (not even its own:
    the agent cannot check the target's rights, so it does not read), each frame says why,
    and diagnose says so once."""
    with world.nobody() as nobody:
        parked(nobody.pid, 1 + len(world.names))
        r = subprocess.run(
            [*with_caps(CAPS), *diagnose_argv([nobody.pid], threshold=1, duration=2)],
            cwd=REPO_ROOT,
            env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
            capture_output=True,
            text=True,
            timeout=HANG_S,
            check=False,
        )
    msg = f"exit {r.returncode}\nstderr:\n{r.stderr}\nstdout:\n{r.stdout}"
    assert r.returncode == 0, msg
    assert not world.leaked(r.stdout + r.stderr), msg
    assert "no CAP_SETUID and CAP_SETGID" in r.stderr, msg
    frames = stack_frames(json.loads(r.stdout), nobody.pid)
    for name in world.names:
        assert frames[name]["code"] is None, msg
        assert frames[name]["code_withheld"] == "the agent cannot take the target's credentials"
