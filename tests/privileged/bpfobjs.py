"""The BPF programs loaded in the kernel, by ID, straight from the bpf(2) syscall.

Used to prove that the daemon leaves nothing behind: the IDs it added while running must
all be gone after it exits. No bpftool needed.
"""

from __future__ import annotations

import ctypes
import errno
import os

NR_BPF = 321  # x86-64
BPF_PROG_GET_NEXT_ID = 11

_libc = ctypes.CDLL(None, use_errno=True)


class _NextIdAttr(ctypes.Structure):
    _fields_ = [
        ("start_id", ctypes.c_uint32),
        ("next_id", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
    ]


def prog_ids() -> set[int]:
    """IDs of every BPF program loaded now (needs CAP_SYS_ADMIN)."""
    ids: set[int] = set()
    attr = _NextIdAttr(0, 0, 0)
    while True:
        rc = _libc.syscall(NR_BPF, BPF_PROG_GET_NEXT_ID, ctypes.byref(attr), ctypes.sizeof(attr))
        if rc != 0:
            err = ctypes.get_errno()
            if err == errno.ENOENT:
                return ids
            raise OSError(err, os.strerror(err))
        ids.add(attr.next_id)
        attr.start_id = attr.next_id
