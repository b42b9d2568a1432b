"""A bounded worker: one thread beside a loop that does, in order, the jobs the loop hands it,
so that a slow job (a read that may take seconds) never delays the loop. The loop goes on
meanwhile, so what a job reads must not change under it (a tick's snapshot, a park). At most
``max_pending`` jobs wait: beyond that a job is handed to ``at_once`` in the caller's thread
instead, and counted, so the work in the background stays bounded and no job goes unseen.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

MAX_PENDING = 16

C = TypeVar("C")


class BoundedWorker(Generic[C]):
    """Runs ``record(job)`` for each job submitted, one at a time, in a thread of its own
    (``start()``, before the first submit); ``at_once(job)`` instead when ``max_pending`` are
    already waiting. ``name`` names the thread, ``what`` a job in the log when one raises."""

    def __init__(
        self,
        record: Callable[[C], None],
        at_once: Callable[[C], None],
        max_pending: int = MAX_PENDING,
        *,
        name: str,
        what: str,
    ) -> None:
        self._name = name
        self._what = what
        self._record = record
        self._at_once = at_once
        self._queue: queue.Queue[C | None] = queue.Queue(max_pending)
        self._thread: threading.Thread | None = None
        self.dropped = 0  # jobs handed to at_once: the queue was full

    def start(self) -> None:
        """Start the worker's thread. At start-up: a thread started at the first job instead
        could fail then (a host out of tasks), in the middle of the loop's tick. RuntimeError
        when it cannot start; then nothing is started, and close() has nothing to end."""
        if self._thread is not None:
            return
        thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        thread.start()
        self._thread = thread  # only once started: close() joins no thread that never ran

    def submit(self, job: C) -> None:
        if self._thread is None:
            raise RuntimeError(f"{self._name}: submit() before start()")
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            self.dropped += 1
            self._at_once(job)

    def flush(self, timeout: float) -> bool:
        """Wait until every job submitted is done; False if ``timeout`` came first."""
        deadline = time.monotonic() + timeout
        with self._queue.all_tasks_done:
            while self._queue.unfinished_tasks:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._queue.all_tasks_done.wait(left)
        return True

    def close(self, timeout: float) -> None:
        """Do what is pending (for up to ``timeout``), then end the thread."""
        if self._thread is None:
            return
        self.flush(timeout)
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            return  # still busy past the timeout: a daemon thread, it ends with the process
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                self._record(job)
            except Exception:
                log.exception("%s failed", self._what)
            finally:
                self._queue.task_done()
