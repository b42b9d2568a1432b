"""Unanswered requests of another process: the hung_http fixture judged from outside it, and the
reader entering another network namespace (needs root and unshare(1)). tests/test_tcpinfo.py
holds the decision and the reader against this process's own connections."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import time

import pytest

from agent.analysis.requests import unanswered_requests
from agent.observe.sampler import Sampler
from agent.sources.procfs import ProcFS
from agent.sources.tcpinfo import NETNS, read_tcp_info
from scripts.fixturelib import Fixture
from tests.test_tcpinfo import JIFFY_S

# --- the reader, against the kernel -------------------------------------------------------


def test_hung_http_fixture_waits_and_keep_alive_does_not():
    """The fixture of the privileged diagnose test, judged from outside it."""
    with Fixture.py("hung_http") as fx:
        port = fx.info.get_int("port")
        with socket.create_connection(("127.0.0.1", port)) as kept:
            kept.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            assert b"200" in kept.recv(4096)
            with socket.create_connection(("127.0.0.1", port)) as hung:
                hung.sendall(b"GET /hang HTTP/1.1\r\nHost: x\r\n\r\n")
                fx.wait_for("HANGING")
                time.sleep(JIFFY_S)
                p = Sampler().snapshot([fx.pid]).processes[fx.pid]
                waiting = unanswered_requests(p, frozenset({port}))
                assert [c.remote_port for c in waiting] == [hung.getsockname()[1]]
                assert len(p.connections) == 2


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root")
def test_reader_enters_another_network_namespace():
    """A server in its own network namespace (a container's view): read through a socket
    made by the namespace thread (setns there, then back); this process's namespace does not
    have the socket. The thread is started once, not per read, and goes back to ours."""
    script = (
        "import os, socket, time\n"
        "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
        "c = socket.create_connection(s.getsockname()); c.sendall(b'hello')\n"
        "a, _ = s.accept()\n"
        "print(s.getsockname()[1], os.fstat(a.fileno()).st_ino, flush=True)\n"
        "time.sleep(60)\n"
    )
    cmd = ["unshare", "--net", "sh", "-c", 'ip link set lo up && exec "$0" -c "$1"']
    child = subprocess.Popen([*cmd, sys.executable, script], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        line = child.stdout.readline().split()
        if len(line) != 2:
            pytest.skip("no network namespace here (unshare --net or ip failed)")
        port, ino = int(line[0]), int(line[1])
        assert ProcFS().net_namespace(child.pid) != ProcFS().net_namespace("self")
        NETNS.start()
        threads = threading.active_count()
        for _ in range(3):
            got = ProcFS().tcp_info(child.pid, [("tcp", port)])
            assert ino in got and got[ino].bytes_received == 5
        assert threading.active_count() == threads
        assert ino not in read_tcp_info([("tcp", port)])
        worker = next(t for t in threading.enumerate() if t.name == "hangwatch-netns")
        own = os.readlink("/proc/self/ns/net")
        assert os.readlink(f"/proc/self/task/{worker.native_id}/ns/net") == own
    finally:
        child.kill()
        child.wait()
