"""What `diagnose` tells the terminal (stderr) while it works: attached, watching on, done,
stacks read. The report itself is agent.report.text; these lines are its progress."""

from __future__ import annotations

from ..model import plural


def attached(programs: int, load_s: float, processes: int, services: int, duration_s: float) -> str:
    return (
        f"hangwatch: attached probes ({programs} tracepoints) in {load_s:.1f} s; watching "
        f"{plural(processes, 'process', 'processes')} of {plural(services, 'service')} for "
        f"{duration_s:g} s"
    )


def watching_on(services: int, elapsed_s: float, threshold_s: float) -> str:
    """Services that did nothing in the window, but with no evidence yet as old as the
    threshold: the watch goes on until it."""
    return (
        f"hangwatch: {plural(services, 'service')} did nothing in {elapsed_s:.1f} s, with no "
        f"evidence yet as old as the {threshold_s:g} s threshold: watching until it"
    )


def observed(seconds: float, reads: int) -> str:
    return f"hangwatch: observed for {seconds:.1f} s ({reads} reads)"


def stacks_read(processes: int, took_s: float) -> str:
    return (
        f"hangwatch: read the Python stacks of {plural(processes, 'process', 'processes')} "
        f"in {took_s:.2f} s (py-spy --nonblocking: not stopped)"
    )
