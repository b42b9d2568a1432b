"""A small client for the Prometheus HTTP API: instant queries only, standard library only.

Every failure is an UnavailableError (exit 4) that names the URL and what to check; a bad URL
is a UsageError (exit 2). No message shows a URL's userinfo (user:password@, or a token given
as the user): it is replaced by ``***@``, even in a URL too broken to parse. A redirect is
followed, but the credentials go only to the origin they were given for (scheme, host and
port): urllib would copy Authorization into a request to wherever the Location points.
"""

from __future__ import annotations

import base64
import http.client
import json
import math
import re
import socket
import ssl
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .. import __version__
from ..errors import UnavailableError, UsageError, show
from ..model import printable

# A series of an instant vector: its labels (__name__ dropped) and its value.
Sample = tuple[Mapping[str, str], float]

# Far more than a job of thousands of ranks answers; a cap keeps a wrong URL (a file server,
# an endless stream) from filling memory.
MAX_ANSWER_BYTES = 256 << 20
TIMEOUT_MAX_S = 600.0
HIDDEN = "***@"  # what a message shows for a URL's userinfo
# Request headers that carry credentials: never sent on to another origin.
CREDENTIALS = ("Authorization", "Proxy-Authorization", "Cookie")
DEFAULT_PORTS = {"http": 80, "https": 443}
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def redacted(text: str) -> str:
    """``text``, a URL or what was meant as one, with its userinfo shown as ``***@``: all
    from its start (after a leading "scheme://", if any) to its last "@". Read without a URL
    parser, so that a URL that does not parse (a port out of range, a password with a "/" in
    it) hides it too; an "@" further on (in a path or a query) hides more, never less."""
    scheme = _SCHEME.match(text)
    start = scheme.end() if scheme else 0
    at = text.rfind("@", start)
    return text if at < 0 else text[:start] + HIDDEN + text[at + 1 :]


def _unparsed(text: str, e: ValueError) -> str:
    """Why ``text`` does not parse, in words that hold nothing of its userinfo: the parser
    quotes what it could not read, which may be a piece of the password."""
    hidden = redacted(text)
    if hidden == text:
        return str(e)
    try:
        _ = urllib.parse.urlsplit(hidden).port  # the port is parsed when asked for
    except ValueError as without:
        return str(without)  # the same fault, outside the userinfo
    return 'its user or password holds a "/", "?", "#" or "@" not percent-encoded'


def _origin(url: str) -> tuple[str, str, int] | None:
    """(scheme, host, port) of ``url``, the port its scheme's default where none is given;
    None where it does not parse (no origin is the same as it)."""
    try:
        parts = urllib.parse.urlsplit(url)
        scheme = parts.scheme.lower()
        port = parts.port or DEFAULT_PORTS.get(scheme)
    except ValueError:
        return None
    if not parts.hostname or port is None:
        return None
    return scheme, parts.hostname.lower(), port


class SameOriginRedirects(urllib.request.HTTPRedirectHandler):
    """urllib's redirects, with the credentials dropped on the way to another origin (a
    proxy's 302 to another host or port, or from https to http), and only to http or https."""

    def redirect_request(
        self,
        req: urllib.request.Request,
        fp: Any,
        code: int,
        msg: str,
        headers: Any,
        newurl: str,
    ) -> urllib.request.Request | None:
        if urllib.parse.urlsplit(newurl).scheme.lower() not in DEFAULT_PORTS:
            raise urllib.error.HTTPError(
                req.full_url, code, "a redirect to neither http nor https", headers, fp
            )
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None:
            here = _origin(req.full_url)
            if here is None or _origin(new.full_url) != here:
                for name in CREDENTIALS:
                    new.remove_header(name.capitalize())  # as Request keeps header names
        return new


@dataclass(frozen=True)
class Endpoint:
    """Where the API is: its base URL (a path prefix such as /prometheus kept), the same URL
    to show (a password is never shown), and the Authorization header for user:password@."""

    base: str
    shown: str
    authorization: str | None = None

    @classmethod
    def parse(cls, text: str, flag: str = "--prometheus") -> Endpoint:
        try:
            parts = urllib.parse.urlsplit(text.strip())
            port = parts.port  # a port that is not a number raises here, not at connect time
        except ValueError as e:
            raise UsageError(
                f"{flag} {show(redacted(text))}: {_unparsed(text, e)}",
                "give a URL such as http://prometheus:9090",
            ) from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise UsageError(
                f"{flag} {show(redacted(text))}: not an http:// or https:// URL with a host",
                "give the base URL of Prometheus, such as http://prometheus:9090",
            )
        if parts.query or parts.fragment:
            raise UsageError(
                f"{flag} {show(redacted(text))}: a base URL has no ?query or #fragment",
                "give the URL without them; hangwatch adds /api/v1/query",
            )
        host = parts.hostname
        if ":" in host:  # IPv6: urlsplit drops the brackets
            host = f"[{host}]"
        netloc = host if port is None else f"{host}:{port}"
        base = urllib.parse.urlunsplit((parts.scheme, netloc, parts.path.rstrip("/"), "", ""))
        authorization, shown = None, base
        if parts.username is not None:
            user = urllib.parse.unquote(parts.username)
            password = urllib.parse.unquote(parts.password or "")
            token = base64.b64encode(f"{user}:{password}".encode()).decode()
            authorization = f"Basic {token}"
            shown = urllib.parse.urlunsplit(
                (parts.scheme, f"{HIDDEN}{netloc}", parts.path.rstrip("/"), "", "")
            )
        return cls(base=base, shown=shown, authorization=authorization)


def check_timeout(seconds: float, flag: str = "--timeout") -> float:
    if not (math.isfinite(seconds) and 0 < seconds <= TIMEOUT_MAX_S):
        raise UsageError(
            f"{flag} {seconds:g}: out of range", f"give seconds above 0, at most {TIMEOUT_MAX_S:g}"
        )
    return seconds


@dataclass
class Prometheus:
    endpoint: Endpoint
    timeout_s: float = 10.0
    # What the API said beside its answers (a partial answer from a federating proxy, say):
    # shown to the user, since the table may then lack ranks.
    warnings: list[str] = field(default_factory=list)

    def query(self, expr: str) -> list[Sample]:
        """The instant vector `expr` evaluates to now. A scalar is one sample without labels."""
        data = self._get("/api/v1/query", {"query": expr})
        kind, result = data.get("resultType"), data.get("result")
        try:
            if kind == "vector" and isinstance(result, list):
                return [_sample(item) for item in result]
            if kind == "scalar" and isinstance(result, list):
                return [({}, float(result[1]))]
        except (TypeError, ValueError, KeyError, IndexError, AttributeError):
            pass
        raise UnavailableError(
            f"Prometheus at {self.endpoint.shown} answered {show(expr)} with a result that is "
            f"not an instant vector ({show(kind)})",
            "is the URL the Prometheus HTTP API (or one compatible with it)?",
        )

    def _get(self, path: str, params: Mapping[str, str]) -> Mapping[str, Any]:
        url = f"{self.endpoint.base}{path}?{urllib.parse.urlencode(params)}"
        headers = {"Accept": "application/json", "User-Agent": f"hangwatch/{__version__}"}
        if self.endpoint.authorization is not None:
            headers["Authorization"] = self.endpoint.authorization
        request = urllib.request.Request(url, headers=headers)
        where = f"Prometheus at {self.endpoint.shown}"
        try:
            opener = urllib.request.build_opener(SameOriginRedirects())
            with opener.open(request, timeout=self.timeout_s) as answer:
                body = answer.read(MAX_ANSWER_BYTES + 1)
                status, ctype = answer.status, answer.headers.get("Content-Type", "")
        except urllib.error.HTTPError as e:
            raise _http_error(where, e) from None
        except urllib.error.URLError as e:
            raise _unreachable(where, e.reason, self.timeout_s) from None
        except (OSError, http.client.HTTPException) as e:
            raise _unreachable(where, e, self.timeout_s) from None
        if len(body) > MAX_ANSWER_BYTES:
            raise UnavailableError(
                f"{where} answered more than {MAX_ANSWER_BYTES >> 20} MiB",
                "is the URL the Prometheus HTTP API?",
            )
        doc = _json(body)
        if not isinstance(doc, dict):
            raise UnavailableError(
                f"{where} answered HTTP {status} with something other than JSON "
                f"({ctype or 'no content type'}: {_excerpt(body)})",
                "is the URL the base URL of Prometheus, such as http://prometheus:9090?",
            )
        if doc.get("status") != "success":
            raise UnavailableError(f"{where} answered an error: {_api_error(doc)}")
        self.warnings.extend(str(w) for w in doc.get("warnings") or () if w)
        data = doc.get("data")
        if not isinstance(data, dict):
            raise UnavailableError(f"{where} answered success without data: {_excerpt(body)}")
        return data


def _sample(item: Mapping[str, Any]) -> Sample:
    labels = {str(k): str(v) for k, v in item["metric"].items() if k != "__name__"}
    return labels, float(item["value"][1])  # "NaN", "+Inf" parse too


def _json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        return None


def _excerpt(body: bytes, limit: int = 80) -> str:
    text = " ".join(body.decode(errors="replace").split())
    text = printable(text, None)  # it may come from anywhere
    return show(text, limit) if text else "an empty body"


def _api_error(doc: Mapping[str, Any]) -> str:
    kind, error = doc.get("errorType"), doc.get("error")
    text = f"{kind}: {error}" if kind and error else str(error or kind or "no error given")
    return printable(text, None)


def _http_error(where: str, e: urllib.error.HTTPError) -> UnavailableError:
    try:
        body = e.read(64 << 10)
    except (OSError, http.client.HTTPException):
        body = b""
    doc = _json(body)
    said = _api_error(doc) if isinstance(doc, dict) and "error" in doc else _excerpt(body)
    fix = {
        400: "a query Prometheus does not accept: it needs Prometheus 2.7 or later (subqueries)",
        401: "it wants credentials: give them in the URL, https://USER:PASSWORD@HOST:PORT",
        403: "it refuses these credentials: check the user in the URL and its rights",
        404: "no API there: give the base URL of Prometheus (hangwatch adds /api/v1/query)",
        422: "a query Prometheus cannot run: it needs Prometheus 2.7 or later (subqueries)",
    }.get(e.code, "check Prometheus (or a proxy in front of it) and its logs")
    return UnavailableError(f"{where} answered HTTP {e.code}: {said}", fix)


def _unreachable(where: str, reason: object, timeout_s: float) -> UnavailableError:
    if isinstance(reason, (TimeoutError, socket.timeout)):
        return UnavailableError(
            f"{where} did not answer within {timeout_s:g} s",
            "check the URL and that Prometheus is up, or give it longer with --timeout",
        )
    if isinstance(reason, ConnectionRefusedError):
        return UnavailableError(
            f"cannot reach {where}: connection refused",
            "check the URL's host and port, and that Prometheus runs and listens there",
        )
    if isinstance(reason, socket.gaierror):
        return UnavailableError(
            f"cannot reach {where}: the host name does not resolve ({reason.strerror})",
            "check the URL's host name",
        )
    if isinstance(reason, ssl.SSLError):
        return UnavailableError(
            f"cannot reach {where}: TLS failed ({reason})",
            "for a certificate signed by a private CA, point SSL_CERT_FILE at the CA's bundle",
        )
    return UnavailableError(f"cannot reach {where}: {reason}", "check the URL and the network")
