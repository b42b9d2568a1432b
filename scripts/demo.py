"""`make run` until the daemon exists: diagnose three small programs, one of each kind of hang.

The daemon (`hangwatch run`) comes with the next release; this shows what its verdicts
will say, using the same fixture programs the test suite uses.
"""

from __future__ import annotations

import subprocess
import sys
import time

from tests.fixturelib import REPO_ROOT, Fixture

DEMOS = [
    ("two threads taking two mutexes in opposite order", Fixture.c, "deadlock_mutex", ()),
    (
        "eight workers waiting on a condition variable nobody signals",
        Fixture.c,
        "condvar_pool",
        ("8",),
    ),
    ("a Python HTTP server with no requests", Fixture.py, "idle_http", ()),
]


def main() -> int:
    print(
        "hangwatch: the daemon (`hangwatch run`) arrives in the next release; until then\n"
        "`make run` shows `hangwatch diagnose` on three demo programs.\n",
        flush=True,
    )
    for what, start, name, args in DEMOS:
        with start(name, *args) as fx:
            time.sleep(1.5)  # let the parked threads age past the demo's 1 s threshold
            print(f"$ hangwatch diagnose --pid {fx.pid} --threshold 1 --duration 2   # {what}")
            rc = subprocess.call(
                [
                    sys.executable,
                    "-m",
                    "agent",
                    "diagnose",
                    "--pid",
                    str(fx.pid),
                    "--threshold",
                    "1",
                    "--duration",
                    "2",
                ],
                cwd=REPO_ROOT,
            )
            if rc != 0:
                return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
