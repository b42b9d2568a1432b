"""A client of the stack's ``POST /generate``, over loopback TCP with httpx.

    python -m tests.realsw.serving.client --port N --mode MODE

Modes, and what it prints (flushed):

* ``once``: one request, no timeout. ``SENDING``, then ``ANSWER ...`` if it ever comes.
* ``continuous``: one keep-alive connection, a request every ``--interval`` s.
  ``READY answered=1`` after the first answer, then ``STATS answered=N`` twice a second.
* ``close``: as ``continuous``, but each request on a new connection with ``Connection:
  close`` (as curl and health checkers): the server closes it once it has answered.
* ``retry``: each attempt a new connection that gives up after ``--timeout`` s, then the next.
  ``TIMEOUT attempt=N`` per attempt that timed out (``ANSWER`` if one is answered).
* ``queue``: ``--connections`` concurrent requests, one every ``--spacing`` s, no timeouts.
  ``OPENED n=N`` as each starts; then it waits forever.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

import httpx

BODY = {"text": "The capital of France is", "max_new_tokens": 8}


def once(url: str, args: argparse.Namespace) -> None:
    print("SENDING", flush=True)
    r = httpx.post(url, json=BODY, timeout=None)
    print(f"ANSWER status={r.status_code} text={r.json().get('text')}", flush=True)


def continuous(url: str, args: argparse.Namespace) -> None:
    answered, last = 0, time.monotonic()
    short = args.mode == "close"
    with httpx.Client(timeout=30) as client:
        while True:
            if short:  # a connection of its own, closed by the server after the answer
                with httpx.Client(timeout=30, headers={"Connection": "close"}) as one:
                    r = one.post(url, json=BODY)
            else:
                r = client.post(url, json=BODY)
            r.raise_for_status()
            answered += 1
            if answered == 1:
                print("READY answered=1", flush=True)
            if (now := time.monotonic()) - last >= 0.5:
                print(f"STATS answered={answered}", flush=True)
                last = now
            time.sleep(args.interval)


def retry(url: str, args: argparse.Namespace) -> None:
    attempt = 0
    while True:
        attempt += 1
        try:
            with httpx.Client(timeout=args.timeout) as client:  # a new connection each time
                r = client.post(url, json=BODY)
            print(f"ANSWER attempt={attempt} status={r.status_code}", flush=True)
            time.sleep(args.timeout)
        except httpx.TimeoutException:
            print(f"TIMEOUT attempt={attempt}", flush=True)


def queue(url: str, args: argparse.Namespace) -> None:
    def one() -> None:
        try:
            httpx.post(url, json=BODY, timeout=None)
        except httpx.HTTPError as e:
            print(f"ERROR {type(e).__name__}", flush=True)

    for n in range(1, args.connections + 1):
        threading.Thread(target=one, daemon=True).start()
        print(f"OPENED n={n}", flush=True)
        time.sleep(args.spacing)
    threading.Event().wait()


MODES = {
    "once": once,
    "continuous": continuous,
    "close": continuous,
    "retry": retry,
    "queue": queue,
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--mode", choices=MODES, required=True)
    p.add_argument(
        "--interval", type=float, default=0.05, help="continuous: pause between requests"
    )
    p.add_argument("--timeout", type=float, default=1.0, help="retry: seconds per attempt")
    p.add_argument("--connections", type=int, default=8, help="queue: concurrent requests")
    p.add_argument("--spacing", type=float, default=0.1, help="queue: seconds between them")
    args = p.parse_args(argv)
    MODES[args.mode](f"http://127.0.0.1:{args.port}/generate", args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
