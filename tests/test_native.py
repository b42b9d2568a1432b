"""agent/sources/symbols.py: what a lock word is and which native code a blocked thread came from.

The pure parts (call-instruction checks, symbol ranges, ELF address arithmetic) are checked on
synthetic input; the rest, on real processes and a real deadlock, in tests/host/test_native.py.
"""

from __future__ import annotations

import os
from array import array
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.analysis import evidence as ev
from agent.analysis.lockwords import name_words
from agent.model import PID_MAX_LIMIT
from agent.report.sentences import render
from agent.sources.procfs import MemMap, ProcFS
from agent.sources.symbols import (
    Load,
    NativeFrame,
    SymbolTable,
    after_call,
    caller_outside_libc,
    describe_address,
    direct_call_target,
    elf_vaddr,
    indirect_call_before,
    short_name,
)

# --- call instructions just before a return address ---------------------------------------

RET = 0x7F00_0000_2000


def test_direct_call_target() -> None:
    # call rel32 = -0x100: e8 00 ff ff ff
    assert direct_call_target(b"\x90\x90\x90\xe8\x00\xff\xff\xff", RET) == RET - 0x100
    assert direct_call_target(b"\xe8\x10\x00\x00\x00", RET) == RET + 0x10
    assert direct_call_target(b"\x90\xe8\x00\x00\x00\x00\x90", RET) is None  # E8 not at ret-5
    assert direct_call_target(b"\x00\x00\x00", RET) is None  # too short to hold one


@pytest.mark.parametrize(
    "code",
    [
        b"\xff\xd0",  # call *%rax
        b"\x41\xff\xd3",  # call *%r11 (REX.B)
        b"\xff\x10",  # call *(%rax)
        b"\xff\x50\x08",  # call *0x8(%rax)
        b"\xff\x14\x24",  # call *(%rsp) (SIB)
        b"\xff\x54\x24\x08",  # call *0x8(%rsp) (SIB + disp8)
        b"\xff\x15\x00\x10\x00\x00",  # call *0x1000(%rip)
        b"\xff\x90\x00\x01\x00\x00",  # call *0x100(%rax)
        b"\xff\x14\x25\x00\x10\x00\x00",  # call *0x1000 (SIB, no base: disp32)
        b"\xff\x94\x24\x00\x01\x00\x00",  # call *0x100(%rsp) (SIB + disp32)
    ],
)
def test_indirect_calls_are_recognised(code: bytes) -> None:
    assert indirect_call_before(b"\x90" * 8 + code)
    assert after_call(b"\x90" * 8 + code, RET, lambda target: False)


@pytest.mark.parametrize(
    "code",
    [
        b"\xff\xe0",  # jmp *%rax: FF /4
        b"\xff\xf0",  # push %rax: FF /6
        b"\xff\x18",  # lcall *(%rax): FF /3, a far call
        b"\xff\x15\x00\x10",  # FF 15 wants a disp32: 6 bytes, not 4
        b"\xff\x50",  # FF 50 wants a disp8: 3 bytes, not 2
        b"\x48\x89\xc7\x90",  # mov %rax,%rdi; nop
        b"",
    ],
)
def test_other_bytes_are_not_calls(code: bytes) -> None:
    before = b"\x90" * 8 + code
    assert not indirect_call_before(before)
    assert not after_call(before, RET, lambda target: True)


def test_a_direct_call_counts_only_into_code() -> None:
    before = b"\x90\x90\x90\xe8\x00\xff\xff\xff"
    assert after_call(before, RET, lambda target: target == RET - 0x100)
    assert not after_call(before, RET, lambda target: False)  # a word that only looks like one


# --- symbol ranges ------------------------------------------------------------------------


def test_symbol_table_finds_the_range_that_covers_an_address() -> None:
    table = SymbolTable(
        [
            (0x2000, 0x100, "outer"),
            (0x1010, 0x20, "g"),
            (0x1000, 0x10, "f"),
            (0x2010, 0x10, "inner"),
            (0x3000, 0, "empty"),  # covers nothing
            (0x4000, 8, "wide"),
            (0x4000, 4, "narrow"),  # an alias of a prefix: the narrower one answers
        ]
    )
    assert len(table) == 6
    assert [table.find(a) for a in (0x1000, 0x100F, 0x1010, 0x102F)] == ["f", "f", "g", "g"]
    assert table.find(0xFFF) is None
    assert table.find(0x1030) is None  # past g's end: in no symbol, however near
    assert table.find(0x2010) == "inner"
    assert table.find(0x2020) == "outer"  # past inner, still inside outer
    assert table.find(0x20FF) == "outer" and table.find(0x2100) is None
    assert table.find(0x3000) is None
    assert table.find(0x4002) == "narrow" and table.find(0x4006) == "wide"
    assert SymbolTable[str]([]).find(0x1000) is None


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 64), st.integers(0, 16)), max_size=40), st.integers(0, 90))
def test_a_table_built_from_arrays_answers_as_one_built_from_rows(ranges, addr) -> None:
    """The arrays a symbol table is parsed into, sorted by start alone: the same innermost
    symbol for every address as the rows sorted by start and end (or, for two symbols with
    the same range, an alias: either is the answer)."""
    rows = [(s, n, i) for i, (s, n) in enumerate(ranges)]
    kept = [(s, n, i) for s, n, i in rows if n > 0]
    from_arrays = SymbolTable.of_arrays(
        array("Q", (s for s, _, _ in kept)),
        array("Q", (s + n for s, n, _ in kept)),
        array("I", (i for _, _, i in kept)),
    )
    from_rows = SymbolTable(rows)
    assert list(from_arrays.starts) == list(from_rows.starts)
    got, want = from_arrays.find(addr), from_rows.find(addr)
    if want is None or got is None:
        assert got == want
    else:
        assert ranges[got][0] == ranges[want][0] and ranges[got][1] == ranges[want][1]


# --- ELF virtual addresses from a mapping ------------------------------------------------

B = 0x7F12_3400_0000
# libabba.so's program headers (gcc -O1 -shared -fPIC, binutils 2.40) and its five mappings
ABBA_LOADS = (
    Load(0x0, 0x660, 0x0, 0x660),
    Load(0x1000, 0x1F9, 0x1000, 0x1F9),
    Load(0x2000, 0xFC, 0x2000, 0xFC),
    Load(0x2DE8, 0x240, 0x3DE8, 0x318),  # .data, then .bss up to 0x4100
)


def mapping(start: int, end: int, perms: str, offset: int, path: str = "/lib/x.so") -> MemMap:
    return MemMap(B + start, B + end, perms, offset, "fe:00", 7 if path else 0, path)


def test_elf_vaddr_of_text_data_and_bss_in_the_file_mapping() -> None:
    text = mapping(0x1000, 0x2000, "r-xp", 0x1000)
    data = mapping(0x4000, 0x5000, "rw-p", 0x3000)
    assert elf_vaddr(ABBA_LOADS, text, B + 0x1158) == 0x1158
    assert elf_vaddr(ABBA_LOADS, data, B + 0x4020) == 0x4020  # .data: file bytes
    assert elf_vaddr(ABBA_LOADS, data, B + 0x40A0) == 0x40A0  # .bss: past p_filesz
    assert elf_vaddr(ABBA_LOADS, data, B + 0x4100) is None  # past p_memsz: page padding


# libc.so.6 (Debian 12): .bss runs two pages into the anonymous mapping after its file's
LIBC_LOADS = (
    Load(0x0, 0x25388, 0x0, 0x25388),
    Load(0x26000, 0x1550FC, 0x26000, 0x1550FC),
    Load(0x17C000, 0x52C31, 0x17C000, 0x52C31),
    Load(0x1CF8D0, 0x4F98, 0x1CF8D0, 0x12680),
)


def test_elf_vaddr_of_bss_in_the_anonymous_mapping_after_the_file() -> None:
    last = mapping(0x1D3000, 0x1D5000, "rw-p", 0x1D3000)
    assert elf_vaddr(LIBC_LOADS, last, B + 0x1D4760) == 0x1D4760  # in the file mapping
    assert elf_vaddr(LIBC_LOADS, last, B + 0x1DB280) == 0x1DB280  # optarg, anonymous memory
    assert elf_vaddr(LIBC_LOADS, last, B + 0x1E1F50) is None  # past p_memsz


# --- unreadable targets --------------------------------------------------------------------


def test_an_unreadable_pid_gives_none(tmp_path: Path) -> None:
    gone = PID_MAX_LIMIT + 1  # no process can have it
    assert describe_address(gone, 0x1000, ProcFS()) is None
    assert caller_outside_libc(gone, gone, ProcFS()) is None
    empty = ProcFS(str(tmp_path))
    assert describe_address(os.getpid(), id(empty), empty) is None
    assert caller_outside_libc(os.getpid(), os.getpid(), empty) is None


def test_a_tree_without_memory_gives_none(tmp_path: Path) -> None:
    """maps and syscall lines that name code, but no mem file and a malformed object: what can
    be told from maps, else None, quietly."""
    task = tmp_path / "42" / "task" / "42"
    task.mkdir(parents=True)
    (tmp_path / "42" / "maps").write_text(
        "7f0000000000-7f0000001000 r-xp 00001000 fe:00 7 /opt/libx.so\n"
        "7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0 [stack]\n"
    )
    (task / "syscall").write_text("202 0x1 0x80 0x0 0x0 0x0 0x0 0x7ffd00010000 0x7f0000000010\n")
    # The object, read through the target's root: ELF magic, then garbage (a malformed file)
    (tmp_path / "42" / "root" / "opt").mkdir(parents=True)
    (tmp_path / "42" / "root" / "opt" / "libx.so").write_bytes(b"\x7fELF" + bytes(range(256)) * 4)
    proc = ProcFS(str(tmp_path))
    assert caller_outside_libc(42, 42, proc) is None
    assert describe_address(42, 0x7F0000000010, proc) == "libx.so+0x10"  # named from maps
    assert describe_address(42, 0x7FFD00000100, proc) == "a thread stack"
    assert describe_address(42, 0x1000, proc) is None


# --- native frames and lock words named --------------------------------------------------


def test_native_frame_str() -> None:
    assert str(NativeFrame("libabba.so", 0x11A9, "abba_ab", 0x7F00_0000_11A9)) == (
        "`abba_ab` in libabba.so+0x11a9"
    )
    assert str(NativeFrame("libabba.so", 0x11A9, None, 0x7F00_0000_11A9)) == "libabba.so+0x11a9"


def test_shared_anonymous_memory_is_not_a_file(tmp_path: Path) -> None:
    """MAP_SHARED|MAP_ANONYMOUS shows in maps as '/dev/zero (deleted)' with an inode."""
    (tmp_path / "9").mkdir()
    (tmp_path / "9" / "maps").write_text(
        "7f0000000000-7f0000100000 rw-s 00000000 00:01 1234 /dev/zero (deleted)\n"
    )
    assert describe_address(9, 0x7F0000000100, ProcFS(str(tmp_path))) == "shared anonymous memory"


def test_name_words_names_each_link_of_a_cycle_once_per_word() -> None:
    asked: list[tuple[int, int]] = []

    def describe(pid: int, uaddr: int) -> str | None:
        asked.append((pid, uaddr))
        return {0xA0: "`abba_a` in libabba.so+0x40a0"}.get(uaddr)

    links = (
        ev.CycleLink(11, "k0", "mutex", 0xB0, 12),
        ev.CycleLink(12, "k1", "mutex", 0xA0, 11),
        ev.CycleLink(13, "k2", "mutex", 0xA0, 11),
    )
    other = ev.CpuWork(1, 0.5, 5.0)
    named = name_words([ev.LockCycle(links), other], {11: 7, 12: 7, 13: 7}.get, describe)
    assert named[1] is other
    cycle = named[0]
    assert isinstance(cycle, ev.LockCycle)
    abba_a = "`abba_a` in libabba.so+0x40a0"
    assert [x.word for x in cycle.links] == [None, abba_a, abba_a]
    assert sorted(asked) == [(7, 0xA0), (7, 0xB0)]  # one look per word of a process
    assert "0xa0 (`abba_a` in libabba.so+0x40a0)" in render(cycle)


def test_name_words_leaves_a_thread_of_no_known_process_unnamed() -> None:
    link = ev.CycleLink(99, "x", "mutex", 0xA0, 98)
    (cycle,) = name_words([ev.LockCycle((link,))], {}.get, lambda pid, a: "never asked")
    assert isinstance(cycle, ev.LockCycle)
    assert cycle.links[0].word is None


@pytest.mark.parametrize(
    ("symbol", "shown"),
    [
        ("abba_ab", "abba_ab"),  # C: as it is
        (
            "_ZNSt18condition_variable4waitERSt11unique_lockISt5mutexE",
            "std::condition_variable::wait",
        ),
        (
            "_ZN4gloo9transport3tcp13UnboundBuffer8waitRecvEPiNSt6chrono8durationIlSt5ratioILl1ELl1000EEEE",
            "gloo::transport::tcp::UnboundBuffer::waitRecv",
        ),
        ("_ZNK3c1010TensorImpl4sizeEv", "c10::TensorImpl::size"),
        ("_ZN3fooclEv", "foo::operator()"),  # the call operator keeps its parentheses
        ("_Znotvalid", "_Znotvalid"),  # not a valid mangling: as it is
    ],
)
def test_cxx_names_are_demangled_without_their_parameters(symbol: str, shown: str) -> None:
    assert short_name(symbol) == shown


def test_a_long_name_is_cut() -> None:
    long = "_ZN" + "".join(f"{len(p)}{p}" for p in ["namespace" + str(i) for i in range(20)]) + "Ev"
    assert len(short_name(long)) == 120 and short_name(long).endswith("…")
