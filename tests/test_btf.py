"""The fd walk's offsets are read from BTF: members by name, through typedefs and anonymous
unions, never a bitfield (bytes could not be read at its offset)."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from agent.sources.btf import FD_WALK, VMLINUX_BTF, Btf, fd_walk_flags


def blob() -> bytes:
    """BTF of: int (1), struct inner { u16 a; u16 num; } anonymous (2), typedef u16_t (3),
    struct sock_common { u32 x; <anon 2>; } (4), struct sock { u32 pad[2]...; struct
    sock_common __sk_common at 8; u16_t protocol at 16; bitfield flag } (5)."""
    names = b"\0int\0a\0num\0u16_t\0sock_common\0x\0sock\0__sk_common\0protocol\0flag\0"

    def off(s: str) -> int:
        return names.index(s.encode() + b"\0")

    t = b""
    t += struct.pack("<III", off("int"), 1 << 24, 4) + struct.pack("<I", 32)  # 1: INT
    t += struct.pack("<III", 0, 4 << 24 | 2, 4)  # 2: anonymous struct, 2 members
    t += struct.pack("<III", off("a"), 1, 0) + struct.pack("<III", off("num"), 1, 16)
    t += struct.pack("<III", off("u16_t"), 8 << 24, 1)  # 3: typedef -> int
    t += struct.pack("<III", off("sock_common"), 4 << 24 | 2, 8)  # 4
    t += struct.pack("<III", off("x"), 1, 0) + struct.pack("<III", 0, 2, 32)
    t += struct.pack("<III", off("sock"), 1 << 31 | 4 << 24 | 3, 24)  # 5: kflag set
    t += struct.pack("<III", off("__sk_common"), 4, 64)
    t += struct.pack("<III", off("protocol"), 3, 128)
    t += struct.pack("<III", off("flag"), 1, 1 << 24 | 144)  # a 1-bit bitfield
    header = struct.pack("<HBBIIIII", 0xEB9F, 1, 0, 24, 0, len(t), len(t), len(names))
    return header + t + names


def test_members_are_found_by_path_through_anonymous_members() -> None:
    btf = Btf(blob())
    assert btf.offset("sock", "__sk_common.num") == 8 + 4 + 2
    assert btf.offset("sock_common", "x") == 0
    assert btf.offset("sock", "protocol") == 16


def test_a_bitfield_or_a_missing_member_has_no_offset() -> None:
    btf = Btf(blob())
    with pytest.raises(KeyError):
        btf.offset("sock", "flag")
    with pytest.raises(KeyError):
        btf.offset("sock", "nothing")
    with pytest.raises(KeyError):
        btf.offset("no_such_struct", "x")


def test_no_btf_means_no_walk(tmp_path: Path) -> None:
    assert fd_walk_flags(tmp_path / "missing") == []
    bad = tmp_path / "bad"
    bad.write_bytes(b"\0" * 64)
    assert fd_walk_flags(bad) == []
    cut = tmp_path / "cut"
    cut.write_bytes(blob()[:40])  # a truncated blob: no struct found, no walk
    assert fd_walk_flags(cut) == []


@pytest.mark.skipif(not VMLINUX_BTF.exists(), reason="this kernel has no BTF")
def test_the_running_kernel_has_every_member_of_the_walk() -> None:
    flags = fd_walk_flags()
    assert flags[0] == "-DHAVE_FD_WALK" and len(flags) == 1 + len(FD_WALK)
