"""`hangwatch status` without root or BPF: the history ring, the protocol (bounded, fuzzed),
the rule by which `diagnose` judges with the daemon's history, and the status server on a
socket in a temp directory (slow, silent, greedy and surplus clients)."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.analysis import evidence as ev
from agent.analysis.daemonview import DaemonSight, merge
from agent.analysis.history import MAX_CHANGES, Carried, OpenStream, StateHistory
from agent.analysis.verdict import (
    DEADLOCKED,
    IDLE,
    PROGRESSING,
    STALLED,
    ProcessVerdict,
    ServiceVerdict,
)
from agent.errors import UnavailableError, UsageError
from agent.export import statusproto as proto
from agent.export.status import MAX_CONNECTIONS, Peer, StatusServer
from agent.report import as_json
from agent.report import status as status_report
from agent.report.sentences import evidence_json, render
from agent.status import StatusOptions, ask, run, sighting


def verdict(state: str, pid: int = 100, reasons: list[ev.Fact] | None = None) -> ServiceVerdict:
    proc = ProcessVerdict(pid, "server", 4, 4, 30.0, state, [])
    return ServiceVerdict(pid, state, reasons or [], [], [proc])


# --- the history ring ---------------------------------------------------------------------------


def test_history_keeps_since_while_the_state_holds_and_counts_changes() -> None:
    h = StateHistory()
    key = ("svc", 100)
    h.update([(key, verdict(PROGRESSING))], wall=1000.0)
    h.update([(key, verdict(PROGRESSING))], wall=1001.0)
    h.update([(key, verdict(STALLED))], wall=1002.0)
    h.update([(key, verdict(STALLED))], wall=1003.0)
    s = h.view()[key]
    assert (s.state, s.since_wall) == (STALLED, 1002.0)
    assert [(c.old, c.new, c.wall) for c in s.changes] == [
        (None, PROGRESSING, 1000.0),
        (PROGRESSING, STALLED, 1002.0),
    ]


def test_history_is_bounded_and_forgets_services_gone() -> None:
    h = StateHistory()
    key = ("svc", 100)
    for i in range(3 * MAX_CHANGES):
        h.update([(key, verdict(STALLED if i % 2 else IDLE))], wall=float(i))
    s = h.view()[key]
    assert len(s.changes) == MAX_CHANGES
    assert s.changes[-1].wall == 3 * MAX_CHANGES - 1
    h.update([], wall=999.0)
    assert h.view() == {}


def test_a_view_does_not_change_when_the_history_does() -> None:
    h = StateHistory()
    h.update([(("a", 1), verdict(IDLE, 1))], wall=1.0)
    view = h.view()
    h.update([(("a", 1), verdict(STALLED, 1))], wall=2.0)
    assert view[("a", 1)].state == IDLE


# --- the protocol -----------------------------------------------------------------------------


def test_a_request_round_trips() -> None:
    for req in (proto.Request(), proto.Request(pid=4242)):
        line = proto.encode_request(req)
        assert line.endswith(b"\n") and len(line) < proto.MAX_REQUEST_BYTES
        assert proto.decode_request(line) == req


@pytest.mark.parametrize(
    ("line", "says"),
    [
        (b"", "not a JSON line"),
        (b"\xff\xfe", "not a JSON line"),
        (b"[1]", "not a JSON object"),
        (b'{"pid": "1"}', "pid"),
        (b'{"pid": true}', "pid"),
        (b'{"pid": -4}', "pid"),
        (b'{"pid": 99999999}', "pid"),
        (b'{"version": 0}', "version"),
        (b'{"pid": 1, "x": "' + b"a" * 5000 + b'"}', "longer than 4096"),
        (b"[" * 3000, "not a JSON"),
    ],
)
def test_a_bad_request_says_what_is_wrong(line: bytes, says: str) -> None:
    with pytest.raises(proto.ProtocolError, match=says):
        proto.decode_request(line)


def test_a_later_version_and_unknown_keys_are_answered() -> None:
    assert proto.decode_request(b'{"version": 7, "pid": 3, "since": "x"}') == proto.Request(7, 3)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.binary(max_size=6000) | st.text(max_size=200).map(str.encode))
def test_any_request_bytes_decode_or_raise_protocol_error(data: bytes) -> None:
    try:
        req = proto.decode_request(data)
    except proto.ProtocolError:
        return
    assert req.pid is None or req.pid > 0


JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["version", "pid", "x"]), JSONISH))
def test_any_request_object_decodes_or_raises_protocol_error(doc: dict[str, Any]) -> None:
    with contextlib.suppress(proto.ProtocolError):
        proto.decode_request(json.dumps(doc).encode())


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=3000))
def test_any_answer_bytes_decode_or_raise_protocol_error(data: bytes) -> None:
    try:
        doc = proto.decode_answer(data)
    except proto.ProtocolError:
        return
    assert isinstance(doc["ok"], bool)


def test_an_answer_too_large_becomes_an_error_that_says_to_ask_for_less() -> None:
    data = proto.encode_answer({"version": 1, "ok": True, "x": "a" * proto.MAX_ANSWER_BYTES})
    doc = proto.decode_answer(data)
    assert (doc["ok"], doc["error"]) == (False, proto.TOO_LARGE) and "--pid" in doc["message"]


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["state", "service", "pid", "carried", "x"]), JSONISH))
def test_a_malformed_service_raises_protocol_error(doc: dict[str, Any]) -> None:
    with contextlib.suppress(proto.ProtocolError):
        proto.sight_of(doc, 1)


# --- the merge rule -------------------------------------------------------------------------------


def sight(state: str, streams: tuple[float, ...] = (), unanswered: int = 0, age: float = 0.0):
    return DaemonSight(
        daemon_pid=7,
        service="svc",
        root=100,
        state=state,
        in_state_s=40.0,
        stream_ages_s=streams,
        unanswered=unanswered,
        oldest_unanswered_s=age,
        last_progress_s=40.0,
    )


# (window's state, daemon's state, its unfinished streams' ages, unanswered, their age) ->
# the final state and whether the daemon judged it. The window is 3 s.
MERGE_TABLE = [
    # An idle window against the daemon's stall on work the window could not see: stalled.
    (IDLE, STALLED, (40.0,), 0, 0.0, STALLED, True),
    (IDLE, STALLED, (), 2, 40.0, STALLED, True),
    (IDLE, DEADLOCKED, (), 1, 40.0, DEADLOCKED, True),
    # A stream that sent within the window: the window saw that work; no unseen evidence.
    (IDLE, STALLED, (1.0,), 0, 0.0, IDLE, False),
    # Requests younger than the window: the window could see them.
    (IDLE, STALLED, (), 1, 2.0, IDLE, False),
    # The daemon's stall without evidence of waiting work (no front door, say): the window's.
    (IDLE, STALLED, (), 0, 0.0, IDLE, False),
    # A window that saw work, or a hang of its own, speaks for the present.
    (PROGRESSING, STALLED, (40.0,), 1, 40.0, PROGRESSING, False),
    (STALLED, IDLE, (), 0, 0.0, STALLED, False),
    (DEADLOCKED, STALLED, (40.0,), 0, 0.0, DEADLOCKED, False),
    # Agreeing, or the daemon idle too.
    (IDLE, IDLE, (), 0, 0.0, IDLE, False),
    (IDLE, PROGRESSING, (40.0,), 0, 0.0, IDLE, False),
]


@pytest.mark.parametrize(
    ("window", "daemon", "streams", "unanswered", "age", "final", "judged"), MERGE_TABLE
)
def test_the_merge_rule(
    window: str,
    daemon: str,
    streams: tuple[float, ...],
    unanswered: int,
    age: float,
    final: str,
    judged: bool,
) -> None:
    v = merge(verdict(window), sight(daemon, streams, unanswered, age), observed_s=3.0)
    assert v.state == final
    saw = [f for f in v.reasons if isinstance(f, ev.DaemonSaw)]
    assert len(saw) == 1 and saw[0].judged is judged and saw[0].daemon_pid == 7
    if judged:  # the reason that decided it comes first, and names its source
        assert v.reasons[0] is saw[0]
        assert render(saw[0]).startswith("the daemon (pid 7) saw ")
        assert all(p.state == final for p in v.processes)


def test_no_daemon_leaves_the_verdict_as_the_window_gave_it() -> None:
    v = verdict(IDLE)
    assert merge(v, None, 3.0) is v


def test_a_verdict_taken_from_the_daemon_takes_its_culprit_while_it_is_the_services() -> None:
    """The daemon's stall, taken, brings the process it found holding the service up, marked
    as the daemon's; a PID no longer among the service's processes is not named; a window's
    own verdict keeps its own culprit (none here)."""
    held = ev.Culprit(100, "worker", "own waits", threads=1, age_s=38.0, daemon_pid=7)
    taken = merge(verdict(IDLE), replace(sight(STALLED, (40.0,)), culprit=held), observed_s=3.0)
    assert taken.culprit == held and taken.reasons[1] == held
    assert render(held).startswith("held up by process 100 (worker), as the daemon (pid 7) named")
    assert [as_json.source_of(f) for f in taken.reasons[:2]] == ["daemon", "daemon"]
    gone = replace(held, pid=999)
    moved = merge(verdict(IDLE), replace(sight(STALLED, (40.0,)), culprit=gone), observed_s=3.0)
    assert moved.state == STALLED and moved.culprit is None
    assert not any(isinstance(f, ev.Culprit) for f in moved.reasons)
    kept = merge(verdict(PROGRESSING), replace(sight(STALLED, (40.0,)), culprit=held), 3.0)
    assert kept.culprit is None


def test_the_daemons_culprit_decodes_from_its_answer_or_is_refused() -> None:
    svc = {
        "service": "svc",
        "pid": 100,
        "state": STALLED,
        "seconds_in_state": 20.0,
        "carried": {
            "streams": [],
            "unanswered_requests": 1,
            "oldest_unanswered_seconds": 30.0,
            "seconds_since_progress": 30.0,
        },
        "culprit": evidence_json(ev.Culprit(101, "worker", "own waits", threads=2, age_s=29.5)),
    }
    got = proto.sight_of(svc, 7).culprit
    assert got == ev.Culprit(101, "worker", "own waits", threads=2, age_s=29.5, daemon_pid=7)
    assert proto.sight_of({**svc, "culprit": None}, 7).culprit is None
    for bad in ({"pid": "101"}, [101], {**svc["culprit"], "pid": 0}, {**svc["culprit"], "why": 3}):
        with pytest.raises(proto.ProtocolError, match="culprit"):
            proto.sight_of({**svc, "culprit": bad}, 7)


def test_the_daemons_words() -> None:
    v = merge(verdict(IDLE), sight(STALLED, (95.0,)), observed_s=3.0)
    assert render(v.reasons[0]) == (
        "the daemon (pid 7) saw 1 streamed answer begun before diagnose attached and not "
        "finished, the last data sent 95 s ago: has called it stalled for 40 s, its last "
        "progress 40 s ago"
    )


# --- the status server -----------------------------------------------------------------------


def _view(pid: int = 100) -> status_report.StatusView:
    h = StateHistory()
    v = verdict(STALLED, pid, [ev.NoFrontDoor()])
    h.update([(("svc", pid), verdict(PROGRESSING, pid))], wall=time.time() - 30)
    h.update([(("svc", pid), v)], wall=time.time() - 20)
    c = Carried(5.0, (OpenStream(pid, 99, 20.0),), 1, 20.0, 20.0, 20.0, None)
    return status_report.StatusView(
        daemon_pid=4321,
        version="0.test",
        wall=time.time(),
        threshold_s=1.0,
        interval_s=0.5,
        services=(
            status_report.ServiceStatus("svc", v, (pid, pid + 1), h.view()[("svc", pid)], c),
        ),
        flights={
            ("svc", pid): status_report.Flight.of(time.time() - 20, STALLED, ["process 100: x"])
        },
    )


@pytest.fixture
def server(tmp_path: Path):
    view = _view()
    path = str(tmp_path / "run" / "status.sock")
    srv = StatusServer(
        path,
        "no-such-group-hw",
        lambda req, _peer: status_report.answer(view, req.pid, time.time()),
    )
    assert srv.bind()
    srv.start()
    try:
        yield srv
    finally:
        srv.close()
    assert not Path(path).exists(), "the socket file is removed on close"


def test_the_socket_is_the_owners_alone_without_its_group(server: StatusServer) -> None:
    st = Path(server.path).stat()
    assert st.st_mode & 0o777 == 0o600
    assert Path(server.path).parent.stat().st_mode & 0o777 == 0o755


def test_status_answers_as_diagnose_words_it(server: StatusServer) -> None:
    doc = ask(server.path, proto.Request(pid=101), 5)
    (svc,) = doc["services"]
    assert (svc["state"], svc["pid"], svc["reasons"]) == (STALLED, 100, [render(ev.NoFrontDoor())])
    assert [(c["old"], c["new"]) for c in svc["changes"]] == [
        (None, PROGRESSING),
        (PROGRESSING, STALLED),
    ]
    assert 19 < svc["seconds_in_state"] < 60
    assert svc["carried"]["streams"][0]["last_sent_seconds"] >= 20
    assert svc["flight"]["lines"] == ["process 100: x"]
    assert proto.sight_of(svc, doc["daemon"]["pid"]).stream_ages_s[0] >= 20
    text = status_report.render_text(doc)
    assert "service svc (pid 100): STALLED since " in text and "progressing -> stalled" in text


def test_a_pid_not_watched_lists_what_is(server: StatusServer, capsys) -> None:
    with pytest.raises(
        UsageError, match=r"pid 5 is not watched.*service svc pid 100 \(pids 100, 101\)"
    ):
        run(StatusOptions(pid=5, socket_path=server.path))
    assert sighting(server.path, 5).service is None


def test_no_daemon_says_how_to_start_one(tmp_path: Path) -> None:
    with pytest.raises(UnavailableError, match=r"no hangwatch daemon answers at .*systemctl start"):
        ask(str(tmp_path / "none.sock"), proto.Request(), 1)
    seen = sighting(str(tmp_path / "none.sock"), 1)
    assert seen.service is None and "no hangwatch daemon answers" in (seen.why or "")


def _raw(path: str, send: bytes, timeout: float = 5) -> bytes:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(timeout)
        s.connect(path)
        with contextlib.suppress(OSError):
            s.sendall(send)
        data = b""
        try:
            while chunk := s.recv(65536):
                data += chunk
        except OSError:
            pass
        return data


def test_silent_greedy_and_surplus_clients_stall_no_one(server: StatusServer) -> None:
    silent = []
    for _ in range(MAX_CONNECTIONS - 2):  # connect and say nothing
        s = socket.socket(socket.AF_UNIX)
        s.connect(server.path)
        silent.append(s)
    greedy = threading.Thread(target=_raw, args=(server.path, b"x" * (1 << 20)))
    greedy.start()
    t0 = time.monotonic()
    assert ask(server.path, proto.Request(), 5)["ok"]
    assert time.monotonic() - t0 < 1.5, "an answer waited on the silent clients"
    greedy.join(10)
    # Past the cap: told busy (or closed), never queued behind the others.
    more = [socket.socket(socket.AF_UNIX) for _ in range(4)]
    for s in more:
        s.connect(server.path)
    busy = _raw(server.path, proto.encode_request(proto.Request()), 3)
    assert not busy or b'"busy"' in busy or b'"ok":true' in busy
    for s in silent + more:
        s.close()
    # The silent ones are dropped at their deadline; then it answers as before.
    time.sleep(0.2)
    assert ask(server.path, proto.Request(), 5)["ok"]
    assert server.busy >= 1


def test_a_greedy_request_is_told_it_is_too_long(server: StatusServer) -> None:
    got = _raw(server.path, b"{" + b" " * 5000 + b"\n")
    assert b"longer than 4096" in got


def test_a_peer_outside_the_group_is_refused(server: StatusServer) -> None:
    assert server.allowed(Peer(1, 0, 0))
    assert not server.allowed(Peer(1, 65534, 65534))
    server.gid = 4242
    assert server.allowed(Peer(1, 65534, 4242))


def test_a_directory_made_for_the_socket_is_removed_with_it(server: StatusServer) -> None:
    parent = Path(server.path).parent
    server.close()
    assert not parent.exists()


def test_a_second_daemon_on_the_path_serves_no_status_and_takes_nothing(
    server: StatusServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Found answering, or bound by the first in the moment between the look and the bind:
    the second logs it, serves none, and leaves the first's file and directory alone."""
    ino = Path(server.path).stat().st_ino

    def second() -> StatusServer:
        return StatusServer(server.path, "no-such-group-hw", lambda req, _peer: {})

    answering = second()
    assert answering.bind() is False
    raced = second()
    monkeypatch.setattr("agent.export.status.os.path.lexists", lambda _p: False)
    assert raced.bind() is False
    monkeypatch.undo()
    for late in (answering, raced):
        late.close()
    assert Path(server.path).stat().st_ino == ino
    assert caplog.text.count("another hangwatch daemon answers there") == 2
    assert ask(server.path, proto.Request(pid=None), 5)["services"], "the first still answers"
