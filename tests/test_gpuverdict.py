"""GPU evidence in verdicts: activity is progress; pegged GPUs under a parked host are a stall."""

from __future__ import annotations

from agent.analysis.classify import classify_process, classify_service
from agent.analysis.gpu import GpuHistory, gpu_active, gpu_idle
from agent.analysis.progress import ProcessProgress
from agent.analysis.verdict import IDLE, PROGRESSING, STALLED, ProcessFacts
from agent.model import GpuProcessUse, GpuReading, Listener
from agent.report.sentences import gpu_list, reasons, render
from tests.synth import parked, process

S = 1_000_000_000
GB = 10**9


def reading(pid_uses: dict[int, list[tuple[int, int, float]]], ok: bool = True) -> GpuReading:
    return GpuReading(
        ok=ok,
        error=None if ok else "NVML not available",
        processes={
            pid: tuple(GpuProcessUse(g, mem, util) for g, mem, util in uses)
            for pid, uses in pid_uses.items()
        },
    )


def history(*readings: GpuReading, step_s: float = 10) -> tuple[GpuHistory, int]:
    h = GpuHistory()
    old = None
    now = 0
    for i, r in enumerate(readings):
        now = int(i * step_s * S)
        h.update(r, old, now)
        old = r
    return h, now


def facts(pid: int, gpu, parked_s: float = 300.0, cpu: bool = False) -> ProcessFacts:
    active = gpu is not None and gpu.active
    prog = ProcessProgress(
        pid=pid,
        window_ns=5 * S,
        working_tids=(pid,) if cpu else (),
        cpu_ns=S if cpu else 0,
        gpu=gpu_active(gpu) if active else None,
    )
    sample = process(pid, parked(pid), parked(pid + 1))
    return ProcessFacts(sample, prog, 1 if cpu else 2, 0.0 if cpu else parked_s, (), gpu)


def test_gpu_lists_are_compact():
    assert gpu_list([3, 0, 1, 2, 7, 5]) == "GPU 0-3,5,7"
    assert gpu_list([4]) == "GPU 4"


def test_sm_utilisation_is_progress_for_a_parked_host():
    r = reading({10: [(0, 20 * GB, 0.3)]})
    h, now = history(r)
    g = h.facts(10, r, r, now)
    v = classify_process(facts(10, g), 60)
    assert v.state == PROGRESSING
    assert "GPU 0: 30% SM utilisation" in reasons(v.reasons)


def test_growing_gpu_memory_is_progress():
    before, after = reading({10: [(0, 2 * GB, 0.0)]}), reading({10: [(0, 9 * GB, 0.0)]})
    h, now = history(before, after)
    g = h.facts(10, after, before, now)
    assert g is not None and g.active and g.memory_change == 7 * GB
    assert classify_process(facts(10, g), 60).state == PROGRESSING


def test_pegged_gpus_under_a_parked_host_past_the_threshold_is_a_stall():
    pegged = reading({10: [(g, 70 * GB, 1.0) for g in range(8)]})
    h, now = history(*[pegged] * 8, step_s=10)  # 70 s at 100%
    g = h.facts(10, pegged, pegged, now)
    assert g is not None and g.high_for_s == 70
    v = classify_process(facts(10, g, parked_s=300), 60)
    assert v.state == STALLED and v.gpu_spin
    assert any(
        "GPU 0-7 at 100% or more for 70 s while every host thread is parked" in r
        for r in reasons(v.reasons)
    )
    svc = classify_service(1, [facts(10, g, parked_s=300)], 60)
    assert svc.state == STALLED and svc.gpu_spin


def test_pegged_gpus_are_progress_until_the_threshold_or_while_the_host_works():
    pegged = reading({10: [(0, 70 * GB, 1.0)]})
    h, now = history(*[pegged] * 3, step_s=10)  # 20 s at 100%
    g = h.facts(10, pegged, pegged, now)
    assert classify_process(facts(10, g, parked_s=300), 60).state == PROGRESSING
    h, now = history(*[pegged] * 10, step_s=10)
    g = h.facts(10, pegged, pegged, now)
    assert classify_process(facts(10, g, cpu=True), 60).state == PROGRESSING
    # A peer rank working on the host keeps the service progressing, not spinning.
    svc = classify_service(1, [facts(10, g, parked_s=300), facts(11, None, cpu=True)], 60)
    assert svc.state == PROGRESSING and not svc.gpu_spin


def test_a_dip_in_utilisation_restarts_the_high_streak():
    hi, lo = reading({10: [(0, GB, 1.0)]}), reading({10: [(0, GB, 0.2)]})
    h, now = history(hi, hi, hi, lo, hi, step_s=30)
    g = h.facts(10, hi, hi, now)
    assert g is not None and g.high_for_s == 0


def test_idle_gpus_held_are_named_in_a_stalled_verdict():
    idle = reading({10: [(g, 76 * GB, 0.0) for g in range(8)]})
    h, now = history(*[idle] * 30, step_s=10)  # 290 s at 0%
    g = h.facts(10, idle, idle, now)
    assert g is not None and not g.active and g.idle_for_s == 290
    assert render(gpu_idle({10: g})) == "GPU 0-7: 0% for 290 s, 76 GB held each"
    v = classify_process(facts(10, g), 60)
    assert v.state == STALLED
    assert "GPU 0-7: 0% for 290 s, 76 GB held each" in reasons(v.reasons)


def test_a_failed_nvml_read_is_no_evidence_either_way():
    pegged = reading({10: [(0, GB, 1.0)]})
    failed = reading({}, ok=False)
    h, now = history(*[pegged] * 10, failed, step_s=10)
    assert h.facts(10, failed, pegged, now) is None
    # With no GPU facts the host decides: parked past the threshold is stalled, not spinning.
    v = classify_process(facts(10, None), 60)
    assert v.state == STALLED and not v.gpu_spin
    # ... and the streak survives the failed read: it resumes when NVML answers again.
    h.update(pegged, failed, now + 10 * S)
    g = h.facts(10, pegged, pegged, now + 10 * S)
    assert g is not None and g.high_for_s == 110


def test_history_forgets_processes_that_left_the_gpu():
    h, _ = history(reading({10: [(0, GB, 1.0)]}), reading({}))
    assert h.facts(10, reading({10: [(0, GB, 0.0)]}), None, 0) is not None  # seen afresh
    assert not h._high_since_ns and not h._active_ns


def test_listener_with_idle_gpu_is_idle_and_says_what_it_holds():
    idle = reading({10: [(0, 40 * GB, 0.0)]})
    h, now = history(*[idle] * 4)
    g = h.facts(10, idle, idle, now)
    f = facts(10, g)
    sample = process(
        10, parked(10), parked(11), listeners=(Listener("tcp", "0.0.0.0", 8000, 0, 128),)
    )
    f = ProcessFacts(sample, f.progress, 2, 300.0, (), g)
    v = classify_process(f, 60)
    assert v.state == IDLE
    assert "GPU 0: 0% for 30 s, 40 GB held" in reasons(v.reasons)
