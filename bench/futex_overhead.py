"""Cost of the futex probe per futex call: no probe, probe loaded but not watching, watching.

Runs are interleaved in one invocation and reported as medians and ratios to the no-probe
runs. Needs root. Usage: python -m bench.futex_overhead [--rounds N] [--calls N]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BUILD = HERE.parent / ".build" / "bench"


def build() -> Path:
    BUILD.mkdir(parents=True, exist_ok=True)
    exe = BUILD / "futex_syscall"
    src = HERE / "futex_syscall.c"
    if not exe.exists() or exe.stat().st_mtime < src.stat().st_mtime:
        subprocess.run(["gcc", "-O2", "-Wall", "-o", str(exe), str(src)], check=True)
    return exe


def one_run(exe: Path, calls: int, kind: str, probe: object | None, watch: bool) -> float:
    p = subprocess.Popen(
        [str(exe), str(calls), kind], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    if probe is not None and watch:
        probe.watch([p.pid])  # type: ignore[attr-defined]
    out, _ = p.communicate("go\n")
    if probe is not None:
        probe.watch([])  # type: ignore[attr-defined]
    return float(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=1_000_000)
    args = ap.parse_args()
    from agent import preflight

    preflight.check()
    from agent.probe import KernelProbes

    exe = build()
    res: dict[tuple[str, str], list[float]] = {}
    counters: dict[str, int] = {}
    for r in range(args.rounds):
        # Each round: no probe at all, then a freshly loaded probe, unwatched and watched.
        for kind in ("wait", "wake"):
            res.setdefault((kind, "none"), []).append(one_run(exe, args.calls, kind, None, False))
        with KernelProbes() as probe:
            for kind in ("wait", "wake"):
                for mode in ("unwatched", "watched"):
                    res.setdefault((kind, mode), []).append(
                        one_run(exe, args.calls, kind, probe, mode == "watched")
                    )
            for k, v in probe.read().counters.items():
                counters[k] = counters.get(k, 0) + v
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    print(f"{'workload':40s} {'ns/call':>9s} {'ratio':>7s}")
    for kind, what in (
        ("wait", "futex WAIT returning at once"),
        ("wake", "futex WAKE, nobody waiting"),
    ):
        base = statistics.median(res[(kind, "none")])
        for mode in ("none", "unwatched", "watched"):
            med = statistics.median(res[(kind, mode)])
            print(f"{what + ', ' + mode:40s} {med:9.1f} {med / base:6.2f}x")
    lost = counters.get("inflight_full", 0) + counters.get("hist_full", 0)
    print(f"probe counters: {counters['waits_started']} waits seen, {lost} lost")
    return 0


if __name__ == "__main__":
    sys.exit(main())
