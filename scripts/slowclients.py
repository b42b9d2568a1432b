"""Slow /metrics clients: connections that each send the next byte of a request head that never
ends every few seconds, and open again when the server drops them (a determined tenant).

Shared by the attack test (``tests/privileged/test_tenant_daemon.py``) and the benchmark
(``python -m bench --only slowclients``). Run as ``nobody`` with the system's Python, from
``-c`` (nobody may not read the repository): :func:`argv` builds that command line. The
client prints ``READY held=N`` once its connections are open.
"""

from __future__ import annotations

from scripts.fixturelib import AS_NOBODY as NOBODY
from scripts.fixturelib import SYSTEM_PYTHON as PYTHON

CLIENT = r"""
import socket, sys, time
port, n, every = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
REQ = b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: " + b"a" * 60000

def open_one():
    s = socket.socket()
    s.settimeout(2)
    try:
        s.connect(("127.0.0.1", port))
        s.send(REQ[:1])
    except OSError:
        s.close()
        return None
    s.setblocking(False)
    return s

def alive(s):
    try:
        return s.recv(1 << 16) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False

conns = [open_one() for _ in range(n)]
sent = [1] * n
print("READY held=%d" % sum(c is not None for c in conns), flush=True)
while True:
    time.sleep(every)
    for i, s in enumerate(conns):
        if s is not None and alive(s):
            try:
                s.send(REQ[sent[i] % len(REQ):][:1])
                sent[i] += 1
                continue
            except OSError:
                pass
        if s is not None:
            s.close()
        conns[i], sent[i] = open_one(), 1
"""


def argv(port: int, n: int, every_s: float) -> list[str]:
    """The command line of ``n`` slow clients of 127.0.0.1:``port``, a byte each every
    ``every_s`` seconds, run as nobody."""
    return [*NOBODY, PYTHON, "-c", CLIENT, str(port), str(n), str(every_s)]
