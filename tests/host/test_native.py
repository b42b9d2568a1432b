"""agent/sources/symbols.py against real processes: a target's objects read inside its root, a
target that changed while read, a symbol table over the cap, and a real deadlock:
tests/realsw/serving/abba.c (built here), two threads each holding one pthread mutex of a
shared library and waiting in futex(2) for the other's. No root and no BPF needed: a parent
may read its child's /proc/PID/mem and syscall files. The pure parts are in
tests/test_native.py."""

from __future__ import annotations

import json
import os
import platform
import select
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from elftools.elf.elffile import ELFFile

from agent.sources import symbols as symbols_mod
from agent.sources.procfs import MemMap, ProcFS
from agent.sources.symbols import (
    caller_outside_libc,
    describe_address,
)
from agent.syscalls import SYS_FUTEX
from tests.realsw.serving.native import build_abba

needs_linux_x86_64 = pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.machine() != "x86_64",
    reason="reads x86-64 code and syscall lines from Linux /proc",
)


# --- unreadable targets --------------------------------------------------------------------


def _tree_with_an_object(tmp_path: Path, place: Callable[[Path], None]) -> tuple[ProcFS, int]:
    """A process 42 (our own credentials) with no map_files, whose maps name /opt/libx.so at
    0x7f0000000000; ``place`` puts something at that name in its root. Returns the tree and
    the address of ``malloc`` if libx.so were the C library."""
    libc = Path("/usr/lib/x86_64-linux-gnu/libc.so.6")
    with open(libc, "rb") as f:
        dynsym = ELFFile(f).get_section_by_name(".dynsym")
        assert dynsym is not None
        malloc = next(s["st_value"] for s in dynsym.iter_symbols() if s.name == "malloc")
    size = libc.stat().st_size
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "status").write_text(Path("/proc/self/status").read_text())
    (tmp_path / "42" / "stat").write_text(Path("/proc/self/stat").read_text())
    (tmp_path / "42" / "maps").write_text(
        f"7f0000000000-{0x7F0000000000 + size:x} r-xp 00000000 fe:00 7 /opt/libx.so\n"
    )
    (tmp_path / "42" / "root" / "opt").mkdir(parents=True)
    place(tmp_path / "42" / "root" / "opt" / "libx.so")
    return ProcFS(str(tmp_path)), 0x7F0000000000 + malloc


@pytest.mark.skipif(
    not Path("/usr/lib/x86_64-linux-gnu/libc.so.6").exists(), reason="needs x86-64 glibc"
)
def test_an_object_is_read_inside_the_targets_root(tmp_path: Path) -> None:
    """Without map_files, the maps' path is opened inside the target's root: a copy of libc
    there is read (its symbols name the address), an absolute symlink to the agent's own libc
    leads nowhere (it resolves inside the target's root, where /usr/lib has nothing)."""
    libc = Path("/usr/lib/x86_64-linux-gnu/libc.so.6")
    inside = tmp_path / "inside"
    inside.mkdir()
    proc, addr = _tree_with_an_object(inside, lambda p: p.write_bytes(libc.read_bytes()))
    named = describe_address(42, addr, proc) or ""
    assert named.endswith(f"` in libx.so+0x{addr - 0x7F0000000000:x}") and "malloc" in named
    escape = tmp_path / "escape"
    escape.mkdir()
    proc, addr = _tree_with_an_object(escape, lambda p: p.symlink_to(libc))
    assert describe_address(42, addr, proc) == f"libx.so+0x{addr - 0x7F0000000000:x}"


@pytest.mark.skipif(
    not Path("/usr/lib/x86_64-linux-gnu/libc.so.6").exists(), reason="needs x86-64 glibc"
)
def test_an_object_read_for_a_target_that_changed_names_nothing(tmp_path: Path) -> None:
    """The target is fixed before its maps are read: a process that is another one by the
    time its object was read (a reused PID; an exec shows the same) gets no answer at all,
    neither the name nor the maps' word for it."""
    libc = Path("/usr/lib/x86_64-linux-gnu/libc.so.6")
    proc, addr = _tree_with_an_object(tmp_path, lambda p: p.write_bytes(libc.read_bytes()))
    assert "malloc" in (describe_address(42, addr, proc) or "")  # the same process: named
    stat = tmp_path / "42" / "stat"
    text = stat.read_text()
    head, _, tail = text.rpartition(")")
    fields = tail.split()
    fields[19] = str(int(fields[19]) + 1)

    class Reused(ProcFS):
        def maps(self, pid: int | str) -> list[MemMap]:
            got = super().maps(pid)
            stat.write_text(f"{head}) {' '.join(fields)}\n")  # now another process
            return got

    assert describe_address(42, addr, Reused(str(tmp_path))) is None


@pytest.mark.skipif(
    not Path("/usr/lib/x86_64-linux-gnu/libc.so.6").exists(), reason="needs x86-64 glibc"
)
def test_symbol_tables_over_the_cap_are_not_read(tmp_path: Path, monkeypatch) -> None:
    libc = Path("/usr/lib/x86_64-linux-gnu/libc.so.6")
    proc, addr = _tree_with_an_object(tmp_path, lambda p: p.write_bytes(libc.read_bytes()))
    monkeypatch.setattr(symbols_mod, "MAX_SYMTAB_BYTES", 1024)  # libc's .dynsym is larger
    symbols_mod._CACHE.clear()
    said = describe_address(42, addr, proc)
    assert said == f"libx.so+0x{addr - 0x7F0000000000:x} ({symbols_mod.CAPPED})"
    symbols_mod._CACHE.clear()


# --- a real deadlock -----------------------------------------------------------------------


CHILD = r"""
import ctypes, json, mmap, sys, threading, time

lib = ctypes.CDLL(sys.argv[1])
assert lib.abba_init() == 0
libc = ctypes.CDLL(None)
private = mmap.mmap(-1, 1 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
private[0] = 1  # touched: a real page
tids = {}

def run(name):
    tids[name] = threading.get_native_id()
    getattr(lib, name)()  # ctypes releases the GIL: the thread waits in C

threads = [threading.Thread(target=run, args=(n,)) for n in ("abba_ab", "abba_ba")]
for t in threads:
    t.start()
while len(tids) < 2:
    time.sleep(0.001)

def addr(name, where=lib):
    return ctypes.addressof(ctypes.c_int.in_dll(where, name))

print(json.dumps({
    "abba_a": addr("abba_a"),
    "abba_b": addr("abba_b"),
    "optarg": addr("optarg", libc),
    "function": ctypes.cast(lib.abba_ab, ctypes.c_void_p).value,
    "private": ctypes.addressof(ctypes.c_char.from_buffer(private)),
    "tids": tids,
}), flush=True)
for t in threads:
    t.join()
"""


def wait_asleep_in_futex(proc: ProcFS, pid: int, tid: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stat, line = proc.thread_stat(pid, tid), proc.thread_syscall(pid, tid)
        if stat is not None and stat.state == "S" and line is not None and line.nr == SYS_FUTEX:
            return
        time.sleep(0.01)
    raise AssertionError(f"thread {tid} of {pid} is not asleep in futex after {timeout} s")


def tracer_pid(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("TracerPid:"):
            return int(line.split()[1])
    raise AssertionError("no TracerPid line")


@pytest.fixture(scope="module")
def abba_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_abba(tmp_path_factory.mktemp("abba"))


@pytest.fixture(scope="module")
def deadlocked(abba_lib: Path) -> Iterator[tuple[int, dict]]:
    """(pid, what the child printed) once both locker threads sleep in futex."""
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(abba_lib)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        ready, _, _ = select.select([child.stdout], [], [], 30)
        assert ready, "the child printed nothing in 30 s"
        info = json.loads(child.stdout.readline())
        proc = ProcFS()
        for tid in info["tids"].values():
            wait_asleep_in_futex(proc, child.pid, tid)
        wait_asleep_in_futex(proc, child.pid, child.pid)  # the main thread, in join
        yield child.pid, info
    finally:
        child.kill()
        child.wait()


def symbols(lib: Path) -> dict[str, tuple[int, int]]:
    """name -> (st_value, st_size) from libabba.so's .symtab: the answer, read independently."""
    with open(lib, "rb") as f:
        table = ELFFile(f).get_section_by_name(".symtab")
        assert table is not None
        return {s.name: (s["st_value"], s["st_size"]) for s in table.iter_symbols()}


@needs_linux_x86_64
def test_lock_words_are_named_by_their_symbols(
    deadlocked: tuple[int, dict], abba_lib: Path
) -> None:
    pid, info = deadlocked
    proc = ProcFS()
    syms = symbols(abba_lib)  # the library's first segment is at vaddr 0: offset = st_value
    for name in ("abba_a", "abba_b"):  # .bss: PTHREAD_MUTEX_INITIALIZER is all zeros
        assert (
            describe_address(pid, info[name], proc) == f"`{name}` in libabba.so+0x{syms[name][0]:x}"
        )
    inside = describe_address(pid, info["abba_a"] + 4, proc)  # a word inside: the same symbol
    assert inside == f"`abba_a` in libabba.so+0x{syms['abba_a'][0] + 4:x}"
    function = describe_address(pid, info["function"], proc)
    assert function == f"`abba_ab` in libabba.so+0x{syms['abba_ab'][0]:x}"
    # The futex word each locker sleeps on is the other's mutex (its first word, __lock).
    for name, other in (("abba_ab", "abba_b"), ("abba_ba", "abba_a")):
        line = proc.thread_syscall(pid, info["tids"][name])
        assert line is not None and line.args[0] == info[other]
        assert f"`{other}` in libabba.so" in (describe_address(pid, line.args[0], proc) or "")
    assert tracer_pid(pid) == 0


@needs_linux_x86_64
def test_libc_bss_and_memory_kinds(deadlocked: tuple[int, dict]) -> None:
    pid, info = deadlocked
    proc = ProcFS()
    maps = proc.maps(pid)
    optarg = describe_address(pid, info["optarg"], proc)  # from .dynsym: libc has no .symtab
    assert optarg is not None and optarg.startswith("`optarg` in libc.so")
    heap = next(m for m in maps if m.path == "[heap]")
    assert describe_address(pid, (heap.start + heap.end) // 2, proc) == "the heap"
    assert describe_address(pid, info["private"], proc) == "anonymous memory"
    for tid in [pid, *info["tids"].values()]:  # [stack], and glibc's mmapped thread stacks
        line = proc.thread_syscall(pid, tid)
        assert line is not None and line.sp is not None
        assert describe_address(pid, line.sp, proc) == "a thread stack"
    assert describe_address(pid, 8, proc) is None  # nothing mapped there
    assert tracer_pid(pid) == 0


@needs_linux_x86_64
def test_callers_outside_libc(deadlocked: tuple[int, dict], abba_lib: Path) -> None:
    pid, info = deadlocked
    syms = symbols(abba_lib)
    proc = ProcFS()
    for name, tid in info["tids"].items():
        frame = caller_outside_libc(pid, tid, proc)
        assert frame is not None, f"no native caller for {name}"
        assert frame.object == "libabba.so"
        # lock_both is static; gcc -O1 inlines it into both callers, -O0 keeps it
        assert frame.symbol in (name, "lock_both"), frame
        start, size = syms[frame.symbol]
        assert start < frame.offset <= start + size  # a return address inside the caller
        assert str(frame) == f"`{frame.symbol}` in libabba.so+0x{frame.offset:x}"
        wait_asleep_in_futex(proc, pid, tid, timeout=0.1)  # still asleep: nothing woke it
    main = caller_outside_libc(pid, pid, proc)  # in join: CPython's lock code called futex
    assert main is not None, "no native caller for the main thread"
    interpreter = os.path.basename(os.path.realpath(sys.executable))
    assert main.object == interpreter or main.object.startswith("libpython"), main
    assert tracer_pid(pid) == 0
