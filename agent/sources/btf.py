"""Offsets of kernel struct members, from the running kernel's BTF (/sys/kernel/btf/vmlinux).

The write probe names the fd it counts by walking the kernel's own structs (task -> fd table
-> file -> socket -> sock). Their layout changes with every kernel version and config, so
the offsets cannot come from a header tree (the one bcc finds may be another kernel's): they
are read here from the kernel's type information and passed to the compiler as constants.
Only what the walk needs is parsed: the type section's structs and unions, their members,
and the strings that name them.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

VMLINUX_BTF = Path("/sys/kernel/btf/vmlinux")
MAGIC = 0xEB9F
KIND_STRUCT, KIND_UNION = 4, 5
# Bytes that follow struct btf_type, per kind: fixed, and per vlen item.
_TAIL = {1: (4, 0), 3: (12, 0), 4: (0, 12), 5: (0, 12), 6: (0, 8), 13: (0, 8), 14: (4, 0)}
_TAIL |= {15: (0, 12), 17: (4, 0), 19: (0, 12)}
_MODIFIERS = frozenset({8, 9, 10, 11, 18})  # typedef, volatile, const, restrict, type tag


@dataclass(frozen=True)
class Member:
    name: str
    type_id: int
    bit_offset: int
    bitfield: bool


class Btf:
    """The structs and unions of one BTF blob, by name."""

    def __init__(self, blob: bytes) -> None:
        magic, _version, _flags, hdr_len = struct.unpack_from("<HBBI", blob, 0)
        if magic != MAGIC:
            raise ValueError("not BTF (or not little-endian)")
        type_off, type_len, str_off, str_len = struct.unpack_from("<IIII", blob, 8)
        types = blob[hdr_len + type_off : hdr_len + type_off + type_len]
        strings = blob[hdr_len + str_off : hdr_len + str_off + str_len]

        def name(off: int) -> str:
            end = strings.find(b"\0", off)
            return strings[off:end].decode(errors="replace")

        self.kinds: list[int] = [0]  # type id -> kind (id 0 is void)
        self.refs: list[int] = [0]  # type id -> the type a modifier refers to
        self.members: dict[int, list[Member]] = {}
        self.by_name: dict[str, int] = {}
        pos = 0
        while pos + 12 <= len(types):
            name_off, info, size_or_type = struct.unpack_from("<III", types, pos)
            kind, vlen, kflag = (info >> 24) & 0x1F, info & 0xFFFF, info >> 31
            tid = len(self.kinds)
            self.kinds.append(kind)
            self.refs.append(size_or_type)
            pos += 12
            fixed, per = _TAIL.get(kind, (0, 0))
            if kind in (KIND_STRUCT, KIND_UNION):
                out = []
                for i in range(vlen):
                    m_name, m_type, m_off = struct.unpack_from("<III", types, pos + 12 * i)
                    bits = m_off & 0xFFFFFF if kflag else m_off
                    bitfield = bool(kflag and m_off >> 24)
                    out.append(Member(name(m_name), m_type, bits, bitfield))
                self.members[tid] = out
                if name_off:
                    self.by_name.setdefault(name(name_off), tid)
            pos += fixed + per * vlen

    def _resolve(self, tid: int) -> int:
        """Through typedefs and qualifiers to the type itself (bounded: BTF has no cycles
        there, but the blob is not trusted)."""
        for _ in range(32):
            if self.kinds[tid] not in _MODIFIERS:
                break
            tid = self.refs[tid]
        return tid

    def _find(self, tid: int, field: str) -> tuple[int, int] | None:
        """(bit offset, type id) of ``field`` in struct/union ``tid``, through anonymous
        members."""
        for m in self.members.get(tid, []):
            if m.name == field:
                if m.bitfield or m.bit_offset % 8:
                    return None  # not a plain field: not readable as bytes
                return m.bit_offset, m.type_id
            if not m.name:
                inner = self._find(self._resolve(m.type_id), field)
                if inner is not None:
                    return m.bit_offset + inner[0], inner[1]
        return None

    def offset(self, struct_name: str, path: str) -> int:
        """The byte offset of ``path`` ("__sk_common.skc_num") in ``struct struct_name``."""
        tid = self.by_name.get(struct_name)
        if tid is None:
            raise KeyError(struct_name)
        bits = 0
        for part in path.split("."):
            found = self._find(self._resolve(tid), part)
            if found is None:
                raise KeyError(f"{struct_name}.{path}")
            bits += found[0]
            tid = found[1]
        return bits // 8


# The members the fd walk reads (bpf/io.bpf.c fd_tcp_port): -D name, struct, member path.
FD_WALK = (
    ("OFF_TASK_FILES", "task_struct", "files"),
    ("OFF_FILES_FDT", "files_struct", "fdt"),
    ("OFF_FDT_MAX_FDS", "fdtable", "max_fds"),
    ("OFF_FDT_FD", "fdtable", "fd"),
    ("OFF_FILE_INODE", "file", "f_inode"),
    ("OFF_FILE_PRIVATE", "file", "private_data"),
    ("OFF_INODE_MODE", "inode", "i_mode"),
    ("OFF_INODE_INO", "inode", "i_ino"),
    ("OFF_SOCKET_SK", "socket", "sk"),
    ("OFF_SK_FAMILY", "sock", "__sk_common.skc_family"),
    ("OFF_SK_NUM", "sock", "__sk_common.skc_num"),
    ("OFF_SK_PROTOCOL", "sock", "sk_protocol"),
)


def fd_walk_flags(path: Path = VMLINUX_BTF) -> list[str]:
    """-D flags with the offsets of FD_WALK for the running kernel, and -DHAVE_FD_WALK; none
    when its BTF is missing or lacks one of them (the probe then names fds as before)."""
    try:
        btf = Btf(path.read_bytes())
        offsets = [(flag, btf.offset(s, m)) for flag, s, m in FD_WALK]
    except (OSError, ValueError, KeyError, IndexError, struct.error):
        return []
    return ["-DHAVE_FD_WALK", *(f"-D{flag}={off}" for flag, off in offsets)]
