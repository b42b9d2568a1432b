"""Where a parked process waits, as one short label value: the ``site`` of
``hangwatch_process_waiting_at``, which lets Prometheus compare the ranks of a job across hosts.

Pure, from a stack read of the process or its main thread's first native caller. The value
names code, never an address, a TID or a time, so that it stays comparable between ranks and
low in cardinality: the innermost frame of the program's own code (every rank waits inside
its libraries alike) and the call it made there (docs/how-it-works.md, "Where a parked process
waits, for Prometheus").
"""

from __future__ import annotations

from collections.abc import Mapping

from ..model import PyFrame, PyThread, StackRead, printable

MAX_SITE = 100

# Functions that only pass a call on: a site naming them would say "wrapper" for every
# decorated collective (torch's c10d_logger, functools.wraps-style decorators).
_PASS_THROUGH = frozenset(
    {
        "wrapper",
        "_wrapper",
        "wrapped",
        "inner",
        "_inner",
        "decorated",
        "decorator",
        "decorate_context",
        "_fn",
        "fn",
        "func",
        "new_func",
    }
)


def installed(f: PyFrame) -> bool:
    """A frame of an installed package (site-packages, dist-packages): a library's, not the
    program's own, though not the standard library either."""
    return "-packages/" in f.file


def python_site(thread: PyThread) -> str | None:
    """``call (file:line)`` for a thread with Python frames, else None."""
    frames = thread.frames  # innermost first
    if not frames:
        return None
    own = next((i for i, f in enumerate(frames) if not f.stdlib and not installed(f)), None)
    if own is None:  # all library code (a server run from site-packages): its innermost
        own = next((i for i, f in enumerate(frames) if not f.stdlib), 0)
    frame = frames[own]
    call = frame.function
    for inner in reversed(frames[:own]):  # from the callee inwards, past pass-throughs
        call = inner.function
        # py-spy names functions by qualified name: "_exception_logger.<locals>.wrapper"
        if call.rpartition(".")[2] not in _PASS_THROUGH:
            break
    return clean(f"{call} ({_short(frame)}:{frame.line})")


def _short(frame: PyFrame) -> str:
    """py-spy's short file name, with its package where it is a bare ``__init__.py``."""
    short = frame.short
    if "/" not in short and short.startswith("__init__."):
        parts = frame.file.rsplit("/", 2)
        if len(parts) == 3:
            return f"{parts[1]}/{short}"
    return short


def native_site(symbol: str | None, obj: str) -> str:
    """``symbol (object)`` for a native caller, or the object alone without a symbol."""
    return clean(f"{symbol} ({obj})" if symbol else obj)


def process_site(read: StackRead | None, pid: int, native: str | None = None) -> str | None:
    """The site of a process: its main thread's, else that of the most threads sharing one
    (a main thread that runs no Python: an embedded interpreter); ``native`` (a
    ``native_site``) when no thread shows Python frames. None when nothing says."""
    if read is not None and read.error is None:
        main = read.threads.get(pid)
        site = python_site(main) if main is not None else None
        if site is None:
            site = _commonest(read.threads)
        if site is not None:
            return site
    return native


def _commonest(threads: Mapping[int, PyThread]) -> str | None:
    counts: dict[str, int] = {}
    for tid in sorted(threads):
        site = python_site(threads[tid])
        if site is not None:
            counts[site] = counts.get(site, 0) + 1
    return max(counts, key=lambda s: counts[s]) if counts else None  # first of a tie: lowest TID


def clean(text: str) -> str:
    """A label value from text the target controls (file and function names): printable,
    one line, at most MAX_SITE characters."""
    return printable(text, MAX_SITE)


def leads_rank(labels: Mapping[str, str], parent_labels: Mapping[str, str] | None) -> bool:
    """Whether a process speaks for its rank: it has no rank, or its parent is not of the
    same rank. A rank's DataLoader workers inherit RANK, and where they wait (an index queue,
    a dataset read) is not where the rank waits."""
    rank = labels.get("rank")  # discovery's labels: allow-listed names, in lower case
    if rank is None or parent_labels is None:
        return True
    return parent_labels.get("rank") != rank
