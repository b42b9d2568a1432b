"""`hangwatch status`: ask the running daemon, on its status socket, for its verdicts and
history. Needs no BPF and no root: the socket's group may ask (docs/deploy.md)."""

from __future__ import annotations

import errno
import grp
import json
import os
import pwd
import socket
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TextIO

from .config import DEFAULT_STATUS_GROUP, DEFAULT_STATUS_SOCKET
from .errors import KernelFeatureError, UnavailableError, UsageError
from .export import statusproto as proto
from .report import status as status_report

DEFAULT_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class StatusOptions:
    pid: int | None = None
    as_json: bool = False
    socket_path: str = DEFAULT_STATUS_SOCKET
    timeout_s: float = DEFAULT_TIMEOUT_S


def _user() -> str:
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return "USER"


def _group_of(path: str) -> str:
    """The group the socket file belongs to: the one that may ask."""
    try:
        return grp.getgrgid(os.stat(path).st_gid).gr_name
    except (OSError, KeyError):
        return DEFAULT_STATUS_GROUP


def refused(path: str, group: str) -> KernelFeatureError:
    return KernelFeatureError(
        f"{path} refused access to uid {os.getuid()}",
        f"run as root, or add the user to group {group} (usermod -aG {group} {_user()}, "
        "then log in again)",
    )


def no_daemon(path: str) -> UnavailableError:
    return UnavailableError(
        f"no hangwatch daemon answers at {path}",
        "start it (systemctl start hangwatch, or make run)",
    )


def ask(path: str, req: proto.Request, timeout_s: float) -> dict[str, Any]:
    """The daemon's answer (``ok`` true), or the error that says what to do."""
    deadline = time.monotonic() + timeout_s
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        try:
            s.connect(path)
            s.sendall(proto.encode_request(req))
            data = bytearray()
            while not data.endswith(b"\n") and len(data) <= proto.MAX_ANSWER_BYTES:
                s.settimeout(max(0.001, deadline - time.monotonic()))
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
        except (FileNotFoundError, ConnectionRefusedError):
            raise no_daemon(path) from None
        except PermissionError:
            raise refused(path, _group_of(path)) from None
        except TimeoutError:
            raise UnavailableError(
                f"the daemon at {path} did not answer within {timeout_s:g} s",
                "it may be overloaded: try again, with a longer --timeout",
            ) from None
        except OSError as e:
            if e.errno in (errno.ECONNRESET, errno.EPIPE):
                raise UnavailableError(
                    f"the daemon at {path} closed the connection without an answer",
                    "it may be serving too many clients: try again",
                ) from None
            raise UnavailableError(f"cannot ask the daemon at {path}: {e.strerror or e}") from None
    try:
        doc = proto.decode_answer(bytes(data))
    except proto.ProtocolError as e:
        raise UnavailableError(f"the daemon at {path} answered badly: {e}") from None
    if not doc["ok"]:
        code, message = doc.get("error"), str(doc.get("message", ""))[:300]
        if code == proto.REFUSED:
            group = message.rsplit(" ", 1)[-1] if " in group " in message else _group_of(path)
            raise refused(path, group)
        raise UnavailableError(f"the daemon at {path} answered {code}: {message}")
    return doc


def not_watched(path: str, pid: int, doc: Mapping[str, Any]) -> UsageError:
    watched = doc.get("watched") or []
    if not watched:
        listed = "nothing (no process matches its targets)"
    else:
        listed = "; ".join(
            f"service {w.get('service')} pid {w.get('pid')}"
            + (f" (pids {', '.join(map(str, w['pids']))})" if len(w.get("pids") or []) > 1 else "")
            for w in watched[:20]
        ) + (f"; and {len(watched) - 20} more" if len(watched) > 20 else "")
    return UsageError(
        f"pid {pid} is not watched by the daemon at {path}",
        f"it watches {listed}; hangwatch diagnose --pid {pid} observes any process",
    )


def run(opts: StatusOptions, out: TextIO = sys.stdout) -> int:
    if opts.pid is not None and opts.pid <= 0:
        raise UsageError(f"--pid {opts.pid}: not a PID")
    if not 0 < opts.timeout_s <= 600:
        raise UsageError(f"--timeout {opts.timeout_s:g}: want seconds from 0 to 600")
    doc = ask(opts.socket_path, proto.Request(pid=opts.pid), opts.timeout_s)
    if opts.pid is not None and not doc.get("services"):
        raise not_watched(opts.socket_path, opts.pid, doc)
    if opts.as_json:
        json.dump(doc, out, indent=2)
        out.write("\n")
    else:
        out.write(status_report.render_text(doc))
    return 0


@dataclass(frozen=True)
class Sighting:
    """What `diagnose` learnt from the daemon for one pid: its service's record, or why
    there is none (no daemon, no access, not watched)."""

    daemon_pid: int | None
    service: Mapping[str, Any] | None
    why: str | None


def sighting(path: str, pid: int, timeout_s: float = 1.0) -> Sighting:
    """The daemon's service holding ``pid``, asked within ``timeout_s``; never raises: a
    daemon that is absent, refuses or fails is only history not had."""
    try:
        doc = ask(path, proto.Request(pid=pid), timeout_s)
    except (UnavailableError, KernelFeatureError) as e:
        return Sighting(None, None, e.what)
    daemon = doc.get("daemon")
    daemon_pid = daemon.get("pid") if isinstance(daemon, dict) else None
    services = doc.get("services") or []
    if not isinstance(daemon_pid, int) or not services or not isinstance(services[0], dict):
        why = f"the daemon at {path} does not watch pid {pid}"
        return Sighting(daemon_pid if isinstance(daemon_pid, int) else None, None, why)
    return Sighting(daemon_pid, services[0], None)
