"""The bounded worker (agent.worker): the loop hands jobs over and goes on; the worker keeps
their order, bounds what waits, and hands what does not fit back at once."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from agent.worker import MAX_PENDING, BoundedWorker


def worker(
    record: Callable[[int], None],
    at_once: Callable[[int], None],
    max_pending: int = MAX_PENDING,
) -> BoundedWorker[int]:
    return BoundedWorker(record, at_once, max_pending, name="test-worker", what="test job")


def test_jobs_are_done_in_order_beside_the_caller():
    release = threading.Event()
    started = threading.Event()
    done: list[int] = []

    def record(n: int) -> None:
        started.set()
        assert release.wait(10)
        done.append(n)

    rec = worker(record, lambda n: done.append(-n))

    rec.start()
    for n in (1, 2, 3):
        rec.submit(n)  # returns while the first is still being done
    assert started.wait(10) and done == []
    release.set()
    assert rec.flush(10) and done == [1, 2, 3] and rec.dropped == 0
    rec.close(10)


def test_beyond_the_bound_a_job_is_handed_back_at_once():
    release = threading.Event()
    first = threading.Event()
    done: list[int] = []

    def record(n: int) -> None:
        first.set()
        assert release.wait(10)
        done.append(n)

    rec = worker(record, lambda n: done.append(-n), max_pending=2)

    rec.start()
    rec.submit(1)
    assert first.wait(10)  # 1 is being done: 2 and 3 wait, 4 and 5 do not fit
    for n in (2, 3, 4, 5):
        rec.submit(n)
    assert done == [-4, -5] and rec.dropped == 2
    release.set()
    assert rec.flush(10) and done == [-4, -5, 1, 2, 3]
    rec.close(10)


def test_a_job_that_fails_is_logged_and_the_next_goes_on(caplog):
    done: list[int] = []

    def record(n: int) -> None:
        if n == 1:
            raise RuntimeError("boom")
        done.append(n)

    rec = worker(record, lambda n: None)

    rec.start()
    rec.submit(1)
    rec.submit(2)
    assert rec.flush(10) and done == [2]
    assert "test job failed" in caplog.text
    rec.close(10)


def test_close_does_what_is_pending_first():
    done: list[int] = []
    rec = worker(done.append, lambda n: None)
    rec.start()
    for n in range(5):
        rec.submit(n)
    rec.close(10)
    assert done == [0, 1, 2, 3, 4]


def test_the_thread_starts_at_start_not_at_the_first_job(monkeypatch):
    """A job is never the moment a thread is started (a host out of tasks would fail the
    tick then); a start that fails leaves nothing for close() to join."""
    rec = worker(lambda n: None, lambda n: None)
    with pytest.raises(RuntimeError, match="before start"):
        rec.submit(1)

    def cannot_start(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", cannot_start)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        rec.start()
    rec.close(1)  # nothing started, nothing to join: no error
