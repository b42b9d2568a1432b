"""Observation: which processes to watch, and one immutable snapshot of them per tick.

Discovery groups processes into services; the sampler joins /proc and the probe's reading into a
Snapshot; the Observer keeps the few facts that live across ticks and hands snapshots to the
analysis. The report-time enrichment (stacks, native callers, what an fd is) is read here too.
"""
