"""The BPF programs and maps loaded in the kernel, straight from the bpf(2) syscall.

Used by the privileged tests to prove that the daemon leaves nothing behind (the program
IDs it added while running must all be gone after it exits, however it exits) and that its
maps stay bounded (entries per map of a running process), and by the benchmark to tell
whether some hangwatch object is loaded. No bpftool needed.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import time
from collections.abc import Iterator
from pathlib import Path

NR_BPF = 321  # x86-64
BPF_MAP_GET_NEXT_KEY = 4
BPF_PROG_GET_NEXT_ID = 11
BPF_MAP_GET_NEXT_ID = 12
BPF_MAP_GET_FD_BY_ID = 14
BPF_OBJ_GET_INFO_BY_FD = 15
HASH_MAP_TYPES = {1: "hash", 5: "percpu_hash", 9: "lru_hash", 10: "lru_percpu_hash"}

_libc = ctypes.CDLL(None, use_errno=True)


class _NextIdAttr(ctypes.Structure):
    _fields_ = [
        ("start_id", ctypes.c_uint32),
        ("next_id", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
    ]


class _InfoAttr(ctypes.Structure):
    _fields_ = [
        ("bpf_fd", ctypes.c_uint32),
        ("info_len", ctypes.c_uint32),
        ("info", ctypes.c_uint64),
    ]


class _MapInfo(ctypes.Structure):
    """The head of struct bpf_map_info: the kernel fills no more than we ask for."""

    _fields_ = [
        ("type", ctypes.c_uint32),
        ("id", ctypes.c_uint32),
        ("key_size", ctypes.c_uint32),
        ("value_size", ctypes.c_uint32),
        ("max_entries", ctypes.c_uint32),
        ("map_flags", ctypes.c_uint32),
        ("name", ctypes.c_char * 16),
    ]


class _NextKeyAttr(ctypes.Structure):
    _fields_ = [
        ("map_fd", ctypes.c_uint32),
        ("pad", ctypes.c_uint32),
        ("key", ctypes.c_uint64),
        ("next_key", ctypes.c_uint64),
    ]


def _bpf(cmd: int, attr: ctypes.Structure) -> int:
    return _libc.syscall(NR_BPF, cmd, ctypes.byref(attr), ctypes.sizeof(attr))


def _next_ids(cmd: int) -> set[int]:
    """Every ID that a GET_NEXT_ID command walks (programs, maps; needs CAP_SYS_ADMIN)."""
    ids: set[int] = set()
    attr = _NextIdAttr(0, 0, 0)
    while True:
        if _bpf(cmd, attr) != 0:
            err = ctypes.get_errno()
            if err == errno.ENOENT:
                return ids
            raise OSError(err, os.strerror(err))
        ids.add(attr.next_id)
        attr.start_id = attr.next_id


def prog_ids() -> set[int]:
    """IDs of every BPF program loaded now (needs CAP_SYS_ADMIN)."""
    return _next_ids(BPF_PROG_GET_NEXT_ID)


def map_names() -> list[str]:
    """The name of every BPF map loaded now, anyone's (needs CAP_SYS_ADMIN)."""
    names = []
    for map_id in _next_ids(BPF_MAP_GET_NEXT_ID):
        with _map_info(map_id) as got:
            if got is not None:
                names.append(got[1].name.decode(errors="replace"))
    return names


@contextlib.contextmanager
def _map_info(map_id: int) -> Iterator[tuple[int, _MapInfo] | None]:
    """(fd, info) of a map, the fd open for the block; None if it was freed meanwhile."""
    fd = _bpf(BPF_MAP_GET_FD_BY_ID, _NextIdAttr(map_id, 0, 0))
    if fd < 0:
        yield None
        return
    try:
        info = _MapInfo()
        attr = _InfoAttr(fd, ctypes.sizeof(info), ctypes.addressof(info))
        yield (fd, info) if _bpf(BPF_OBJ_GET_INFO_BY_FD, attr) == 0 else None
    finally:
        os.close(fd)


def _fdinfo_ids(pid: int | str, key: str) -> set[int]:
    """The ``key:`` values (prog_id, map_id) of every fd that ``pid`` holds."""
    ids: set[int] = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fdinfo")
    except OSError:
        return ids
    for fd in fds:
        try:
            text = Path(f"/proc/{pid}/fdinfo/{fd}").read_text()
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith(key + ":"):
                ids.add(int(line.split()[1]))
    return ids


def held_prog_ids() -> set[int]:
    """IDs of BPF programs that some live process holds an fd of (from /proc/*/fdinfo).

    Other tests may load programs meanwhile: a new program that a live process holds is
    theirs; one that nobody holds and that stays is a leak.
    """
    held: set[int] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        held |= _fdinfo_ids(pid, "prog_id")
    return held


def leaked(added: set[int], grace_s: float = 10.0) -> set[int]:
    """Programs of ``added`` still loaded and held by no live process, after a grace period
    (the kernel frees a program after an RCU grace period). A program someone else loaded
    meanwhile is held by its live loader, so concurrent tests do not count as leaks."""
    deadline = time.monotonic() + grace_s
    while True:
        left = (added & prog_ids()) - held_prog_ids()
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def map_entries(pid: int) -> dict[str, tuple[int, int]]:
    """Hash maps that process ``pid`` holds: name -> (entries now, max entries)."""
    out: dict[str, tuple[int, int]] = {}
    for map_id in _fdinfo_ids(pid, "map_id"):
        with _map_info(map_id) as got:
            if got is None or got[1].type not in HASH_MAP_TYPES:
                continue  # freed meanwhile, or not a hash
            fd, info = got
            out[info.name.decode()] = (_count_keys(fd, info.key_size), info.max_entries)
    return out


def _count_keys(fd: int, key_size: int) -> int:
    key = ctypes.create_string_buffer(key_size)
    nxt = ctypes.create_string_buffer(key_size)
    attr = _NextKeyAttr(fd, 0, 0, ctypes.addressof(nxt))  # key NULL: the first key
    n = 0
    while _bpf(BPF_MAP_GET_NEXT_KEY, attr) == 0:
        n += 1
        ctypes.memmove(key, nxt, key_size)
        attr.key = ctypes.addressof(key)
    return n
