"""The daemon's flight record, written beside the loop: the log line of each state change of
a service, with its lock words named from memory, and at a change to stalled or deadlocked
the Python stacks of its processes.

Reading the stacks of a 2,000-thread server takes up to the stacks budget (seconds), and
naming words reads symbol tables: a tick that waited for them would give every verdict late.
So the loop hands each change to one thread of its own, in order, and goes on; the snapshot
a change was seen in is immutable, so the thread reads it as it was. At most MAX_PENDING
changes wait: beyond that (a host whose services all turned at once, a reader that hangs to
its budget each time) a change is logged at once with what the verdict alone says, and
counted, so the work in the background stays bounded and no change goes unlogged.
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


class FlightRecorder(Generic[C]):
    """Runs ``record(change)`` for each change submitted, one at a time, in a thread of its
    own (``start()``, before the first submit); ``at_once(change)`` instead when MAX_PENDING
    are already waiting."""

    def __init__(
        self,
        record: Callable[[C], None],
        at_once: Callable[[C], None],
        max_pending: int = MAX_PENDING,
        name: str = "hangwatch-flight",
    ) -> None:
        self._name = name
        self._record = record
        self._at_once = at_once
        self._queue: queue.Queue[C | None] = queue.Queue(max_pending)
        self._thread: threading.Thread | None = None
        self.dropped = 0  # changes logged without their flight record: the queue was full

    def start(self) -> None:
        """Start the recording thread. At start-up: a thread started at a change instead
        could fail then (a host out of tasks), in the middle of the loop's tick. RuntimeError
        when it cannot start; then nothing is started, and close() has nothing to end."""
        if self._thread is not None:
            return
        thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        thread.start()
        self._thread = thread  # only once started: close() joins no thread that never ran

    def submit(self, change: C) -> None:
        if self._thread is None:
            raise RuntimeError(f"{self._name}: submit() before start()")
        try:
            self._queue.put_nowait(change)
        except queue.Full:
            self.dropped += 1
            self._at_once(change)

    def flush(self, timeout: float) -> bool:
        """Wait until every change submitted is recorded; False if ``timeout`` came first."""
        deadline = time.monotonic() + timeout
        with self._queue.all_tasks_done:
            while self._queue.unfinished_tasks:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._queue.all_tasks_done.wait(left)
        return True

    def close(self, timeout: float) -> None:
        """Record what is pending (for up to ``timeout``), then end the thread."""
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
            change = self._queue.get()
            try:
                if change is None:
                    return
                self._record(change)
            except Exception:
                log.exception("flight record failed")
            finally:
                self._queue.task_done()
