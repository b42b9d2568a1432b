"""Offsets of kernel struct members, from the running kernel's own BTF.

The read and write probes walk a few kernel structs (a task's fd table to the file, its
inode and file system, a socket's family, protocol and local port); their layout changes between kernel versions and configurations, and the
kernel headers installed for bcc may belong to another kernel than the one running. The
BTF the kernel exports (/sys/kernel/btf/vmlinux) describes the running kernel exactly, so
the offsets come from there, or the walk is not compiled in.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping

VMLINUX_BTF = "/sys/kernel/btf/vmlinux"
BTF_MAX_BYTES = 64 << 20  # vmlinux BTF is a few MB; a larger file is not one
_MAGIC = 0xEB9F
# BTF kinds (include/uapi/linux/btf.h) and the bytes each adds after its 12-byte head.
_INT, _PTR, _ARRAY, _STRUCT, _UNION, _ENUM = 1, 2, 3, 4, 5, 6
_TYPEDEF, _VOLATILE, _CONST, _RESTRICT = 8, 9, 10, 11
_FUNC_PROTO, _VAR, _DATASEC, _DECL_TAG, _TYPE_TAG, _ENUM64 = 13, 14, 15, 17, 18, 19
_QUALIFIERS = {_TYPEDEF, _VOLATILE, _CONST, _RESTRICT, _TYPE_TAG}


# Bytes each kind adds after its 12-byte head: a fixed part, and a part per member (vlen).
_FIXED = {_INT: 4, _VAR: 4, _DECL_TAG: 4, _ARRAY: 12}
_PER_MEMBER = {_STRUCT: 12, _UNION: 12, _DATASEC: 12, _ENUM64: 12, _ENUM: 8, _FUNC_PROTO: 8}
_HEAD = struct.Struct("<3I")


class Btf:
    """The types of one BTF blob: struct and union members by name, in bytes."""

    def __init__(self, data: bytes) -> None:
        magic, _version, _flags, hdr_len = struct.unpack_from("<HBBI", data, 0)
        if magic != _MAGIC:
            raise ValueError("not BTF")
        type_off, type_len, str_off, str_len = struct.unpack_from("<4I", data, 8)
        self._data = data
        self._strings = hdr_len + str_off
        self._str_end = self._strings + str_len
        # Where each type's head is, by id (id 0 is void), and the named structs by their
        # name's offset in the strings, as far as the walk has gone: types are walked only
        # up to the last one asked for (the kernel's have ~130,000, the fd walk's within
        # the first few thousand), and no name is read on the way.
        self._at: list[int] = [0]
        self._structs: dict[int, int] = {}
        self._pos, self._end = hdr_len + type_off, hdr_len + type_off + type_len

    def _walk(self, until_id: int | None = None, until_name: int | None = None) -> None:
        """Walk on until type ``until_id`` or a struct named at ``until_name`` is known."""
        data, head, fixed, per, at = self._data, _HEAD.unpack_from, _FIXED, _PER_MEMBER, self._at
        pos, end, structs = self._pos, self._end, self._structs
        while pos + 12 <= end:
            if until_id is not None and len(at) > until_id:
                break
            name_off, info, _ = head(data, pos)
            kind = (info >> 24) & 0x1F
            at.append(pos)
            pos += 12 + fixed.get(kind, 0) + per.get(kind, 0) * (info & 0xFFFF)
            if kind == _STRUCT and name_off and name_off not in structs:
                structs[name_off] = len(at) - 1
                if name_off == until_name:
                    break
        self._pos = pos

    def _type(self, type_id: int) -> tuple[int, int, int, int]:
        """(kind, vlen, size or type, where its members start) of a type."""
        if type_id >= len(self._at):
            self._walk(until_id=type_id)
        pos = self._at[type_id] if 0 < type_id < len(self._at) else 0
        if not pos:
            return (0, 0, 0, 0)
        _name, info, size_or_type = _HEAD.unpack_from(self._data, pos)
        return ((info >> 24) & 0x1F, info & 0xFFFF, size_or_type, pos + 12)

    def _name(self, off: int) -> str:
        start = self._strings + off
        stop = self._data.find(b"\0", start, self._str_end)
        return self._data[start:stop].decode(errors="replace")

    def _struct_id(self, name: str) -> int | None:
        """The first struct named ``name``: its name looked up in the strings, not each
        struct's name read."""
        want = b"\0" + name.encode() + b"\0"
        at = self._data.find(want, self._strings, self._str_end)
        if at < 0:
            return None
        name_off = at + 1 - self._strings  # BTF keeps each string once
        if name_off not in self._structs:
            self._walk(until_name=name_off)
        return self._structs.get(name_off)

    def _resolve(self, type_id: int) -> int:
        """The type behind typedefs and qualifiers."""
        for _ in range(16):
            kind, _vlen, target, _ = self._type(type_id)
            if kind not in _QUALIFIERS:
                return type_id
            type_id = target
        return type_id

    def member_offset(self, struct_name: str, member: str) -> int | None:
        """Byte offset of ``member`` in ``struct struct_name``, looking into anonymous
        structs and unions, and along a dotted path through named ones
        ("__sk_common.skc_num"); None where either is unknown or the member is a bit field."""
        type_id = self._struct_id(struct_name)
        total = 0
        for name in member.split("."):
            if type_id is None:
                return None
            found = self._find(self._resolve(type_id), name, 0)
            if found is None:
                return None
            off, type_id = found
            total += off
        return total

    def _find(self, type_id: int, member: str, depth: int) -> tuple[int, int] | None:
        """(byte offset, type id) of ``member`` in a struct or union."""
        kind, vlen, _size, at = self._type(type_id)
        if kind not in (_STRUCT, _UNION) or depth > 8:
            return None
        kind_flag = (self._data[at - 12 + 7] >> 7) & 1
        for i in range(vlen):
            name_off, mtype, moff = _HEAD.unpack_from(self._data, at + 12 * i)
            bits = moff & 0xFFFFFF if kind_flag else moff
            if name_off and self._name(name_off) == member:
                return (bits // 8, mtype) if bits % 8 == 0 else None
            if not name_off:  # an anonymous struct or union: its members are this one's
                inner = self._find(self._resolve(mtype), member, depth + 1)
                if inner is not None:
                    return bits // 8 + inner[0], inner[1]
        return None


def member_offsets(
    wanted: Iterable[tuple[str, str]], path: str = VMLINUX_BTF
) -> Mapping[tuple[str, str], int] | None:
    """(struct, member) -> byte offset for each of ``wanted`` in the running kernel; None
    where the kernel exports no BTF or one of them is not found."""
    try:
        with open(path, "rb") as f:
            data = f.read(BTF_MAX_BYTES + 1)
        if len(data) > BTF_MAX_BYTES:
            return None
        btf = Btf(data)
    except (OSError, ValueError, struct.error):
        return None
    out = {}
    for name, member in wanted:
        try:
            off = btf.member_offset(name, member)
        except (IndexError, struct.error):  # a member's type id or name outside the blob
            off = None
        if off is None:
            return None
        out[(name, member)] = off
    return out


# The members the probes' fd walk reads (bpf/io.bpf.c), as -D names of their byte offsets.
FD_WALK = {
    "HW_OFF_TASK_FILES": ("task_struct", "files"),
    "HW_OFF_FILES_FDT": ("files_struct", "fdt"),
    "HW_OFF_FDT_MAX_FDS": ("fdtable", "max_fds"),
    "HW_OFF_FDT_FD": ("fdtable", "fd"),
    "HW_OFF_FILE_INODE": ("file", "f_inode"),
    "HW_OFF_FILE_PRIVATE": ("file", "private_data"),
    "HW_OFF_INODE_MODE": ("inode", "i_mode"),
    "HW_OFF_INODE_INO": ("inode", "i_ino"),
    "HW_OFF_INODE_SB": ("inode", "i_sb"),
    "HW_OFF_SB_MAGIC": ("super_block", "s_magic"),
    "HW_OFF_SOCKET_SK": ("socket", "sk"),
    "HW_OFF_SK_FAMILY": ("sock", "__sk_common.skc_family"),
    "HW_OFF_SK_NUM": ("sock", "__sk_common.skc_num"),
    "HW_OFF_SK_PROTOCOL": ("sock", "sk_protocol"),
}


def fd_walk_flags(btf_path: str = VMLINUX_BTF) -> list[str]:
    """-DHAVE_FD_WALK and the byte offsets of FD_WALK in the running kernel, or nothing where
    its BTF does not give them all (the probes then leave the walk out: no reads of files
    are counted, and written fds are named by user space only)."""
    found = member_offsets(FD_WALK.values(), btf_path)
    if found is None:
        return []
    return ["-DHAVE_FD_WALK", *(f"-D{name}={found[member]}" for name, member in FD_WALK.items())]
