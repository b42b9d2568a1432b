"""The /metrics exposition from hand-built ``Exposition`` objects: values, labels, golden text.

The golden file ``tests/golden/metrics.txt`` is the full /metrics text for ``EXPOSITION``
below, compared byte for byte. After an intended change to the metrics, rewrite it with

    HANGWATCH_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_metrics.py

and review the diff like code: alerts and dashboards rely on these names and labels.
"""

from __future__ import annotations

import itertools
import logging
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import make_wsgi_app
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from agent.analysis.verdict import DEADLOCKED, IDLE, STALLED, STATES
from agent.export.exposition import (
    AgentStatus,
    CollectorStatus,
    Exposition,
    ProcessStatus,
    ServiceStatus,
)
from agent.export.metrics import (
    BUCKET_BOUNDS_SECONDS,
    BUCKET_LOG2_NS,
    HangwatchCollector,
    bucket_index,
    futex_buckets,
    label_name,
    registry_for,
)
from agent.model import GpuDevice, ProgramStats

GOLDEN = Path(__file__).parent / "golden" / "metrics.txt"
VERSION = "0.0.0-test"  # fixed, so the golden file does not change with releases
COMMIT = "0123abc"  # and the same for the commit, which would otherwise be the checkout's HEAD
BUILD = {"version": VERSION, "commit": COMMIT}
GiB = 1 << 30

# Every family the metrics contract names (the README's metrics table), as exposed.
CONTRACT = {
    "hangwatch_service_state",
    "hangwatch_process_state",
    "hangwatch_process_threads",
    "hangwatch_process_parked_threads",
    "hangwatch_process_parked_seconds",
    "hangwatch_process_lock_cycles",
    "hangwatch_process_no_waker",
    "hangwatch_process_waiting_at",
    "hangwatch_process_world_size",
    "hangwatch_futex_wait_seconds",
    "hangwatch_process_write_bytes_total",
    "hangwatch_process_last_write_age_seconds",
    "hangwatch_process_accepts_total",
    "hangwatch_process_bpf_entries_refused_total",
    "hangwatch_process_bpf_events_dropped_total",
    "hangwatch_process_listening_ports",
    "hangwatch_process_gpu_memory_bytes",
    "hangwatch_process_gpu_utilization_ratio",
    "hangwatch_gpu_utilization_ratio",
    "hangwatch_gpu_memory_used_bytes",
    "hangwatch_gpu_memory_total_bytes",
    "hangwatch_gpu_info",
    "hangwatch_gpu_errors_total",
    "hangwatch_service_gpu_spin",
    "hangwatch_service_unanswered_requests",
    "hangwatch_service_seconds_since_progress",
    "hangwatch_bpf_events_dropped_total",
    "hangwatch_bpf_host_events_dropped_total",
    "hangwatch_bpf_map_full_total",
    "hangwatch_bpf_program_run_seconds_total",
    "hangwatch_bpf_program_runs_total",
    "hangwatch_collector_success",
    "hangwatch_collector_duration_seconds",
    "hangwatch_last_tick_timestamp_seconds",
    "hangwatch_park_threshold_seconds",
    "hangwatch_services_excess",
    "hangwatch_build_info",
    "hangwatch_tick_errors_total",
    "hangwatch_http_connections_dropped_total",
}


def proc(service: str, root: int, pid: int, comm: str, state: str, **kw) -> ProcessStatus:
    base = dict(threads=1, parked_threads=1, parked_seconds=0.0, lock_cycles=0)
    return ProcessStatus(service, root, pid, comm, state, **{**base, **kw})


# An SGLang server whose two TP ranks are stuck on a barrier (the launcher idles in wait4),
# a two-mutex deadlock, and an idle HTTP server that never wrote anything.
SGLANG = ServiceStatus(
    "sglang",
    100,
    STALLED,
    (
        proc(
            "sglang", 100, 100, "python3", STALLED, threads=12, parked_threads=12,
            parked_seconds=312.5, write_bytes_total=123_456, last_write_age_seconds=312.0,
            accepts_total=42, listening_ports=1, futex_wait_slots={12: 5, 20: 3},
        ),
        proc(
            "sglang", 100, 101, "sglang::schedul", STALLED, threads=40, parked_threads=40,
            parked_seconds=312.5, labels={"rank": "0", "local_rank": "0"},
            waiting_at="barrier (sglang/srt/managers/scheduler.py:2120)", world_size=2,
            futex_wait_slots={10: 100, 11: 7, 23: 2, 37: 1}, gpu_memory_bytes={"0": 70 * GiB},
            gpu_utilization={"0": 0.0},
        ),
        proc(
            "sglang", 100, 102, "sglang::schedul", STALLED, threads=40, parked_threads=40,
            parked_seconds=312.5, labels={"rank": "1", "local_rank": "1"},
            write_bytes_total=0, futex_wait_slots={9: 3, 35: 1},
            gpu_memory_bytes={"1": 70 * GiB, "10": 512 << 20},
        ),
    ),
    unanswered_requests=3,
    seconds_since_progress=400.0,  # its oldest unanswered request is older than its park
)  # fmt: skip
PINNED = ServiceStatus(
    "pinned",
    200,
    DEADLOCKED,
    (
        proc(
            "pinned", 200, 200, "deadlock_mutex", DEADLOCKED, threads=4, parked_threads=3,
            lock_cycles=1, write_bytes_total=64, last_write_age_seconds=7.5,
            futex_wait_slots={14: 1},
        ),
    ),
)  # fmt: skip
HTTP = ServiceStatus(
    "http",
    300,
    IDLE,
    (
        proc(
            "http", 300, 300, "python", IDLE, parked_seconds=3.4, write_bytes_total=0,
            accepts_total=0, listening_ports=1, bpf_entries_refused_total=7,
            bpf_events_dropped_total=5,
        ),
    ),
    seconds_since_progress=3.4,
)  # fmt: skip
AGENT = AgentStatus(
    version="0.1.0",  # what the daemon says; build info uses the collector's own version
    events_dropped_total=2,
    host_events_dropped_total=4,
    maps_full_total=1,
    services_excess={"sglang": 0, "vllm": 1968},
    programs={
        "futex_exit": ProgramStats(run_seconds=0.5, run_count=20_000),
        "futex_enter": ProgramStats(run_seconds=0.25, run_count=20_001),
    },
    collectors={
        "proc": CollectorStatus(True, 0.034),
        "discovery": CollectorStatus(True, 0.002),
        "gpu": CollectorStatus(False, 0.5),
    },
    gpus=(
        GpuDevice(1, "GPU-bbbb", "NVIDIA H200", 141 * GiB, 71 * GiB, 0.0),
        GpuDevice(0, "GPU-aaaa", "NVIDIA H200", 141 * GiB, 71 * GiB, 0.0),
        GpuDevice(10, "GPU-cccc", "NVIDIA H200", 141 * GiB, 1 * GiB, 0.25),
    ),
    gpu_errors_total=3,
    park_threshold_seconds=60.0,
    tick_errors_total=1,
    http_connections_dropped={"deadline": 140, "evicted": 0, "full": 0},
)
EXPOSITION = Exposition((SGLANG, PINNED, HTTP), AGENT)


def fixed_clock():
    # Every scrape reads the clock twice: start, end. Alternating values: 0.25 s a scrape.
    return itertools.cycle([10.0, 10.25]).__next__


def registry(exposition: Exposition | None = EXPOSITION):
    return registry_for(lambda: exposition, version=VERSION, commit=COMMIT, clock=fixed_clock())


def scrape(reg: CollectorRegistry, accept: str = "text/plain") -> str:
    """The /metrics body as the daemon serves it (``make_wsgi_app`` over the registry, as in
    ``daemon.run``), for a client that asks for ``accept``."""
    environ = {"REQUEST_METHOD": "GET", "PATH_INFO": "/metrics", "HTTP_ACCEPT": accept}
    replies: list[tuple[str, list[tuple[str, str]]]] = []
    body = b"".join(make_wsgi_app(reg)(environ, lambda *reply: replies.append(reply)))
    ((status, _),) = replies
    assert status == "200 OK"
    return body.decode()


def plabels(service: str, root: int, pid: int, comm: str, **env: str) -> dict[str, str]:
    labels = {"service": service, "service_pid": str(root), "pid": str(pid), "comm": comm}
    return {**labels, "rank": "", "local_rank": "", **env}


ROOT = plabels("sglang", 100, 100, "python3")
RANK0 = plabels("sglang", 100, 101, "sglang::schedul", rank="0", local_rank="0")
RANK1 = plabels("sglang", 100, 102, "sglang::schedul", rank="1", local_rank="1")
DEADLOCK = plabels("pinned", 200, 200, "deadlock_mutex")
IDLE_HTTP = plabels("http", 300, 300, "python")


def samples(reg):
    return [s for fam in reg.collect() for s in fam.samples]


def test_service_state_is_one_hot():
    reg = registry()
    for svc in EXPOSITION.services:
        values = {
            state: reg.get_sample_value(
                "hangwatch_service_state",
                {"service": svc.service, "pid": str(svc.pid), "state": state},
            )
            for state in STATES
        }
        assert values == {s: (1.0 if s == svc.state else 0.0) for s in STATES}


def test_process_state_is_one_hot_per_process():
    reg = registry()
    for labels, current in [(ROOT, STALLED), (RANK0, STALLED), (DEADLOCK, DEADLOCKED)]:
        for state in STATES:
            want = 1.0 if state == current else 0.0
            got = reg.get_sample_value("hangwatch_process_state", {**labels, "state": state})
            assert got == want, (labels, state)


def test_process_gauges_carry_env_labels_and_empty_strings_where_missing():
    reg = registry()
    assert reg.get_sample_value("hangwatch_process_threads", RANK0) == 40
    assert reg.get_sample_value("hangwatch_process_threads", ROOT) == 12
    assert reg.get_sample_value("hangwatch_process_parked_threads", DEADLOCK) == 3
    assert reg.get_sample_value("hangwatch_process_parked_seconds", RANK1) == 312.5
    assert reg.get_sample_value("hangwatch_process_parked_seconds", DEADLOCK) == 0
    assert reg.get_sample_value("hangwatch_process_lock_cycles", DEADLOCK) == 1
    assert reg.get_sample_value("hangwatch_process_listening_ports", IDLE_HTTP) == 1
    # One label set for the whole family: a process without RANK still has rank="".
    names = {
        frozenset(s.labels)
        for s in samples(reg)
        if s.name in ("hangwatch_process_threads", "hangwatch_process_parked_seconds")
    }
    assert names == {frozenset(ROOT)}


def test_no_tid_label_anywhere():
    exp = Exposition(
        (ServiceStatus("x", 1, IDLE, (proc("x", 1, 1, "x", IDLE, labels={"TID": "7"}),)),),
        AGENT,
    )
    for reg in (registry(), registry(exp)):
        for s in samples(reg):
            assert "tid" not in s.labels, s
    assert registry(exp).get_sample_value(
        "hangwatch_process_threads",
        {"service": "x", "service_pid": "1", "pid": "1", "comm": "x", "env_tid": "7"},
    )


def test_env_label_names_cannot_shadow_ours_or_be_invalid():
    assert label_name("RANK") == "rank"
    assert label_name("LOCAL_RANK") == "local_rank"
    assert label_name("PID") == "env_pid"
    assert label_name("le") == "env_le"
    assert label_name("9LIVES") == "env_9lives"
    assert label_name("__name__") == "env___name__"
    assert label_name("A-B.C") == "a_b_c"


def test_counters_and_ages_are_omitted_when_unknown():
    reg = registry()
    assert reg.get_sample_value("hangwatch_process_write_bytes_total", ROOT) == 123_456
    assert reg.get_sample_value("hangwatch_process_write_bytes_total", RANK1) == 0
    assert reg.get_sample_value("hangwatch_process_write_bytes_total", RANK0) is None
    assert reg.get_sample_value("hangwatch_process_last_write_age_seconds", ROOT) == 312.0
    assert reg.get_sample_value("hangwatch_process_last_write_age_seconds", IDLE_HTTP) is None
    assert reg.get_sample_value("hangwatch_process_accepts_total", ROOT) == 42
    assert reg.get_sample_value("hangwatch_process_accepts_total", IDLE_HTTP) == 0
    assert reg.get_sample_value("hangwatch_process_accepts_total", DEADLOCK) is None


def test_futex_histogram_buckets_are_cumulative_with_count_and_approximate_sum():
    reg = registry()

    def bucket(le: str) -> float | None:
        return reg.get_sample_value("hangwatch_futex_wait_seconds_bucket", {**RANK0, "le": le})

    # Slots {10: 100, 11: 7, 23: 2, 37: 1}: [1024, 2048) ns and [2048, 4096) ns end at
    # 4.096 us; [2^23, 2^24) ns at 2^24 ns; 2^37 ns (137 s) is past the last bound.
    assert bucket("1.024e-06") == 0
    assert bucket("4.096e-06") == 107
    assert bucket("0.004194304") == 107
    assert bucket("0.016777216") == 109
    assert bucket("68.719476736") == 109
    assert bucket("+Inf") == 110
    assert reg.get_sample_value("hangwatch_futex_wait_seconds_count", RANK0) == 110
    want_sum = (100 * 1.5 * 2**10 + 7 * 1.5 * 2**11 + 2 * 1.5 * 2**23 + 1.5 * 2**37) / 1e9
    assert reg.get_sample_value("hangwatch_futex_wait_seconds_sum", RANK0) == pytest.approx(
        want_sum
    )
    values = [
        s.value
        for s in samples(reg)
        if s.name == "hangwatch_futex_wait_seconds_bucket" and s.labels["pid"] == "101"
    ]
    assert values == sorted(values)
    # A process with no waits yet still has the histogram, all zero, so rate() starts at once.
    assert reg.get_sample_value("hangwatch_futex_wait_seconds_count", IDLE_HTTP) == 0
    assert reg.get_sample_value("hangwatch_futex_wait_seconds_sum", IDLE_HTTP) == 0


def test_every_process_has_the_same_bucket_bounds():
    reg = registry()
    les: dict[str, list[str]] = {}
    for s in samples(reg):
        if s.name == "hangwatch_futex_wait_seconds_bucket":
            les.setdefault(s.labels["pid"], []).append(s.labels["le"])
    assert len(les) == 5
    assert len({tuple(v) for v in les.values()}) == 1
    assert next(iter(les.values()))[-1] == "+Inf"


@given(st.integers(min_value=0, max_value=63))
def test_each_slot_lands_in_the_smallest_bound_that_holds_its_upper_edge(slot):
    i = bucket_index(slot)
    edge_s = 2 ** (slot + 1) / 1e9
    bounds = [*BUCKET_BOUNDS_SECONDS, float("inf")]
    assert bounds[i] >= edge_s
    assert i == 0 or bounds[i - 1] < edge_s
    # Bounds are slot edges, so the bucket holds every wait of the slot and no bound cuts it.
    assert i == len(BUCKET_LOG2_NS) or BUCKET_LOG2_NS[i] >= slot + 1


@given(st.dictionaries(st.integers(0, 63), st.integers(0, 10**9), max_size=20))
def test_futex_buckets_count_every_wait_once(slots):
    buckets, sum_s = futex_buckets(slots)
    counts = [n for _, n in buckets]
    assert counts == sorted(counts)
    assert counts[-1] == sum(slots.values())
    assert sum_s >= 0


def test_gpu_memory_per_gpu_and_utilization():
    reg = registry()
    assert reg.get_sample_value("hangwatch_process_gpu_memory_bytes", {**RANK0, "gpu": "0"}) == (
        70 * GiB
    )
    assert reg.get_sample_value("hangwatch_process_gpu_memory_bytes", {**RANK1, "gpu": "10"}) == (
        512 << 20
    )
    assert reg.get_sample_value("hangwatch_process_gpu_memory_bytes", {**ROOT, "gpu": "0"}) is None
    assert reg.get_sample_value("hangwatch_gpu_utilization_ratio", {"gpu": "10"}) == 0.25
    assert (
        reg.get_sample_value("hangwatch_process_gpu_utilization_ratio", {**RANK0, "gpu": "0"}) == 0
    )
    assert reg.get_sample_value("hangwatch_gpu_memory_used_bytes", {"gpu": "0"}) == 71 * GiB
    assert reg.get_sample_value("hangwatch_gpu_memory_total_bytes", {"gpu": "10"}) == 141 * GiB
    info = {"gpu": "1", "uuid": "GPU-bbbb", "name": "NVIDIA H200"}
    assert reg.get_sample_value("hangwatch_gpu_info", info) == 1
    assert reg.get_sample_value("hangwatch_gpu_errors_total") == 3


def test_gpu_spin_is_one_per_service():
    spinning = Exposition(
        (ServiceStatus("nccl", 7, "stalled", (), gpu_spin=True), ServiceStatus("ok", 8, "idle")),
        AgentStatus(version="x"),
    )
    reg = registry_for(lambda: spinning, commit=COMMIT)
    assert reg.get_sample_value("hangwatch_service_gpu_spin", {"service": "nccl", "pid": "7"}) == 1
    assert reg.get_sample_value("hangwatch_service_gpu_spin", {"service": "ok", "pid": "8"}) == 0
    # No GPU reading at all: no device series and no error counter.
    assert reg.get_sample_value("hangwatch_gpu_errors_total") is None


def test_unanswered_requests_and_seconds_since_progress_per_service():
    exp = Exposition((SGLANG, PINNED, HTTP), AGENT)
    reg = registry_for(lambda: exp, commit=COMMIT)

    def get(name: str, service: str, pid: int) -> float | None:
        return reg.get_sample_value(name, {"service": service, "pid": str(pid)})

    assert get("hangwatch_service_unanswered_requests", "sglang", 100) == 3
    assert get("hangwatch_service_seconds_since_progress", "sglang", 100) == 400.0
    assert get("hangwatch_service_unanswered_requests", "http", 300) == 0
    assert get("hangwatch_service_seconds_since_progress", "http", 300) == 3.4
    # A deadlock's verdict does not use them: 0, but still one series per service.
    assert get("hangwatch_service_unanswered_requests", "pinned", 200) == 0
    assert get("hangwatch_service_seconds_since_progress", "pinned", 200) == 0


def test_self_metrics():
    reg = registry()
    assert reg.get_sample_value("hangwatch_bpf_events_dropped_total") == 2
    assert reg.get_sample_value("hangwatch_bpf_map_full_total") == 1
    assert reg.get_sample_value(
        "hangwatch_bpf_program_run_seconds_total", {"program": "futex_enter"}
    ) == (0.25)
    assert reg.get_sample_value("hangwatch_bpf_program_runs_total", {"program": "futex_exit"}) == (
        20_000
    )
    assert reg.get_sample_value("hangwatch_collector_success", {"collector": "gpu"}) == 0
    assert reg.get_sample_value("hangwatch_collector_success", {"collector": "proc"}) == 1
    assert reg.get_sample_value("hangwatch_collector_success", {"collector": "exposition"}) == 1
    assert reg.get_sample_value(
        "hangwatch_collector_duration_seconds", {"collector": "exposition"}
    ) == (0.25)
    assert reg.get_sample_value("hangwatch_build_info", BUILD) == 1


def test_golden_metrics_text():
    text = scrape(registry())
    if os.environ.get("HANGWATCH_UPDATE_GOLDEN") == "1":
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text(), (
        "/metrics changed; if intended: HANGWATCH_UPDATE_GOLDEN=1 pytest tests/test_metrics.py"
    )


def test_golden_text_parses_and_every_family_has_help_and_type():
    families = list(text_string_to_metric_families(GOLDEN.read_text()))
    exposed = set()
    for fam in families:
        assert fam.documentation.strip(), fam.name
        assert fam.type in ("gauge", "counter", "histogram"), fam.name
        assert fam.samples, fam.name
        exposed.add(fam.name + "_total" if fam.type == "counter" else fam.name)
    assert exposed == CONTRACT
    names = {s.name for fam in families for s in fam.samples}
    assert "hangwatch_build_info" in names
    assert not any(n.endswith("_info_info") or n == "hangwatch_build" for n in names)


def test_openmetrics_rendering_works_too():
    # The HTTP handler negotiates OpenMetrics when Prometheus asks for it.
    text = scrape(registry(), "application/openmetrics-text; version=1.0.0")
    assert text.endswith("# EOF\n")
    assert 'hangwatch_build_info{commit="0123abc",version="0.0.0-test"} 1.0' in text


def test_source_none_before_the_first_tick():
    reg = registry(None)
    assert reg.get_sample_value("hangwatch_build_info", BUILD) == 1
    assert reg.get_sample_value("hangwatch_collector_success", {"collector": "exposition"}) == 1
    assert {s.name for s in samples(reg)} == {
        "hangwatch_build_info",
        "hangwatch_collector_success",
        "hangwatch_collector_duration_seconds",
    }
    list(text_string_to_metric_families(scrape(reg)))


def test_source_raising_still_scrapes_and_logs_once_until_it_recovers(caplog):
    state = {"fail": True}

    def source():
        if state["fail"]:
            raise RuntimeError("boom")
        return EXPOSITION

    reg = registry_for(source, version=VERSION, commit=COMMIT)
    with caplog.at_level(logging.INFO, logger="agent.export.metrics"):
        for _ in range(3):
            text = scrape(reg)
            families = {f.name for f in text_string_to_metric_families(text)}
            assert families == {
                "hangwatch_build_info",
                "hangwatch_collector_success",
                "hangwatch_collector_duration_seconds",
            }
            assert reg.get_sample_value("hangwatch_build_info", BUILD) == 1
            assert (
                reg.get_sample_value("hangwatch_collector_success", {"collector": "exposition"})
                == 0
            )
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and "boom" in (errors[0].exc_text or "")
        state["fail"] = False
        assert reg.get_sample_value("hangwatch_service_state", ROOT_STATE) == 1
        assert any("again" in r.getMessage() for r in caplog.records)


ROOT_STATE = {"service": "sglang", "pid": "100", "state": STALLED}


def test_a_malformed_exposition_does_not_break_the_scrape():
    bad = Exposition((ServiceStatus("x", 1, IDLE, (None,)),), AGENT)
    reg = registry(bad)
    assert reg.get_sample_value("hangwatch_collector_success", {"collector": "exposition"}) == 0
    assert reg.get_sample_value("hangwatch_service_state", {**ROOT_STATE, "service": "x"}) is None
    assert reg.get_sample_value("hangwatch_build_info", BUILD) == 1


def test_unknown_state_exports_all_zero_and_does_not_raise():
    exp = Exposition((ServiceStatus("x", 1, "gone", (proc("x", 1, 1, "x", "gone"),)),), AGENT)
    reg = registry(exp)
    values = [s.value for s in samples(reg) if s.name.endswith("_state")]
    assert len(values) == 8
    assert values == [0.0] * 8


def test_no_waker_tells_a_deadlock_without_a_cycle():
    hung = ServiceStatus(
        "pool", 400, DEADLOCKED,
        (proc("pool", 400, 400, "python3", DEADLOCKED, threads=3, parked_threads=3,
              lock_cycles=0, no_waker=True),),
    )  # fmt: skip
    reg = registry(Exposition((hung, PINNED), AGENT))
    got = {
        (s.labels["pid"], s.name): s.value
        for s in samples(reg)
        if s.name in ("hangwatch_process_no_waker", "hangwatch_process_lock_cycles")
    }
    assert got == {
        ("400", "hangwatch_process_no_waker"): 1,
        ("400", "hangwatch_process_lock_cycles"): 0,
        ("200", "hangwatch_process_no_waker"): 0,
        ("200", "hangwatch_process_lock_cycles"): 1,
    }, got


def test_duplicate_series_are_exported_once():
    exp = Exposition((SGLANG, SGLANG), AGENT)
    reg = registry(exp)
    threads = [s for s in samples(reg) if s.name == "hangwatch_process_threads"]
    assert len(threads) == 3


def test_describe_names_the_families_without_reading_the_source():
    calls = []

    def source():
        calls.append(1)
        return EXPOSITION

    collector = HangwatchCollector(source, version=VERSION, commit=COMMIT)
    described = {m.name for m in collector.describe()}
    assert {m + "_total" if m + "_total" in CONTRACT else m for m in described} == CONTRACT
    reg = registry_for(source, commit=COMMIT)
    assert calls == []
    with pytest.raises(ValueError, match="Duplicated"):
        reg.register(HangwatchCollector(source, commit=COMMIT))
    scrape(reg)
    assert calls == [1]


# -- property: one-hot states, samples proportional to processes, nothing kept between scrapes


@st.composite
def expositions(draw):
    pids = st.integers(1000, 4_000_000)
    names = st.sampled_from(["sglang", "vllm", "trt", "any-gpu"])
    n_services = draw(st.integers(0, 4))
    used: set[int] = set()
    services = []
    for _ in range(n_services):
        root = draw(pids.filter(lambda p: p not in used))
        used.add(root)
        name = draw(names)
        procs = []
        members = [root]
        for pid in draw(st.lists(pids, max_size=4, unique=True)):
            if pid not in used:  # a pid belongs to one service only
                used.add(pid)
                members.append(pid)
        for pid in members:
            procs.append(
                proc(
                    name,
                    root,
                    pid,
                    draw(st.sampled_from(["python3", "sglang::schedul", "tritonserver"])),
                    draw(st.sampled_from(STATES)),
                    threads=draw(st.integers(1, 64)),
                    labels=draw(
                        st.dictionaries(
                            st.sampled_from(["rank", "local_rank", "world_size"]),
                            st.sampled_from(["0", "1", "7"]),
                        )
                    ),
                    write_bytes_total=draw(st.none() | st.integers(0, 2**40)),
                    last_write_age_seconds=draw(st.none() | st.floats(0, 1e6)),
                    accepts_total=draw(st.none() | st.integers(0, 10**6)),
                    futex_wait_slots=draw(
                        st.dictionaries(st.integers(0, 40), st.integers(0, 10**6), max_size=5)
                    ),
                    gpu_memory_bytes=draw(
                        st.dictionaries(st.sampled_from(["0", "1"]), st.integers(0, 80 * GiB))
                    ),
                )
            )
        services.append(ServiceStatus(name, root, draw(st.sampled_from(STATES)), tuple(procs)))
    return Exposition(tuple(services), AgentStatus(version="x"))


def by_name(reg) -> dict[str, list]:
    out: dict[str, list] = {}
    for s in samples(reg):
        out.setdefault(s.name, []).append(s)
    return out


@settings(max_examples=60, deadline=None)
@given(expositions(), expositions())
def test_states_one_hot_and_samples_follow_the_current_exposition(a, b):
    current = [a]
    reg = registry_for(lambda: current[0], version=VERSION, commit=COMMIT)
    scrape(reg)  # a scrape of A first: nothing of it may survive into B's
    current[0] = b
    got = by_name(reg)
    procs = [p for s in b.services for p in s.processes]

    ones: dict[tuple[str, str], list[float]] = {}
    for s in got.get("hangwatch_service_state", []):
        ones.setdefault((s.labels["service"], s.labels["pid"]), []).append(s.value)
    assert len(ones) == len(b.services)
    assert all(sorted(v) == [0.0, 0.0, 0.0, 1.0] for v in ones.values())

    per_pid: dict[str, list[float]] = {}
    for s in got.get("hangwatch_process_state", []):
        per_pid.setdefault(s.labels["pid"], []).append(s.value)
    assert all(sorted(v) == [0.0, 0.0, 0.0, 1.0] for v in per_pid.values())

    n = len(procs)
    assert len(got.get("hangwatch_process_threads", [])) == n
    assert len(got.get("hangwatch_process_state", [])) == 4 * n
    assert len(got.get("hangwatch_futex_wait_seconds_bucket", [])) == 15 * n
    assert len(got.get("hangwatch_process_write_bytes_total", [])) == sum(
        p.write_bytes_total is not None for p in procs
    )
    assert len(got.get("hangwatch_process_gpu_memory_bytes", [])) == sum(
        len(p.gpu_memory_bytes) for p in procs
    )

    b_pids = {str(p.pid) for p in procs} | {str(s.pid) for s in b.services}
    seen = {s.labels["pid"] for v in got.values() for s in v if "pid" in s.labels}
    assert seen <= b_pids
    text = scrape(reg)
    for pid in {str(p.pid) for s in a.services for p in s.processes} - b_pids:
        assert f'pid="{pid}"' not in text


def test_waiting_at_and_world_size_are_exported_where_the_process_has_them():
    ranked = proc(
        "trainer", 500, 501, "python3", STALLED, parked_seconds=90.0,
        labels={"rank": "2", "world_size": "4"}, waiting_at="all_reduce (train.py:57)",
        world_size=4,
    )  # fmt: skip
    helper = proc("trainer", 500, 502, "pt_data_worker", STALLED, labels={"rank": "2"})
    exp = Exposition((ServiceStatus("trainer", 500, STALLED, (ranked, helper)),), AGENT)
    reg = registry(exp)
    at = [s for s in samples(reg) if s.name == "hangwatch_process_waiting_at"]
    assert [(s.labels["pid"], s.labels["site"], s.value) for s in at] == [
        ("501", "all_reduce (train.py:57)", 1.0)
    ]
    size = [s for s in samples(reg) if s.name == "hangwatch_process_world_size"]
    assert [(s.labels["pid"], s.value) for s in size] == [("501", 4.0)]


def test_an_environment_label_cannot_take_the_site_label():
    assert label_name("SITE") == "env_site"
