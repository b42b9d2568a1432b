"""The BTF reader that gives the read probe its kernel offsets: members found by name, in
anonymous structs and unions too, and no offset at all where anything is missing."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.sources.btf import FD_WALK, VMLINUX_BTF, fd_walk_flags, member_offsets

_STRUCT, _UNION, _INT, _TYPEDEF = 4, 5, 1, 8


def _blob(typedef_last: bool = False) -> bytes:
    """struct file { int a; union { int x; int f_inode; }; } in BTF, with ``f_inode`` at
    byte 8 inside an anonymous union reached through a typedef; ``typedef_last``: the
    typedef comes after the struct (read past where the struct was found)."""
    names = b"\0file\0a\0x\0f_inode\0int\0"
    off = {n: names.index(n.encode() + b"\0") for n in ("file", "a", "x", "f_inode", "int")}
    integer = struct.pack("<3I", off["int"], _INT << 24, 4) + struct.pack("<I", 32)  # id 1
    union = struct.pack("<3I", 0, (_UNION << 24) | 2, 8)  # id 2
    union += struct.pack("<3I", off["x"], 1, 0) + struct.pack("<3I", off["f_inode"], 1, 0)
    typedef = struct.pack("<3I", 0, _TYPEDEF << 24, 2)
    typedef_id = 4 if typedef_last else 3

    file = struct.pack("<3I", off["file"], (_STRUCT << 24) | 2, 16)
    file += struct.pack("<3I", off["a"], 1, 0) + struct.pack("<3I", 0, typedef_id, 64)
    types = integer + union + (file + typedef if typedef_last else typedef + file)
    header = struct.pack("<HBBI4I", 0xEB9F, 1, 0, 24, 0, len(types), len(types), len(names))
    return header + types + names


@pytest.mark.parametrize("typedef_last", [False, True])
def test_members_are_found_inside_anonymous_unions(tmp_path: Path, typedef_last: bool) -> None:
    path = tmp_path / "btf"
    path.write_bytes(_blob(typedef_last))
    got = member_offsets([("file", "a"), ("file", "f_inode")], str(path))
    assert got == {("file", "a"): 0, ("file", "f_inode"): 8}


def test_a_missing_member_or_struct_gives_no_offsets(tmp_path: Path) -> None:
    path = tmp_path / "btf"
    path.write_bytes(_blob())
    assert member_offsets([("file", "f_inode"), ("file", "nope")], str(path)) is None
    assert member_offsets([("inode", "i_mode")], str(path)) is None


def test_no_btf_or_not_btf_gives_no_offsets(tmp_path: Path) -> None:
    assert member_offsets([("file", "a")], str(tmp_path / "absent")) is None
    (tmp_path / "junk").write_bytes(b"\0" * 64)
    assert member_offsets([("file", "a")], str(tmp_path / "junk")) is None
    (tmp_path / "cut").write_bytes(_blob()[:40])
    assert member_offsets([("file", "a")], str(tmp_path / "cut")) is None


def _nested_blob() -> bytes:
    """struct common { int pad; int num; }; struct sock { int z; struct common c; }: ``num``
    at byte 4 of ``c``, and ``c`` at byte 8 of ``sock``."""
    names = b"\0common\0pad\0num\0sock\0z\0c\0int\0"
    off = {n: names.index(n.encode() + b"\0") for n in ("common", "pad", "num", "sock", "z", "c")}
    off["int"] = names.index(b"int\0")
    integer = struct.pack("<3I", off["int"], _INT << 24, 4) + struct.pack("<I", 32)  # id 1
    common = struct.pack("<3I", off["common"], (_STRUCT << 24) | 2, 8)  # id 2
    common += struct.pack("<3I", off["pad"], 1, 0) + struct.pack("<3I", off["num"], 1, 32)
    sock = struct.pack("<3I", off["sock"], (_STRUCT << 24) | 2, 16)  # id 3
    sock += struct.pack("<3I", off["z"], 1, 0) + struct.pack("<3I", off["c"], 2, 64)
    types = integer + common + sock
    header = struct.pack("<HBBI4I", 0xEB9F, 1, 0, 24, 0, len(types), len(types), len(names))
    return header + types + names


def test_a_dotted_member_is_followed_through_named_structs(tmp_path: Path) -> None:
    path = tmp_path / "btf"
    path.write_bytes(_nested_blob())
    assert member_offsets([("sock", "c.num"), ("sock", "c")], str(path)) == {
        ("sock", "c.num"): 12,
        ("sock", "c"): 8,
    }
    assert member_offsets([("sock", "num")], str(path)) is None  # not anonymous: not looked in
    assert member_offsets([("sock", "z.num")], str(path)) is None  # an int has no members


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_a_damaged_blob_gives_offsets_or_none_and_never_fails(tmp_path_factory, data) -> None:
    """Bytes flipped or cut anywhere: the reader answers (an offset or None), it never
    raises and never loops (every walk is bounded by the blob and a depth)."""
    blob = bytearray(_nested_blob())
    for _ in range(data.draw(st.integers(0, 6))):
        blob[data.draw(st.integers(0, len(blob) - 1))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(blob)))
    path = tmp_path_factory.mktemp("btf") / "btf"
    path.write_bytes(bytes(blob[:cut]))
    got = member_offsets([("sock", "c.num"), ("common", "pad")], str(path))
    assert got is None or all(isinstance(v, int) for v in got.values())


def test_the_running_kernel_has_every_member_of_the_walk() -> None:
    """Every member the probes' fd walk reads is found in this kernel's BTF (CI's kernel has
    BTF: there a missing one fails, not skips)."""
    if not os.path.exists(VMLINUX_BTF) and not os.environ.get("CI"):
        pytest.skip("this kernel exports no BTF")
    flags = fd_walk_flags()
    assert flags[:1] == ["-DHAVE_FD_WALK"] and len(flags) == 1 + len(FD_WALK), flags
