"""The settings that shape an observation, each with one default and one allowed range.

The CLI flags, the config keys and the observer all read them from here, so a default or a
range is written once. A value is checked where it enters (a flag, a config key) and the
error names that flag or key.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import UsageError, show

_EXPONENT = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d{1,3}")


@dataclass(frozen=True)
class Seconds:
    """A setting in seconds: its config key, its flag (if any), default and range."""

    key: str
    flag: str | None
    default: float
    lo: float
    hi: float

    def check(self, value: object, where: str) -> float:
        """``value`` as seconds, or a UsageError that starts with ``where`` (a flag or a
        config location) and names the bad value and the allowed range."""
        given = value
        if isinstance(value, str) and _EXPONENT.fullmatch(value.strip()):
            value = float(value)  # YAML 1.1 reads 1e3 (no dot, no sign) as a string
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UsageError(f"{where}: want a number of seconds, got {show(value)}")
        if not self.lo <= value <= self.hi:  # also NaN
            shown = given[:60] if isinstance(given, str) else show(given)
            raise UsageError(f"{where}: {shown} is out of range {self.range_text}")
        return float(value)

    @property
    def range_text(self) -> str:
        return f"{self.lo:g}-{self.hi:g} seconds"


DAY = 86400.0
# How long every thread must be parked, with no progress, before a service is stalled.
PARK_THRESHOLD = Seconds("park_threshold_seconds", "--threshold", 60.0, 1.0, 7 * DAY)
# The daemon's tick.
INTERVAL = Seconds("interval_seconds", None, 1.0, 0.1, 3600.0)
# How long `diagnose` observes.
DURATION = Seconds("duration_seconds", "--duration", 5.0, 0.5, DAY)

DIAGNOSE_INTERVAL_S = 0.5  # diagnose reads this often: a cycle needs two reads
# Waits longer than this go through the ring buffer. Compiled into the programs; below the
# smallest threshold, so every wait that matters to a verdict is reported.
LONG_WAIT_S = 1.0
# Progress is judged over at least this much history (the daemon): a log line every few
# seconds is progress even at a short interval.
MIN_WINDOW_S = 5.0


@dataclass(frozen=True)
class Settings:
    """One observation's settings, as the observer uses them.

    ``window_s`` is how much history progress is judged over: the daemon's sliding window,
    or None for `diagnose`, whose window is the whole observation.
    """

    park_threshold_s: float = PARK_THRESHOLD.default
    interval_s: float = INTERVAL.default
    window_s: float | None = None
    # A thread "did work" in a tick when it used more CPU than this share of the tick.
    # An idle poll loop (Python's serve_forever wakes twice a second) uses ~0.01%; a torch
    # rank polling its own store every 10 ms while it waits for a peer, 1-2.5%.
    cpu_floor_ratio: float = 0.05
    # ... and never less than this, so that a short tick does not count a wake-up as work:
    # a thread asleep on a 10 ms timer was seen charged 3-14 ms at once now and then.
    cpu_floor_min_ns: int = 20_000_000

    @classmethod
    def daemon(cls, park_threshold_s: float, interval_s: float) -> Settings:
        return cls(park_threshold_s, interval_s, max(MIN_WINDOW_S, 2 * interval_s))

    @classmethod
    def diagnose(cls, park_threshold_s: float) -> Settings:
        return cls(park_threshold_s, DIAGNOSE_INTERVAL_S, None)
