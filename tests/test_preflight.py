"""Privilege and kernel-feature checks: the pure parts."""

from __future__ import annotations

from agent.preflight import (
    CAP_BPF,
    CAP_DAC_READ_SEARCH,
    CAP_PERFMON,
    CAP_SYS_ADMIN,
    CAP_SYS_PTRACE,
    effective_caps,
    missing_caps,
)


def caps(*bits: int) -> int:
    return sum(1 << b for b in bits)


def test_effective_caps_from_status():
    assert effective_caps("Name:\tx\nCapEff:\t000001ffffffffff\n") == 0x1FFFFFFFFFF
    assert effective_caps("Name:\tx\n") == 0


def test_missing_caps_names_each_one():
    assert missing_caps(0) == ["CAP_BPF", "CAP_PERFMON", "CAP_SYS_PTRACE", "CAP_DAC_READ_SEARCH"]
    assert missing_caps(caps(CAP_BPF, CAP_PERFMON, CAP_DAC_READ_SEARCH)) == ["CAP_SYS_PTRACE"]
    assert missing_caps(caps(CAP_BPF, CAP_PERFMON, CAP_SYS_PTRACE, CAP_DAC_READ_SEARCH)) == []
    # Before Linux 5.8, CAP_SYS_ADMIN carried what CAP_BPF and CAP_PERFMON carry now.
    assert missing_caps(caps(CAP_SYS_ADMIN, CAP_SYS_PTRACE, CAP_DAC_READ_SEARCH)) == []
