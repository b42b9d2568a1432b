"""The one bound a test puts on time.

A test waits for what it looks for (a verdict, an alert, a log line, an engine's port) until it
comes or until ``HANG_S`` has passed, and only then fails: a guard against a hang of the test's
own harness (a child that never answers, a wait for something that will never come), never a
check of how fast hangwatch reacts. How fast it reacts is a figure of ``make bench``
(docs/performance.md). Generous: a BPF compile that takes 2 s alone took 73 s once while the
parallel step kept both cores busy.
"""

from __future__ import annotations

HANG_S = 180.0

# A hold (a state kept for a while) looked at least this many times: that it was watched at
# all, not how often a loaded host let the daemon answer.
MIN_SCRAPES = 10
