"""The wait-for graph from synthetic snapshots: edges only where an owner is readable."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from agent.analysis.waitgraph import WaitForGraph, owner_cycles
from agent.model import (
    FUTEX_WAIT_BITSET,
    FutexWait,
    LockRead,
    Refusal,
    ThreadSample,
    owner_candidate,
)
from tests.synth import on_mutex, on_pi, parked, process, running, snapshot


def test_two_threads_on_opposite_mutexes_form_one_cycle():
    snap = snapshot(process(10, on_mutex(11, 0xA0, owner=12), on_mutex(12, 0xB0, owner=11)))
    g = WaitForGraph(snap)
    assert g.cycles() == [(11, 12)]
    assert {e.kind for e in g.edges.values()} == {"mutex"}


def test_ring_of_three_is_listed_in_wait_order():
    snap = snapshot(
        process(
            10,
            on_mutex(13, 0xA, owner=11),
            on_mutex(11, 0xB, owner=12),
            on_mutex(12, 0xC, owner=13),
        )
    )
    assert WaitForGraph(snap).cycles() == [(11, 12, 13)]


def test_chain_without_cycle_has_edges_but_no_cycle():
    snap = snapshot(
        process(10, on_mutex(11, 0xA, owner=12), on_mutex(12, 0xB, owner=13), running(13))
    )
    g = WaitForGraph(snap)
    assert len(g.edges) == 2
    assert g.cycles() == []


def test_relocking_a_held_default_mutex_is_a_cycle_of_one():
    snap = snapshot(process(10, on_mutex(11, 0xA, owner=11)))
    assert WaitForGraph(snap).cycles() == [(11,)]


def test_cycle_across_two_processes():
    snap = snapshot(
        process(10, on_mutex(10, 0xA, owner=20)), process(20, on_mutex(20, 0xB, owner=10))
    )
    g = WaitForGraph(snap)
    assert g.cycles() == [(10, 20)]
    assert {(e.waiter_pid, e.owner_pid) for e in g.edges.values()} == {(10, 20), (20, 10)}


def test_pi_word_names_its_owner():
    snap = snapshot(process(10, on_pi(11, 0xA, owner=12), on_pi(12, 0xB, owner=11)))
    assert WaitForGraph(snap).cycles() == [(11, 12)]


def test_edeadlk_refusal_is_an_edge_although_the_thread_waits_on_a_dummy_word():
    # glibc parks the refused thread on a private word holding 0: no owner in it.
    refused = Refusal(uaddr=0xB, ts_ns=1, lock=LockRead(11 | 0x80000000))
    snap = snapshot(process(10, on_pi(11, 0xA, owner=12), parked(12, 0x7FF0, refused=refused)))
    g = WaitForGraph(snap)
    assert g.edges[12].kind == "pi-refused"
    assert g.cycles() == [(11, 12)]


def test_join_waits_on_the_joined_threads_tid_word():
    joiner = parked(10, 0x7F00, op=FUTEX_WAIT_BITSET, val=11, lock=LockRead(11))
    joined = replace(parked(11, 0x1000), stack=(0x7000, 0x8000))
    g = WaitForGraph(snapshot(process(10, joiner, joined)))
    assert g.edges[10].kind == "join" and g.edges[10].owner == 11
    assert g.cycles() == []


def test_a_word_that_merely_equals_a_tid_is_not_a_join():
    waiter = parked(10, 0x7F00, val=11, lock=LockRead(11))
    elsewhere = replace(parked(11, 0x1000), stack=(0x9000, 0xA000))
    assert WaitForGraph(snapshot(process(10, waiter, elsewhere))).edges == {}
    assert WaitForGraph(snapshot(process(10, waiter, parked(11, 0x1000)))).edges == {}


def test_no_owner_shapes_never_become_edges():
    cases = [
        parked(11, 0xA, val=0, lock=LockRead(0, 12, 0)),  # condvar/semaphore word 0
        parked(11, 0xA, val=2, lock=LockRead(2, 12, 0x7FFF0000, 1)),  # __kind not a mutex kind
        parked(11, 0xA, val=2, lock=LockRead(2, 12, 0, 0)),  # no __nusers: not a locked mutex
        parked(11, 0xA, val=2, lock=LockRead(0, 12, 0)),  # word moved on: being woken
        parked(11, 0xA, val=2, lock=LockRead(2, 0, 0)),  # no owner recorded
        parked(11, 0xA, val=2, lock=None),  # memory unreadable
    ]
    for t in cases:
        g = WaitForGraph(snapshot(process(10, t, parked(12, 0x2000))))
        assert g.edges == {}, t


def test_futex_waitv_is_never_an_edge():
    t = ThreadSample(
        11, "w", "S", 0, wait=FutexWait(0xA, 0, 2, vector=True), lock=LockRead(2, 12, 0)
    )
    assert owner_candidate(t) is None


def test_owner_that_is_not_a_live_thread_gives_no_edge():
    snap = snapshot(process(10, on_mutex(11, 0xA, owner=999)))
    assert WaitForGraph(snap).edges == {}


def test_owner_in_an_unwatched_process_is_an_edge_but_not_a_cycle():
    snap = snapshot(process(10, on_mutex(11, 0xA, owner=77)), foreign={77: 70})
    g = WaitForGraph(snap)
    assert g.edges[11].owner_pid == 70
    assert g.cycles() == []


def test_groups_unify_a_shared_word_across_processes():
    key = ("shared", "00:05", 1234, 64)
    snap = snapshot(
        process(10, parked(11, 0x1000), parked(12, 0x1000), word_ids={0x1000: key}),
        process(20, parked(21, 0x7000), word_ids={0x7000: key}),
        process(30, parked(31, 0x1000)),  # same address, private: another word
    )
    groups = WaitForGraph(snap).groups()
    assert groups[0].tids == (11, 12, 21) and groups[0].pids == (10, 20)
    assert groups[0].owner is None
    assert [g.tids for g in groups[1:]] == [(31,)]


# --- properties -----------------------------------------------------------------------------


def _brute_cycles(succ: dict[int, int]) -> set[tuple[int, ...]]:
    """Nodes that get back to themselves by following their one out-edge."""
    out = set()
    for v in succ:
        path, x = [v], succ.get(v)
        while x is not None and x != v and len(path) <= len(succ):
            path.append(x)
            x = succ.get(x)
        if x == v:
            start = path.index(min(path))
            out.add(tuple(path[start:] + path[:start]))
    return out


@given(st.dictionaries(st.integers(2, 40), st.integers(2, 40), max_size=40))
def test_cycles_match_brute_force_on_any_functional_graph(succ):
    tids = set(succ) | set(succ.values())
    threads = [
        on_mutex(t, 0x1000 + t, owner=succ[t]) if t in succ else running(t) for t in sorted(tids)
    ]
    g = WaitForGraph(snapshot(process(1, *threads)))
    assert set(g.cycles()) == _brute_cycles(succ)


@given(st.dictionaries(st.integers(0, 25), st.integers(0, 25), max_size=25))
def test_owner_cycles_are_the_threads_that_reach_themselves(owner):
    """Against mutual reachability: a thread is in a cycle iff following owners from it
    comes back to it, and the cycles found are exactly the classes of such threads, each in
    wait order from its smallest TID."""
    nodes = sorted(set(owner) | set(owner.values()))

    def reach(v):  # the threads reached in one or more steps
        seen, tid = [], owner.get(v)
        while tid is not None and tid not in seen:
            seen.append(tid)
            tid = owner.get(tid)
        return set(seen)

    r = {v: reach(v) for v in nodes}
    cycles = owner_cycles(owner)
    on = [t for c in cycles for t in c]
    assert len(on) == len(set(on))  # disjoint
    assert set(on) == {v for v in nodes if v in r[v]}
    for c in cycles:
        assert c[0] == min(c) and all(owner[a] == b for a, b in zip(c, c[1:] + c[:1]))
        for a in c:
            assert {b for b in nodes if b in r[a] and a in r[b]} == set(c)
    assert cycles == sorted(cycles)


@given(st.lists(st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 2**31 - 1)), max_size=30))
def test_ownerless_words_never_make_a_cycle(words):
    # Any word and __kind, but no owner recorded at +8 (condvars, barriers, semaphores):
    # whatever the word holds, no edge may close a cycle among the waiters.
    threads = [
        parked(100 + i, 0x1000 + 64 * i, val=w, lock=LockRead(w, 0, k))
        for i, (w, k) in enumerate(words)
    ]
    g = WaitForGraph(snapshot(process(1, *threads)))
    assert g.cycles() == []


def test_both_pi_lockers_refused_is_still_a_cycle():
    # When the two LOCK_PI calls race, the kernel can refuse both: each thread then sits
    # on its own dummy word, and only the refusals say what each waits for.
    a_refused = Refusal(uaddr=0xB, ts_ns=1, lock=LockRead(12 | 0x80000000))  # B held by 12
    b_refused = Refusal(uaddr=0xA, ts_ns=1, lock=LockRead(11 | 0x80000000))  # A held by 11
    snap = snapshot(
        process(10, parked(11, 0x7FF0, refused=a_refused), parked(12, 0x7EF0, refused=b_refused))
    )
    g = WaitForGraph(snap)
    assert {e.kind for e in g.edges.values()} == {"pi-refused"}
    assert g.cycles() == [(11, 12)]
