"""Where a parked process waits, as the ``site`` label (agent.analysis.sites), and the book the
daemon keeps of them, one read per park (agent.observe.sitebook)."""

from __future__ import annotations

import threading

from hypothesis import given
from hypothesis import strategies as st

from agent.analysis.sites import MAX_SITE, clean, leads_rank, native_site, process_site, python_site
from agent.model import PyFrame, PyThread, StackRead
from agent.observe.sitebook import SAME_PARK_NS, Park, SiteBook

SP = "/opt/venv/lib/python3.11/site-packages/"
STD = "/usr/lib/python3.11/"


def frame(function: str, file: str, line: int) -> PyFrame:
    short = (
        file.removeprefix(SP).removeprefix(STD).rsplit("/", 1)[-1]
        if file.startswith(STD)
        else file.removeprefix(SP)
    )
    return PyFrame(function, file, short, line)


def thread(tid: int, *frames: PyFrame) -> PyThread:
    return PyThread(tid, None, False, tuple(frames))


# A torch rank in all_reduce, as py-spy shows it: torch's decorator between the script and it.
ALL_REDUCE = thread(
    10,
    frame("all_reduce", SP + "torch/distributed/distributed_c10d.py", 2501),
    frame("_exception_logger.<locals>.wrapper", SP + "torch/distributed/c10d_logger.py", 81),
    frame("train_step", "/job/train.py", 57),
    frame("main", "/job/train.py", 90),
)
# A rank waiting for its DataLoader: the queue's condition wait in the standard library.
DATALOADER = thread(
    20,
    frame("wait", STD + "threading.py", 331),
    frame("get", STD + "queue.py", 180),
    frame("_try_get_data", SP + "torch/utils/data/dataloader.py", 1133),
    frame("_get_data", SP + "torch/utils/data/dataloader.py", 1294),
    frame("_next_data", SP + "torch/utils/data/dataloader.py", 1332),
    frame("__next__", SP + "torch/utils/data/dataloader.py", 631),
    frame("train_step", "/job/train.py", 60),
)


def test_the_site_is_the_call_through_decorators_and_the_line_of_the_program_that_made_it():
    assert python_site(ALL_REDUCE) == "all_reduce (/job/train.py:57)"
    assert python_site(DATALOADER) == "__next__ (/job/train.py:60)"


def test_a_line_that_waits_in_native_code_names_its_own_function():
    t = thread(1, frame("wait_for_peer", "/job/train.py", 12), frame("main", "/job/train.py", 3))
    assert python_site(t) == "wait_for_peer (/job/train.py:12)"


def test_a_server_that_runs_from_site_packages_is_told_by_its_innermost_library_frame():
    t = thread(
        1,
        frame("select", STD + "selectors.py", 468),
        frame("_run_once", STD + "asyncio/base_events.py", 1898),
        frame("serve", SP + "vllm/entrypoints/api_server.py", 120),
        frame("main", SP + "vllm/entrypoints/cli/main.py", 50),
    )
    assert python_site(t) == "_run_once (vllm/entrypoints/api_server.py:120)"


def test_the_main_thread_speaks_for_the_process_else_the_most_threads_at_one_site():
    helper = thread(11, frame("loop", "/job/helper.py", 5))
    read = StackRead(10, {10: ALL_REDUCE, 11: helper})
    assert process_site(read, 10) == "all_reduce (/job/train.py:57)"
    pool = {t: thread(t, frame("work", "/job/pool.py", 9)) for t in (21, 22)}
    read = StackRead(10, {10: PyThread(10, None, False, ()), 11: helper, **pool})
    assert process_site(read, 10) == "work (/job/pool.py:9)"


def test_a_process_without_python_frames_falls_back_to_its_native_caller():
    assert process_site(None, 10, native=native_site("rank_loop", "barrier_ranks")) == (
        "rank_loop (barrier_ranks)"
    )
    failed = StackRead(10, error="py-spy timed out")
    assert process_site(failed, 10, "libfoo.so") == "libfoo.so"
    assert process_site(failed, 10) is None


@given(st.text(max_size=400))
def test_a_site_from_any_text_is_one_printable_bounded_line(text):
    out = clean(text)
    assert len(out) <= MAX_SITE
    assert out.isprintable()
    if len(text) <= MAX_SITE and text.isprintable():
        assert out == text


def test_a_rank_is_told_by_its_own_process_not_the_workers_that_inherit_its_rank():
    assert leads_rank({"rank": "2"}, {})  # torchrun's agent has no RANK
    assert leads_rank({"rank": "2"}, None)  # its parent is not watched
    assert not leads_rank({"rank": "2"}, {"rank": "2"})  # a DataLoader worker
    assert leads_rank({"rank": "2"}, {"rank": "0"})
    assert leads_rank({}, {"rank": "2"})  # no rank: every process speaks for itself


# --- the book: one read per park ---------------------------------------------------------


def book_reading(sites: dict[int, str | None]) -> tuple[SiteBook, list[int]]:
    asked: list[int] = []

    def read(park: Park) -> str | None:
        asked.append(park.pid)
        return sites.get(park.pid)

    book = SiteBook(read)
    book.start()
    return book, asked


def test_a_park_is_read_once_when_due_and_its_site_holds_until_it_ends():
    book, asked = book_reading({7: "all_reduce (train.py:57)"})
    park = Park(7, 100, 5_000_000_000)
    book.update([park], lambda p: False)  # not yet due
    assert book.flush(5) and asked == []
    for _ in range(3):
        book.update([park], lambda p: True)
        assert book.flush(5)
    assert asked == [7]
    same = Park(7, 100, park.since_ns + SAME_PARK_NS // 2)  # parked_seconds' rounding
    assert book.site(same) == "all_reduce (train.py:57)"
    later = Park(7, 100, park.since_ns + 10**9)  # a thread worked: a new park
    assert book.site(later) is None
    book.update([later], lambda p: True)
    assert book.flush(5) and asked == [7, 7]
    assert book.site(later) == "all_reduce (train.py:57)"
    book.update([], lambda p: True)  # it works now: nothing kept
    assert book.site(later) is None


def test_a_reused_pid_is_a_new_process():
    book, _ = book_reading({7: "a (x.py:1)"})
    book.update([Park(7, 100, 0)], lambda p: True)
    assert book.flush(5)
    assert book.site(Park(7, 101, 0)) is None


def test_a_read_that_ends_after_its_park_does_not_name_the_next_one():
    gate = threading.Event()

    def read(park: Park) -> str:
        gate.wait(5)
        return "old (x.py:1)"

    book = SiteBook(read)
    book.start()
    first, second = Park(7, 100, 0), Park(7, 100, 3 * 10**9)
    book.update([first], lambda p: True)
    book.update([second], lambda p: False)  # the first park ended while it was read
    gate.set()
    assert book.flush(5)
    assert book.site(first) is None and book.site(second) is None


def test_reads_past_the_queue_are_asked_again_on_the_next_tick():
    gate = threading.Event()
    asked: list[int] = []

    def read(park: Park) -> str:
        gate.wait(5)
        asked.append(park.pid)
        return f"at ({park.pid}.py:1)"

    book = SiteBook(read, max_pending=1)
    book.start()
    parks = [Park(pid, 1, 0) for pid in (1, 2, 3, 4)]
    book.update(parks, lambda p: True)  # one read runs, one waits, two find the queue full
    assert book.reads == 0
    gate.set()
    assert book.flush(5)
    assert 1 <= len(asked) <= 2  # one read running, at most one waiting: the rest refused
    for _ in range(10):  # ticks: each asks again what found the queue full
        book.update(parks, lambda p: True)
        assert book.flush(5)
    assert sorted(asked) == [1, 2, 3, 4]
    assert all(book.site(p) == f"at ({p.pid}.py:1)" for p in parks)
    book.close(1)


def test_a_bare_init_file_is_named_with_its_package():
    t = thread(
        1,
        PyFrame("Runner.run", STD + "asyncio/runners.py", "runners.py", 118),
        PyFrame("run", SP + "uvloop/__init__.py", "__init__.py", 92),
    )
    assert python_site(t) == "Runner.run (uvloop/__init__.py:92)"
