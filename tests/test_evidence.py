"""Evidence records (agent.analysis.evidence) and their words (agent.report.sentences): every kind of fact has
its own sentence and its JSON, and the sentences users read are exact."""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
from dataclasses import dataclass
from typing import Any

import pytest

from agent.analysis import evidence as ev
from agent.model import FdLink, FdWait, SocketPeer
from agent.report import sentences as words

FACTS = sorted(
    (c for _, c in inspect.getmembers(ev, inspect.isclass) if issubclass(c, ev.Fact)),
    key=lambda c: c.__name__,
)
FACTS.remove(ev.Fact)

LINKS = (ev.CycleLink(11, "sched", "mutex", 0xA0, 12), ev.CycleLink(12, "io", "pi", 0xB0, 11))
NESTED = (ev.CpuWork(2, 1.5, 5.0), ev.WroteOut(2048, 5.0))

# One plausible value per annotated type (the annotations are strings: PEP 563).
BY_TYPE: dict[str, Any] = {
    "int": 3,
    "float": 12.345678,
    "str": "text",
    "bool": True,
    "bool | None": False,
    "int | None": 2,
    "float | None": 7.25,
    "tuple[int, ...]": (0, 1, 2),
    "tuple[float, ...]": (41.5, 2.25),
    "tuple[tuple[str, str], ...]": (("rank", "0"),),
    "tuple[tuple[int, DoorWhy], ...]": ((8000, ev.DoorWhy(ev.DoorRule.DECLARED)),),
    "tuple[CycleLink, ...]": LINKS,
    "tuple[Fact, ...]": NESTED,
    "tuple[tuple[str, bool | None, int], ...]": (("futex", False, 3), ("epoll_wait", None, 1)),
    "str | None": "with self.lock:",
    "tuple[str, ...]": ("worker-0", "worker-1", "worker-2"),
    "tuple[tuple[ThreadWait, int], ...]": ((ev.ThreadWait("syscall", "epoll_wait", "io"), 2),),
    "ThreadWait": ev.ThreadWait("syscall", "futex", "futex", "WAIT_BITSET", False),
    "Spins": ev.Spins(1, 4.93, 57660, 5.0),
    "tuple[LockAt, ...]": (
        ev.LockAt(11, "evict", "sched.py", 154, "with self.b:"),
        ev.LockAt(12, "update", "sched.py", 160, None),
    ),
}
# Fields whose str is one of a few words.
BY_NAME: dict[str, Any] = {
    "since": "request",
    "what": "write",
    "why": "own waits",
    "state": "stalled",
    "lock_kind": "mutex",
    "owner_kind": "mutex",
    "op": "WAIT",
    "at": 1_700_000_000.0,
    "target": "/var/log/server.log",
    "comm": "python",
    "name": "worker",
    "word": "`abba_a` in libabba.so+0x40a0",
    "native": "`abba_ab` in libabba.so+0x1188",
    "on": FdWait((FdLink(7, "a socket (fd 7)", SocketPeer("tcp", 5000, "10.0.0.2")),)),
}


def build(cls: type[ev.Fact], optional_none: bool = False) -> ev.Fact:
    kw = {}
    for f in dataclasses.fields(cls):
        if optional_none and f.type.endswith("| None"):
            kw[f.name] = None
        elif f.name in BY_NAME:
            kw[f.name] = BY_NAME[f.name]
        else:
            assert f.type in BY_TYPE, f"{cls.__name__}.{f.name}: no test value for {f.type}"
            kw[f.name] = BY_TYPE[f.type]
    return cls(**kw)


def fallback(f: ev.Fact) -> str:
    return f.kind.replace("_", " ")


def test_the_module_has_the_facts_it_is_known_to_have() -> None:
    # Introspection found them all, not an empty list the loops below would pass on.
    names = {c.__name__ for c in FACTS}
    assert {"CpuWork", "Culprit", "LockCycle", "ProcessWaits", "NoFrontDoor"} <= names
    assert len(FACTS) >= 29


RENDERED = FACTS


@pytest.mark.parametrize("cls", RENDERED, ids=lambda c: c.__name__)
@pytest.mark.parametrize("optional_none", [False, True], ids=["values", "nones"])
def test_every_fact_has_its_own_words(cls: type[ev.Fact], optional_none: bool) -> None:
    f = build(cls, optional_none)
    text = words.render(f)
    assert isinstance(text, str) and text.strip()
    assert text != fallback(f), f"{cls.__name__} has no sentence of its own"
    assert "None" not in text, text
    assert words.reasons([f, f]) == [text, text]


def test_a_fact_without_words_falls_back_to_its_kind() -> None:
    """What the test above guards against: a new record render does not know."""

    @dataclass(frozen=True)
    class BrandNewThing(ev.Fact):
        n: int

    f = BrandNewThing(1)
    assert f.kind == "brand_new_thing"
    assert words.render(f) == "brand new thing" == fallback(f)


def test_kinds_are_snake_case_and_distinct() -> None:
    kinds = [build(c).kind for c in FACTS]
    assert len(set(kinds)) == len(kinds)
    assert all(re.fullmatch(r"[a-z]+(_[a-z]+)*", k) for k in kinds), kinds
    assert ev.CpuWork(1, 1.0, 1.0).kind == "cpu_work"
    assert ev.GpuIdle((0,), 1.0, None, 0).kind == "gpu_idle"


@pytest.mark.parametrize("cls", FACTS, ids=lambda c: c.__name__)
def test_as_json_gives_the_kind_and_every_field(cls: type[ev.Fact]) -> None:
    f = build(cls)
    out = ev.as_json(f)
    names = [fl.name for fl in dataclasses.fields(cls)]
    assert list(out) == ["kind", *names]
    assert out["kind"] == f.kind
    for name in names:
        v = getattr(f, name)
        if isinstance(v, float):
            assert out[name] == round(v, 3)
        elif isinstance(v, tuple):
            assert isinstance(out[name], list) and len(out[name]) == len(v)
        elif isinstance(v, ev.Fact):
            assert out[name] == ev.as_json(v)
        elif dataclasses.is_dataclass(v):
            assert out[name] == dataclasses.asdict(v)
        else:
            assert out[name] == v
    shown = words.evidence_json(f)  # --json's form: the fields that stand for words in words
    assert list(shown) == list(out)
    assert json.loads(json.dumps(shown))["kind"] == f.kind  # it is JSON as it stands


def test_json_gives_typed_fields_in_the_words_of_the_reasons() -> None:
    doors = ev.Doors(
        ((8000, ev.DoorWhy(ev.DoorRule.CLIENTS, peer=("10.0.0.9", 51000), more=1)),),
        (
            (
                29500,
                ev.DoorWhy(ev.DoorRule.PLUMBING, ev.Holder(11, "python", rank=True), "MASTER_PORT"),
            ),
        ),
    )
    assert words.evidence_json(doors) == {
        "kind": "doors",
        "front": [[8000, "clients from outside connect to it: from 10.0.0.9:51000 and 1 more"]],
        "plumbing": [[29500, "MASTER_PORT of rank pid 11"]],
    }
    at = words.evidence_json(ev.ListeningSince(8000, 1_700_000_000.0))["at"]
    assert at == words.clock(1_700_000_000.0) and re.fullmatch(r"\d\d:\d\d:\d\d", at)
    ran = ev.LastProgress("ran", ev.Thread(10, "ray::Stuck"), 10, 41.0)
    assert words.evidence_json(ran)["target"] == "thread 10 (ray::Stuck)"
    assert (
        words.render(ran) == "last thread to run stopped 41 s ago: thread 10 (ray::Stuck) (pid 10)"
    )


def test_as_json_rounds_floats_and_nests_facts() -> None:
    works = ev.ProcessWorks(42, "python", NESTED)
    assert ev.as_json(works) == {
        "kind": "process_works",
        "pid": 42,
        "comm": "python",
        "facts": [
            {"kind": "cpu_work", "threads": 2, "cpu_s": 1.5, "window_s": 5.0},
            {"kind": "wrote_out", "bytes": 2048, "window_s": 5.0, "answered": 0},
        ],
    }
    cycle = ev.as_json(ev.LockCycle(LINKS))
    assert cycle["kind"] == "lock_cycle"
    assert cycle["links"][0] == {
        "kind": "cycle_link",
        "tid": 11,
        "name": "sched",
        "lock_kind": "mutex",
        "uaddr": 0xA0,
        "owner": 12,
        "word": None,
    }
    assert [x["tid"] for x in cycle["links"]] == [11, 12]
    assert ev.as_json(ev.AllParked(4, 1, 61.23456))["seconds"] == 61.235
    assert ev.as_json(ev.Exited()) == {"kind": "exited", "pid": None}


# --- sentences users rely on ---------------------------------------------------------------


def test_past_threshold_says_what_dates_it() -> None:
    assert words.render(ev.PastThreshold(95.4, 60, "request")) == (
        "no progress for 95 s (since the oldest unanswered request), past the 60 s threshold"
    )
    assert words.render(ev.PastThreshold(300, 60, "write")) == (
        "no progress for 300 s (since the last write out of the service), past the 60 s threshold"
    )
    assert words.render(ev.PastThreshold(70, 60, "ran")) == (
        "no progress for 70 s (since when its last thread to run stopped), past the 60 s threshold"
    )
    # Parked time is said by AllParked already.
    assert words.render(ev.PastThreshold(70, 60, "parked")) == "past the 60 s threshold"


def test_under_threshold() -> None:
    assert words.render(ev.UnderThreshold(59, 60)) == (
        "no progress for 59 s, under the 60 s threshold"
    )
    assert words.render(ev.UnderThreshold(2.5, 5)) == (
        "no progress for 2.5 s, under the 5.0 s threshold"
    )


def test_culprit_in_a_cycle() -> None:
    f = ev.Culprit(4242, "python", "cycle", labels=(("rank", "1"), ("job", "train")))
    assert words.render(f) == (
        "held up by process 4242 (python) [rank=1 job=train]: its threads are in the lock cycle"
    )
    assert words.render(ev.Culprit(7, "sched", "cycle")) == (
        "held up by process 7 (sched): its threads are in the lock cycle"
    )


def test_culprit_by_its_own_waits() -> None:
    one = ev.Culprit(4243, "pt_data_worker", "own waits", threads=1, age_s=95.2)
    assert words.render(one) == (
        "held up by process 4243 (pt_data_worker): 1 thread waits with no timeout on locks or "
        "events of its own, the oldest for 95 s, while the other processes wait on I/O or with "
        "timeouts"
    )
    three = ev.Culprit(4244, "python", "own waits", threads=3)
    assert words.render(three) == (
        "held up by process 4244 (python): 3 threads wait with no timeout on locks or events of "
        "its own, while the other processes wait on I/O or with timeouts"
    )


def test_process_waits() -> None:
    f = ev.ProcessWaits((("futex", False, 3), ("epoll_wait", True, 1), ("read", None, 1)), 2, 95)
    assert words.render(f) == (
        "waits: 3 threads in futex with no timeout, 1 thread in epoll_wait with a timeout, "
        "1 thread in read, 2 running (the oldest untimed futex wait began 95 s ago)"
    )


def test_seconds() -> None:
    assert words.seconds(0) == "0.0 s"
    assert words.seconds(2.54) == "2.5 s"
    assert words.seconds(9.94) == "9.9 s"
    assert words.seconds(10) == "10 s"
    assert words.seconds(59.4) == "59 s"
    assert words.seconds(3600) == "3600 s"


def test_size() -> None:
    assert words.size(0) == "0 B"
    assert words.size(1023) == "1023 B"
    assert words.size(1024) == "1.0 KiB"
    assert words.size(1536) == "1.5 KiB"
    assert words.size(1024**2) == "1.0 MiB"
    assert words.size(5 * 1024**3) == "5.0 GiB"
    assert words.size(2048 * 1024**3) == "2048.0 GiB"  # no unit past GiB


def test_gpu_list() -> None:
    assert words.gpu_list([]) == "no GPU"
    assert words.gpu_list([0]) == "GPU 0"
    assert words.gpu_list(range(8)) == "GPU 0-7"
    assert words.gpu_list([5, 0, 2]) == "GPU 0,2,5"
    assert words.gpu_list([7, 0, 1, 3, 4, 5]) == "GPU 0-1,3-5,7"
    assert words.gpu_list([2, 2, 3]) == "GPU 2-3"
    assert words.gpu_list(iter([6])) == "GPU 6"
