"""`make demo`: the daemon watching four small programs, one of each kind, live.

Starts `hangwatch run` with a config that selects the demo programs by command line and,
once it has ticked (attached, as on a real host), the programs: a mutex deadlock, a pool
parked on a condition variable nobody signals, a "model server" that loads (writes a log) for
8 s and then listens, and an idle Python HTTP server. Every 2 s for about 30 s it prints the
daemon's new log lines and each service's state from /metrics.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from scripts.daemonproc import DaemonError, DaemonProcess, Samples, free_port
from scripts.fixturelib import Fixture

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


def states(samples: Samples) -> dict[str, str]:
    """service -> its state, from one scrape."""
    out = {}
    for (name, labels), v in samples.items():
        if name == "hangwatch_service_state" and v == 1:
            ls = dict(labels)
            out[ls["service"]] = ls["state"]
    return out


def main() -> int:
    port = free_port()
    cfg = Path(tempfile.mkdtemp(prefix="hangwatch-demo-")) / "demo.yaml"
    cfg.write_text(CONFIG.format(port=port))
    print(f"hangwatch demo: daemon on 127.0.0.1:{port}, config {cfg}; log lines below.", flush=True)
    shown = 0

    def new_log_lines() -> None:
        nonlocal shown
        text = daemon.output()
        end = text.rfind("\n") + 1  # whole lines only
        if end > shown:
            print(text[shown:end], end="", flush=True)
            shown = end

    with DaemonProcess(cfg, port) as daemon:
        # Attached before the programs start, as on a real host.
        try:
            daemon.first_tick(timeout=120)
        except DaemonError as e:
            new_log_lines()
            print(f"hangwatch demo: {str(e).splitlines()[0]}", file=sys.stderr)
            return 1
        new_log_lines()
        with (
            Fixture.c("deadlock_mutex"),
            Fixture.c("condvar_pool", "8"),
            Fixture.py("loader", "--load-seconds", "8", "--port", free_port(), ready="LOADING"),
            Fixture.py("idle_http", "--port", free_port()),
        ):
            for t in range(0, SECONDS, 2):
                time.sleep(2)
                new_log_lines()
                samples = daemon.scrape()
                if samples is None:
                    print("  scrape failed")
                    continue
                row = "  ".join(f"{k}={v}" for k, v in sorted(states(samples).items()))
                print(f"[{t + 2:2d} s] {row}", flush=True)
        rc = daemon.stop()
        new_log_lines()
    return rc


if __name__ == "__main__":
    sys.exit(main())
