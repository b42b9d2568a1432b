"""scripts/realsw.kill_tree: a tree killed with SIGKILL leaves no /dev/shm name it held (an
engine's shared memory and semaphores), and removes none that another process still holds."""

from __future__ import annotations

import os
import subprocess
import sys
from multiprocessing import shared_memory
from pathlib import Path

from scripts.realsw import alive, descendants, kill_tree

# A parent that maps a shared memory segment and holds a file of /dev/shm open, and a child
# that maps a second segment; each prints what it made, then all wait to be killed.
TREE = """
import os, sys
from multiprocessing import shared_memory
mine = shared_memory.SharedMemory(create=True, size=4096)
shared = shared_memory.SharedMemory(create=True, size=4096)
held = open(f"/dev/shm/hangwatch-test-{os.getpid()}", "w")
r, w = os.pipe()
if os.fork() == 0:
    kid = shared_memory.SharedMemory(create=True, size=4096)
    os.write(w, (kid.name.lstrip("/") + "\\n").encode())
    sys.stdin.read()
    os._exit(0)
kid = os.read(r, 100).decode().strip()
print(mine.name.lstrip("/"), shared.name.lstrip("/"), os.path.basename(held.name), kid, flush=True)
sys.stdin.read()
"""


def test_the_names_a_killed_tree_held_are_removed_but_one_still_held_elsewhere() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", TREE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    ours, made = None, []
    try:
        assert proc.stdout is not None
        made = proc.stdout.readline().split()
        mine, shared, held, kid = made
        tree = [proc.pid, *descendants(proc.pid)]
        ours = shared_memory.SharedMemory(name=shared)  # held by this process too
        kill_tree(proc.pid)
        proc.wait()
        assert not any(alive(p) for p in tree[1:]), tree
        left = set(os.listdir("/dev/shm"))
        assert not {mine, held, kid} & left, (mine, held, kid)
        assert shared in left, "a name another process still maps was removed"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if ours is not None:
            ours.close()
        for name in made:  # whatever the test left, when it failed
            Path("/dev/shm", name).unlink(missing_ok=True)
