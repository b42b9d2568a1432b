"""Two small /proc readers that the stack's READY announcement and the tests both use.

Stdlib only. x86-64 syscall numbers, as ``/proc/PID/task/TID/syscall`` shows them.
"""

from __future__ import annotations

SYS_FUTEX = 202


def listen_queue(port: int) -> int | None:
    """How many connections wait in the accept queue of the IPv4 TCP socket listening on
    ``port`` (None: nothing listens there).

    For a listening socket /proc/net/tcp's rx_queue is the accept queue's length. Its backlog
    is not there (``ss -lnt`` shows it, from netlink); the kernel lets the queue reach
    backlog + 1 and then drops handshakes.
    """
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            fields = line.split()
            local, state, queues = fields[1], fields[3], fields[4]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                return int(queues.split(":")[1], 16)
    return None


def futex_parked(pid: int, tids: list[int]) -> tuple[tuple[str, str], ...] | None:
    """For threads that all sleep in futex(2): each one's ``(word, CPU time in ns)``; else None.

    Equal results some time apart mean the threads stayed parked on the same words without
    running in between (a thread that woke and slept again has more CPU time).
    """
    seen = []
    for tid in tids:
        base = f"/proc/{pid}/task/{tid}"
        try:
            with open(f"{base}/stat") as f:
                state = f.read().rpartition(")")[2].split()[0]
            with open(f"{base}/syscall") as f:
                call = f.read().split()
            with open(f"{base}/schedstat") as f:
                ran = f.read().split()[0]
        except (OSError, IndexError):
            return None
        if state != "S" or len(call) < 2 or call[0] != str(SYS_FUTEX):
            return None
        seen.append((call[1], ran))
    return tuple(seen)
