"""What discovery costs when a tenant floods the host with processes named like a server.

Starts 2,000 ``sleep`` processes as ``nobody`` whose command line names vLLM, either in the
caller's own cgroup or in a login session of their own (``user.slice/user-65534.slice``),
and times ``Discovery.scan`` on the real /proc with the built-in default config: the first
scan (every process read), then steady scans, told of every exec (as the daemon is) and not.
Prints one Markdown row per placement. With ``--daemon``: a real ``hangwatch run`` with the
built-in default config (interval 1 s) and the 2,000 in the caller's cgroup; the services
it exports, the size and time of a scrape, and its discovery and /proc stages. Runs against
whatever ``agent`` package is first on the path, so the same file measures an older tree:

    sudo .venv/bin/python -m bench.selection [--daemon]
    cd OLD_TREE && sudo PYTHONPATH=. NEW_TREE/.venv/bin/python NEW_TREE/bench/selection.py
"""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from agent.config import load
from agent.observe.discovery import Discovery
from agent.sources.procfs import ProcFS
from scripts.fixturelib import AS_NOBODY

SPOOFS = 2000
STEADY = 20  # scans timed after the first
NAME = "python3 -m vllm.entrypoints.openai.api_server --model spoof"
LAUNCHER = """
import os, sys
sys.stdin.readline()
for _ in range(int(sys.argv[1])):
    if os.fork() == 0:
        try:
            os.execv("/bin/sleep", [os.environ["SPOOF"], "600"])
        finally:
            os._exit(127)
print("READY", flush=True)
sys.stdin.readline()
"""


def cgroup2_root() -> Path:
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        pre, _, post = line.partition(" - ")
        if post.split()[:1] == ["cgroup2"]:
            return Path(pre.split()[4])
    raise SystemExit("no cgroup v2 hierarchy mounted")


@contextlib.contextmanager
def spoofs(cgroup: Path | None) -> Iterator[None]:
    made = []
    if cgroup is not None:
        made = [p for p in (cgroup.parent.parent, cgroup.parent, cgroup) if not p.exists()]
        cgroup.mkdir(parents=True, exist_ok=True)
    argv = list(AS_NOBODY)
    launcher = subprocess.Popen(
        [*argv, sys.executable, "-c", LAUNCHER, str(SPOOFS)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={"PATH": "/usr/bin:/bin", "SPOOF": NAME},
        start_new_session=True,
    )
    assert launcher.stdin is not None and launcher.stdout is not None
    try:
        if cgroup is not None:
            (cgroup / "cgroup.procs").write_text(str(launcher.pid))
        launcher.stdin.write(b"go\n")
        launcher.stdin.flush()
        assert launcher.stdout.readline() == b"READY\n"
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()
        time.sleep(0.5)  # the sleeps' exits are reaped by init
        for p in reversed(made):
            for _ in range(100):
                try:
                    p.rmdir()
                    break
                except OSError:
                    time.sleep(0.05)


def measure(where: str) -> str:
    d = Discovery(ProcFS(), load(None).targets, self_pid=os.getpid())
    t0 = time.perf_counter()
    services = d.scan()
    first = time.perf_counter() - t0
    rows = []
    for told in (True, False):
        d.changes_reported = told
        times = []
        for _ in range(STEADY):
            t0 = time.perf_counter()
            d.scan()
            times.append(time.perf_counter() - t0)
        rows.append(statistics.median(times) * 1e3)
    excess = sum(getattr(d, "excess", {}).values())
    return (
        f"| {where} | {len(services)} | {excess} | {first * 1e3:.1f} | {rows[0]:.1f} "
        f"| {rows[1]:.1f} |"
    )


def daemon_row(tmp: Path) -> str:
    import urllib.request

    import yaml

    from agent.config import default_text
    from scripts.daemonproc import DaemonProcess, first_tick_done, free_port, parse, value

    port = free_port()
    raw = yaml.safe_load(default_text()) | {"listen": f"127.0.0.1:{port}"}
    cfg = tmp / "hangwatch.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    with DaemonProcess(cfg, port) as d:
        d.wait_for(first_tick_done, "the first tick", 300, poll=0.5)
        time.sleep(5)  # a few ticks with every service known
        sizes, times, discovery, proc = [], [], [], []
        for _ in range(3):
            t0 = time.perf_counter()
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as r:
                text = r.read()
            times.append(time.perf_counter() - t0)
            sizes.append(len(text))
            samples = parse(text.decode())
            discovery.append(
                value(samples, "hangwatch_collector_duration_seconds", collector="discovery") or 0
            )
            proc.append(
                value(samples, "hangwatch_collector_duration_seconds", collector="proc") or 0
            )
            time.sleep(1)
        services = {dict(ls)["pid"] for (n, ls) in samples if n == "hangwatch_service_state"}
    med = statistics.median
    return (
        f"| {len(services)} | {len(samples)} | {med(sizes) / 1e6:.2f} | {med(times):.2f} "
        f"| {med(discovery) * 1e3:.1f} | {med(proc) * 1e3:.1f} |"
    )


def main() -> int:
    if "--daemon" in sys.argv[1:]:
        import tempfile

        print("| services | series | scrape MB | scrape s | discovery ms | /proc stage ms |")
        print("| --- | --- | --- | --- | --- | --- |")
        with spoofs(None), tempfile.TemporaryDirectory() as tmp:
            print(daemon_row(Path(tmp)), flush=True)
        return 0
    session = cgroup2_root() / "user.slice" / "user-65534.slice" / f"session-b{os.getpid()}.scope"
    print(
        "| 2,000 spoofed vLLM processes | services | excess | first scan ms "
        "| scan ms, told of execs | scan ms, not told |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for where, cgroup in (("in the caller's cgroup", None), ("in a tenant's session", session)):
        with spoofs(cgroup):
            print(measure(where), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
