"""`make demo`: the daemon watching four small programs, one of each kind, live.

Starts `hangwatch run` with a config that selects the demo programs by command line, then
the programs: a mutex deadlock, a pool parked on a condition variable nobody signals, a
"model server" that loads (writes a log) for 8 s and then listens, and an idle Python HTTP
server. Prints each service's state from /metrics every 2 s for about 30 s.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.fixturelib import REPO_ROOT, Fixture

CONFIG = """
listen: "127.0.0.1:{port}"
interval_seconds: 1
park_threshold_seconds: 10
targets:
  - name: deadlock
    cmdline: "fixtures/build/deadlock_mutex"
  - name: parked-pool
    cmdline: "fixtures/build/condvar_pool"
  - name: model-server
    cmdline: "fixtures/loader\\\\.py"
  - name: http-server
    cmdline: "fixtures/idle_http\\\\.py"
"""
SECONDS = 30


def scrape(port: int) -> dict[str, str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    states = {}
    for fam in text_string_to_metric_families(text):
        if fam.name == "hangwatch_service_state":
            for s in fam.samples:
                if s.value == 1:
                    states[s.labels["service"]] = s.labels["state"]
    return states


def main() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = Path(tempfile.mkdtemp(prefix="hangwatch-demo-")) / "demo.yaml"
    cfg.write_text(CONFIG.format(port=port))
    print(f"hangwatch demo: daemon on 127.0.0.1:{port}, config {cfg}; log lines below.", flush=True)
    daemon = subprocess.Popen(
        [sys.executable, "-m", "agent", "run", "--config", str(cfg)], cwd=REPO_ROOT
    )
    try:
        time.sleep(2.5)  # attach before the programs start, as on a real host
        with (
            Fixture.c("deadlock_mutex"),
            Fixture.c("condvar_pool", "8"),
            Fixture.py("loader", "--load-seconds", "8", ready="LOADING"),
            Fixture.py("idle_http"),
        ):
            for t in range(0, SECONDS, 2):
                time.sleep(2)
                try:
                    states = scrape(port)
                except OSError as e:
                    print(f"  scrape failed: {e}")
                    continue
                row = "  ".join(f"{k}={v}" for k, v in sorted(states.items()))
                print(f"[{t + 2:2d} s] {row}", flush=True)
    finally:
        daemon.send_signal(signal.SIGTERM)
        rc = daemon.wait(timeout=30)
    return rc


if __name__ == "__main__":
    sys.exit(main())
