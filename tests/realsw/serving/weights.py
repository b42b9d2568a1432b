"""Model weights: a small local weight server, and the scheduler's two ways to load them.

The weight server stands for remote storage (a model hub, an object store, NFS): it streams
``--mib`` MiB of bytes to each connection at ``--rate`` MiB/s, after an 8-byte big-endian
length, until a line on its standard input releases it; then at once. A test sizes the load
to outlast its look (so that the load ends when the test says, never by a clock) and writes
the line, or ends the stack, when it has looked. Run it as its own process, outside the
serving stack's process tree::

    python -m tests.realsw.serving.weights --port 0 --rate 2 --mib 64
    READY pid=P port=N

Stdlib only: the tests may run it with their own interpreter.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

CHUNK = 64 * 1024  # what the server sends per write
MIB = 1024 * 1024
KEPT = 64 * MIB  # of the weights received, what a loader keeps
logger = logging.getLogger("scheduler.loader")


# --- the server --------------------------------------------------------------------------------


def _stream(conn: socket.socket, total: int, rate: float, released: threading.Event) -> None:
    """Send ``total`` bytes at ``rate`` bytes/s (each chunk waits for its slot on a
    schedule) until ``released``, then the rest at once."""
    payload = os.urandom(CHUNK)
    with conn:
        try:
            conn.sendall(struct.pack(">Q", total))
            start, sent = time.monotonic(), 0
            while sent < total:
                delay = start + sent / rate - time.monotonic()
                if delay > 0 and not released.is_set():
                    released.wait(delay)
                n = min(CHUNK, total - sent)
                conn.sendall(payload[:n])
                sent += n
        except OSError:  # the loader went away (its stack was killed): fine
            pass


def _release_on_a_line(released: threading.Event) -> None:
    sys.stdin.readline()  # a line, or the end of the input
    released.set()


def serve(port: int, rate_mib: float, mib: int) -> None:
    released = threading.Event()
    threading.Thread(target=_release_on_a_line, args=(released,), daemon=True).start()
    srv = socket.create_server(("127.0.0.1", port))
    print(f"READY pid={os.getpid()} port={srv.getsockname()[1]}", flush=True)
    while True:
        conn, _ = srv.accept()
        threading.Thread(
            target=_stream, args=(conn, mib * MIB, rate_mib * MIB, released), daemon=True
        ).start()


# --- the loaders (run in the scheduler process) ------------------------------------------------


def _progress(done: int, total: int, began: float) -> None:
    rate = done / MIB / max(time.monotonic() - began, 1e-6)
    logger.info(
        "Loading weights: %d/%d MiB (%.0f%%), %.1f MiB/s",
        done // MIB,
        total // MIB,
        100 * done / total,
        rate,
    )


def load_from_tcp(
    host: str, port: int, on_first: Callable[[], None], log_every_mib: int = 1
) -> bytearray:
    """Receive the weights from the weight server; a progress line per ``log_every_mib``
    MiB (loaders that log rarely, or only at the end, are as common). Keeps the first
    ``KEPT`` bytes, what the forward reads: a load sized to outlast a test's look is large."""
    weights, received = bytearray(), 0
    with socket.create_connection((host, port)) as sock:
        header = b""
        while len(header) < 8:
            part = sock.recv(8 - len(header))
            if not part:
                raise ConnectionError("weight server closed before the length")
            header += part
        (total,) = struct.unpack(">Q", header)
        logger.info("Load weight begin: %d MiB from %s:%d", total // MIB, host, port)
        began, next_log = time.monotonic(), MIB
        buf = bytearray(256 * 1024)
        while received < total:
            n = sock.recv_into(buf, min(len(buf), total - received))
            if n == 0:
                raise ConnectionError(f"weight server closed at {received} of {total} bytes")
            received += n
            if len(weights) < KEPT:
                weights += buf[: min(n, KEPT - len(weights))]
            if received >= next_log or received == total:  # the first MiB, then each step
                _progress(received, total, began)
                if next_log == MIB:
                    on_first()
                next_log = (received // MIB // log_every_mib + 1) * log_every_mib * MIB
    logger.info("Load weight end: %d MiB", total // MIB)
    return weights


def load_from_file(path: Path, on_first: Callable[[], None]) -> bytearray:
    """Read the weights file in 1 MiB chunks, checksum each (as a loader verifies shards)."""
    total = path.stat().st_size
    logger.info("Load weight begin: %d MiB from %s", total // MIB, path)
    weights, began, digest = bytearray(), time.monotonic(), hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(MIB):
            digest.update(chunk)
            weights += chunk
            _progress(len(weights), total, began)
            if len(weights) == len(chunk):
                on_first()
    logger.info("Load weight end: %d MiB, sha256 %s", total // MIB, digest.hexdigest()[:16])
    return weights


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--rate", type=float, default=2.0, help="MiB/s per connection (default 2)")
    p.add_argument("--mib", type=int, default=64, help="MiB sent per connection (default 64)")
    args = p.parse_args(argv)
    serve(args.port, args.rate, args.mib)
    return 0


if __name__ == "__main__":
    sys.exit(main())
