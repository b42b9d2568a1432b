"""The status socket's protocol: one JSON line asked, one JSON line answered, then the
connection closes (docs/deploy.md, "The status socket").

Request: ``{"version": 1, "pid": PID}`` (``pid`` optional: the service holding it; absent
or null: every service). Answer: ``{"version": 1, "ok": true, ...}`` or ``{"version": 1,
"ok": false, "error": CODE, "message": TEXT}``. Either side ignores keys it does not know,
so a later version adds keys without breaking an older peer; ``version`` says which one
wrote it. Every size is bounded: a peer is untrusted on both ends.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..analysis import evidence as ev
from ..analysis.daemonview import DaemonSight
from ..model import PID_MAX_LIMIT

VERSION = 1
MAX_REQUEST_BYTES = 4096  # one short line: a pid and a version
MAX_ANSWER_BYTES = 4 << 20  # 128 services with their changes fit in well under this

# Error codes of an answer with "ok": false.
BAD_REQUEST = "bad_request"
REFUSED = "refused"
BUSY = "busy"
TOO_LARGE = "too_large"
INTERNAL = "internal"
STARTING = "starting"


class ProtocolError(ValueError):
    """A line that is not what the protocol says; its message says what is wrong."""


@dataclass(frozen=True)
class Request:
    version: int = VERSION
    pid: int | None = None


def encode_request(req: Request) -> bytes:
    return (json.dumps({"version": req.version, "pid": req.pid}) + "\n").encode()


def decode_request(line: bytes) -> Request:
    """A request line (without or with its newline). ProtocolError when it is too long, not
    UTF-8 JSON, not an object, or its pid or version is not a number in range."""
    if len(line) > MAX_REQUEST_BYTES:
        raise ProtocolError(f"request longer than {MAX_REQUEST_BYTES} bytes")
    try:
        doc = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise ProtocolError("request is not a JSON line") from None
    if not isinstance(doc, dict):
        raise ProtocolError("request is not a JSON object")
    version = doc.get("version", VERSION)
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ProtocolError("version: want a whole number from 1")
    pid = doc.get("pid")
    if pid is not None and (
        isinstance(pid, bool) or not isinstance(pid, int) or not 0 < pid <= PID_MAX_LIMIT
    ):
        raise ProtocolError(f"pid: want a PID (1-{PID_MAX_LIMIT}) or null")
    return Request(version, pid)


def error(code: str, message: str) -> dict[str, Any]:
    return {"version": VERSION, "ok": False, "error": code, "message": message}


def encode_answer(doc: Mapping[str, Any]) -> bytes:
    """One line; an answer over MAX_ANSWER_BYTES becomes an error that says to ask for less."""
    data = (json.dumps(doc, separators=(",", ":")) + "\n").encode()
    if len(data) > MAX_ANSWER_BYTES:
        return encode_answer(
            error(TOO_LARGE, f"the answer exceeds {MAX_ANSWER_BYTES} bytes: ask for one --pid")
        )
    return data


def decode_answer(data: bytes) -> dict[str, Any]:
    """An answer line. ProtocolError when it is too long, cut short, or not a JSON object
    with a version and ok."""
    if len(data) > MAX_ANSWER_BYTES:
        raise ProtocolError(f"answer longer than {MAX_ANSWER_BYTES} bytes")
    if not data.endswith(b"\n"):
        raise ProtocolError("answer cut short (no end of line)")
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise ProtocolError("answer is not a JSON line") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("ok"), bool):
        raise ProtocolError("answer is not a status object")
    if not isinstance(doc.get("version"), int):
        raise ProtocolError("answer has no version")
    return doc


def _number(doc: Mapping[str, Any], key: str) -> float:
    v = doc.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ProtocolError(f"{key}: not a number")
    return float(v)


def sight_of(service: Mapping[str, Any], daemon_pid: int) -> DaemonSight:
    """The service of an answer as `diagnose` judges with it. ProtocolError on a missing or
    mistyped key (an answer of a later version keeps these keys: they are added to, never
    renamed)."""
    c = service.get("carried")
    if not isinstance(c, dict):
        raise ProtocolError("carried: not an object")
    streams = c.get("streams")
    if not isinstance(streams, list):
        raise ProtocolError("carried.streams: not a list")
    state, name, root = service.get("state"), service.get("service"), service.get("pid")
    if not isinstance(state, str) or not isinstance(name, str) or not isinstance(root, int):
        raise ProtocolError("service: state, service or pid missing")
    unanswered = c.get("unanswered_requests")
    if isinstance(unanswered, bool) or not isinstance(unanswered, int):
        raise ProtocolError("carried.unanswered_requests: not a whole number")
    return DaemonSight(
        daemon_pid=daemon_pid,
        service=name,
        root=root,
        state=state,
        in_state_s=_number(service, "seconds_in_state"),
        stream_ages_s=tuple(
            _number(s, "last_sent_seconds") for s in streams if isinstance(s, dict)
        ),
        unanswered=unanswered,
        oldest_unanswered_s=_number(c, "oldest_unanswered_seconds"),
        last_progress_s=_number(c, "seconds_since_progress"),
        culprit=_culprit(service.get("culprit"), daemon_pid),
    )


def _culprit(doc: Any, daemon_pid: int) -> ev.Culprit | None:
    """The service's culprit as the daemon named it (null: none), marked as the daemon's."""
    if doc is None:
        return None
    if not isinstance(doc, dict):
        raise ProtocolError("culprit: not an object or null")
    pid, comm, why, threads = (doc.get(k) for k in ("pid", "comm", "why", "threads"))
    if isinstance(pid, bool) or not isinstance(pid, int) or not 0 < pid <= PID_MAX_LIMIT:
        raise ProtocolError("culprit.pid: not a PID")
    if not isinstance(comm, str) or not isinstance(why, str):
        raise ProtocolError("culprit: comm or why not a string")
    if isinstance(threads, bool) or not isinstance(threads, int):
        raise ProtocolError("culprit.threads: not a whole number")
    age = None if doc.get("age_s") is None else _number(doc, "age_s")
    return ev.Culprit(pid, comm[:64], why, threads=threads, age_s=age, daemon_pid=daemon_pid)
