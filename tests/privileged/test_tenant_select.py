"""A tenant steering target selection: 2,000 ``sleep`` processes, run as ``nobody`` from a
login session of its own, whose command line names an inference server (``argv[0]`` is
``python3 -m vllm.entrypoints.openai.api_server``; their comm stays ``sleep``).

Before: the default config watched every one of them, 2,000 services and some 72,000 series
in a 7 MB scrape, each turning stalled with its alert. Now, against one real daemon whose
config is reloaded (SIGHUP) between the three phases:

* the default config: none of them is watched (its targets want a process started by a
  system service, a container or the operator, and a user's session is none of these),
  while the operator's own server (root, started before them) is;
* a command-line-only selector (the old default's): at most ``max_services`` of them are
  watched, the operator's server first (it is root's, and older); the rest are counted in
  ``hangwatch_services_excess``, and the scrape stays small;
* the command line AND ``uids: [0]``: none of them.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from agent.config import MAX_SERVICES_PER_TARGET, default_text
from agent.sources.procfs import parse_real_uid
from scripts.fixturelib import AS_NOBODY
from tests.privileged.daemonlib import (
    Daemon,
    Samples,
    free_port,
    running_daemon,
    value,
    wait_for_log,
    wait_until,
)

pytestmark = pytest.mark.serial  # serial: 2,000 tenant processes, which every other test would meet

SPOOFS = 2000
SERVER = "python3 -m vllm.entrypoints.openai.api_server --model"
NOBODY = AS_NOBODY
# The launcher's own command line names no server (it would fold the sleeps into one
# service): the name comes in its environment. It forks only once placed in its cgroup, and
# kills and reaps its children when told to.
LAUNCHER = """
import os, signal, sys
name, n = os.environ["SPOOF"], int(sys.argv[1])
sys.stdin.readline()
pids = []
for _ in range(n):
    pid = os.fork()
    if pid == 0:
        try:
            os.execv("/bin/sleep", [name, "600"])
        finally:
            os._exit(127)
    pids.append(pid)
print("READY", flush=True)
sys.stdin.readline()
for pid in pids:
    os.kill(pid, signal.SIGKILL)
for pid in pids:
    os.waitpid(pid, 0)
"""


def cgroup2_root() -> Path:
    """Where the cgroup v2 hierarchy is mounted (/sys/fs/cgroup, or .../unified on a hybrid
    host)."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        pre, _, post = line.partition(" - ")
        if post.split()[:1] == ["cgroup2"]:
            return Path(pre.split()[4])
    pytest.fail("no cgroup v2 hierarchy mounted: the tenant's session cannot be made")


@pytest.fixture(scope="module")
def session_cgroup() -> Iterator[Path]:
    """A login session of uid 65534, as pam_systemd would make it."""
    path = cgroup2_root() / "user.slice" / "user-65534.slice" / f"session-hw{os.getpid()}.scope"
    made = [p for p in (path.parent.parent, path.parent, path) if not p.exists()]
    path.mkdir(parents=True, exist_ok=True)
    try:
        yield path
    finally:
        for p in reversed(made):
            for _ in range(100):  # the last killed processes leave it a moment later
                try:
                    p.rmdir()
                    break
                except OSError:
                    time.sleep(0.05)


@pytest.fixture(scope="module")
def operator_server() -> Iterator[subprocess.Popen[bytes]]:
    """The operator's own vLLM (a root process named like one), started before the tenant's."""
    proc = subprocess.Popen([f"{SERVER} real", "600"], executable="/bin/sleep")
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def spoofs(session_cgroup: Path, operator_server: subprocess.Popen[bytes]) -> Iterator[set[int]]:
    launcher = subprocess.Popen(
        [*NOBODY, sys.executable, "-c", LAUNCHER, str(SPOOFS)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={"PATH": "/usr/bin:/bin", "SPOOF": f"{SERVER} spoof"},
        start_new_session=True,
    )
    assert launcher.stdin is not None and launcher.stdout is not None
    try:
        (session_cgroup / "cgroup.procs").write_text(str(launcher.pid))
        launcher.stdin.write(b"go\n")
        launcher.stdin.flush()
        assert launcher.stdout.readline() == b"READY\n"
        pids = {
            int(p)
            for p in (session_cgroup / "cgroup.procs").read_text().split()
            if int(p) != launcher.pid
        }
        assert len(pids) == SPOOFS
        for pid in list(pids)[:3]:
            assert Path(f"/proc/{pid}/cmdline").read_bytes().startswith(SERVER.encode())
            assert parse_real_uid(Path(f"/proc/{pid}/status").read_text()) == 65534
        yield pids
    finally:
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            launcher.stdin.write(b"stop\n")
            launcher.stdin.close()
            launcher.wait(timeout=30)
        # For sure: its process group (the sleeps are in it), whatever the launcher did.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()


def config(port: int, targets: list[dict[str, object]] | None = None) -> str:
    """The built-in default with a test's port and pace; its targets, or ``targets``."""
    raw = yaml.safe_load(default_text())
    raw |= {"listen": f"127.0.0.1:{port}", "interval_seconds": 0.5, "park_threshold_seconds": 2}
    if targets is not None:
        raw["targets"] = targets
    return yaml.safe_dump(raw)


def watched(samples: Samples, service: str) -> set[int]:
    """Root PIDs of the services of a target that /metrics shows."""
    return {
        int(dict(ls)["pid"])
        for (n, ls), _ in samples.items()
        if n == "hangwatch_service_state" and dict(ls)["service"] == service
    }


def reload(daemon: Daemon, path: Path, text: str, reloads: int) -> None:
    path.write_text(text)
    daemon.proc.send_signal(signal.SIGHUP)
    wait_for_log(daemon, rf"(?s)(reloaded .*){{{reloads}}}", f"reload {reloads}")


def test_a_tenant_cannot_make_the_daemon_watch_its_spoofed_servers(
    tmp_path: Path, spoofs: set[int], operator_server: subprocess.Popen[bytes]
) -> None:
    port = free_port()
    path = tmp_path / "hangwatch.yaml"
    path.write_text(config(port))
    real = operator_server.pid
    with running_daemon(path, port) as d:
        # The default config: the operator's server, none of the tenant's.
        s = wait_until(d, lambda s: real in watched(s, "vllm"), "the operator's server")
        s = wait_until(d, lambda s: real in watched(s, "vllm"), "a second tick")
        assert not watched(s, "vllm") & spoofs
        assert value(s, "hangwatch_services_excess", service="vllm") == 0

        # Selected by command line alone: capped, the operator's kept, the rest counted.
        vllm = {"name": "vllm", "cmdline": r"vllm[./]entrypoints"}
        reload(d, path, config(port, [vllm]), 1)
        excess = SPOOFS + 1 - MAX_SERVICES_PER_TARGET
        s = wait_until(
            d,
            lambda s: value(s, "hangwatch_services_excess", service="vllm") == excess,
            f"{excess} services counted as excess",
        )
        kept = watched(s, "vllm")
        assert len(kept) == MAX_SERVICES_PER_TARGET and real in kept, kept
        assert len(s) < 5000, f"{len(s)} series"  # 72,090 when all 2,000 were watched
        stalled = [k for k, v in s.items() if v == 1 and ("state", "stalled") in k[1]]
        assert len(stalled) <= 2 * MAX_SERVICES_PER_TARGET, len(stalled)
        assert re.search(r"target vllm: \d+ services beyond max_services", d.output())

        # The command line AND root's uid: none of the tenant's.
        reload(d, path, config(port, [{**vllm, "uids": [0]}]), 2)
        s = wait_until(
            d,
            lambda s: (
                value(s, "hangwatch_services_excess", service="vllm") == 0
                and watched(s, "vllm") == {real}
            ),
            "only the operator's server",
        )
