"""Where a native (C) thread waits, read from /proc without stopping the process.

What a futex word is (``describe_address``: "`abba_a` in libabba.so+0x40a0", "the heap") and
which native code a blocked thread came from (``caller_outside_libc``). Nothing ptrace-attaches
or signals: maps, syscall line and memory are read through /proc, and symbol tables from the
objects' files as the target would open them (agent.sources.confined). Best effort and total:
what cannot be read gives None, never an exception, and every read is bounded.
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import mmap
import os
import stat
import struct
import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from elftools.common.exceptions import ELFError
from elftools.elf.elffile import ELFFile

from . import confined
from .procfs import MemMap, ProcessMemory, ProcFS

T = TypeVar("T")

STACK_SCAN_BYTES = 16 << 10  # of a blocked thread's stack: libc's wait paths are a few frames
MAX_THREADS_SCANNED = 4096  # whose stack pointers are compared with an address
MAX_SYMTAB_BYTES = 48 << 20  # of one symbol table (2M 64-bit entries); a larger one is not read
SYMTAB_CHUNK = 1 << 20  # bytes of a symbol table parsed at a time
MAX_SECTIONS = 4096  # a linked object has tens; more is an object file or a malformed one
MAX_SEGMENTS = 256  # program headers; a linked object has about ten
MAX_NAME_BYTES = 1024  # of one symbol name (C++ names run long; a prefix still names it)
CACHE_OBJECTS = 64  # parsed symbol tables kept: the daemon asks about the same objects
CACHE_SYMBOLS = 4_000_000  # entries kept over all of them (~20 bytes each)
PAGE = mmap.PAGESIZE

STT_OBJECT, STT_FUNC = 1, 2
SHN_UNDEF = 0
# Not "native callers": the wait itself lives there, in every blocked thread alike.
# The C++ runtime too: std::condition_variable::wait and std::mutex live in libstdc++, and
# every C++ wait passes through them (docs/how-it-works.md, "Native frames").
_LIBC_PREFIXES = (
    "libc.so",
    "libc-",
    "libpthread",
    "ld-linux",
    "ld-",
    "ld64.so",
    "libstdc++",
    "libgcc_s",
)
_FAILURES = (OSError, ELFError, ValueError, OverflowError, struct.error, IndexError)


@dataclass(frozen=True)
class NativeFrame:
    """A native frame: ``object`` (a basename) at ``offset`` from its load base."""

    object: str
    offset: int
    symbol: str | None
    address: int

    def __str__(self) -> str:
        where = f"{self.object}+0x{self.offset:x}"
        return f"`{short_name(self.symbol)}` in {where}" if self.symbol else where


MAX_NAME = 120  # characters of a demangled name shown


def short_name(symbol: str) -> str:
    """A C++ symbol demangled, without its parameter list ("gloo::transport::tcp::
    UnboundBuffer::waitRecv"), at most MAX_NAME characters; a C symbol as it is."""
    name = demangle(symbol)
    depth = 0
    for i, ch in enumerate(name):
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth = max(0, depth - 1)
        elif ch == "(" and depth == 0 and i > 0 and not name[:i].endswith("operator"):
            name = name[:i]
            break
    return name if len(name) <= MAX_NAME else name[: MAX_NAME - 1] + "…"


_CXXABI: list[Any] = []  # [__cxa_demangle or None], looked up once


def demangle(symbol: str) -> str:
    """An Itanium C++ name demangled by the C++ runtime's own demangler (abi::__cxa_demangle,
    the one c++filt uses); the name as it is when it is not one or no runtime is found."""
    if not symbol.startswith("_Z"):
        return symbol
    if not _CXXABI:
        try:
            lib = ctypes.CDLL("libstdc++.so.6")
            fn = lib.__cxa_demangle
            fn.restype = ctypes.c_void_p
            fn.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
            _CXXABI.append((fn, ctypes.CDLL(None).free))
        except (OSError, AttributeError):
            _CXXABI.append(None)
    if _CXXABI[0] is None:
        return symbol
    fn, free = _CXXABI[0]
    status = ctypes.c_int(-1)
    out = fn(symbol.encode(), None, None, ctypes.byref(status))
    if not out:
        return symbol
    try:
        return ctypes.string_at(out).decode(errors="replace") if status.value == 0 else symbol
    finally:
        free(ctypes.c_void_p(out))


class SymbolTable(Generic[T]):
    """Symbols as sorted (start, end) ranges with a payload each (a name, or where to read it).

    ``find`` answers the innermost range that contains an address: aliases and nested symbols
    are looked at a few entries back from the bisection point, no further (bounded).
    """

    LOOK_BACK = 32

    def __init__(self, entries: Iterable[tuple[int, int, T]]) -> None:
        """``entries``: (start, size, payload); empty ranges (they cover nothing)
        and ranges past 2**64 (garbage) are dropped."""
        # Equal starts: the larger range first, so the narrower one is met first looking back.
        rows = sorted(
            (
                (start, start + size, payload)
                for start, size, payload in entries
                if size > 0 and start + size < 1 << 64
            ),
            key=lambda r: (r[0], -r[1]),
        )
        self.starts = array("Q", (r[0] for r in rows))
        self.ends = array("Q", (r[1] for r in rows))
        self.payloads: Sequence[T] = [r[2] for r in rows]

    @staticmethod
    def of_arrays(starts: array, ends: array, payloads: array) -> SymbolTable[int]:
        """The same table from three parallel arrays (payloads: integers), which it takes
        over (they are emptied): sorted by start with one integer key a row and no other
        Python object, so a table of millions of symbols costs its arrays (20 bytes a
        symbol) and, while sorting, a key each. Equal starts stay in the file's order:
        ``find`` picks the narrower itself."""
        n = len(starts)
        shift = max(n - 1, 1).bit_length()
        keys = [s << shift | i for i, s in enumerate(starts)]
        del starts[:]
        keys.sort()
        mask = (1 << shift) - 1
        table: SymbolTable[int] = SymbolTable.__new__(SymbolTable)
        table.starts = array("Q", (k >> shift for k in keys))
        table.ends = array("Q", (ends[k & mask] for k in keys))
        del ends[:]
        table.payloads = array(payloads.typecode, (payloads[k & mask] for k in keys))
        del payloads[:]
        return table

    def __len__(self) -> int:
        return len(self.starts)

    def find(self, addr: int) -> T | None:
        i = bisect.bisect_right(self.starts, addr) - 1
        best = None
        for j in range(i, max(i - self.LOOK_BACK, -1), -1):
            if best is not None and self.starts[j] != self.starts[best]:
                break  # past the ranges that start where the innermost one does
            if addr < self.ends[j] and (best is None or self.ends[j] < self.ends[best]):
                best = j
        return self.payloads[best] if best is not None else None


@dataclass(frozen=True)
class Load:
    """A PT_LOAD program header: file bytes [offset, offset+filesz) at [vaddr, vaddr+memsz)."""

    offset: int
    filesz: int
    vaddr: int
    memsz: int


@dataclass(frozen=True)
class _Elf:
    loads: tuple[Load, ...]
    symbols: SymbolTable[int]  # payload: the name's offset in the string table
    strtab: tuple[int, int]  # the string table's (file offset, size)
    capped: bool = False  # its symbol tables are over MAX_SYMTAB_BYTES: none was read


def _page_down(x: int) -> int:
    return x - x % PAGE


def elf_vaddr(loads: Sequence[Load], mapping: MemMap, addr: int) -> int | None:
    """The ELF virtual address of ``addr``, given ``mapping``: the file mapping that holds it,
    or the last file mapping before it (an anonymous mapping right after the file's holds the
    part of its .bss past the file's last page). None outside the object's segments.
    """
    file_off = addr - mapping.start + mapping.offset
    if mapping.start <= addr < mapping.end:
        for s in loads:  # bytes of the file: the segment that holds this file offset
            if s.offset <= file_off < s.offset + s.filesz:
                return s.vaddr + file_off - s.offset
    # Past the segment's file bytes (.bss): the load bias of the segment this mapping maps,
    # then any segment's memory range (a linker may give .bss a PT_LOAD of its own).
    for s in loads:
        if _page_down(s.offset) <= mapping.offset < s.offset + max(s.filesz, 1):
            v = file_off - s.offset + s.vaddr
            return v if any(t.vaddr <= v < t.vaddr + t.memsz for t in loads) else None
    return None


def _read_symbols(elf: ELFFile, fd: int) -> tuple[SymbolTable[int], tuple[int, int], bool]:
    """FUNC and OBJECT symbols of .symtab, else .dynsym, parsed from the raw section a chunk
    at a time into arrays: a library such as libtorch has a million symbols, too many for
    pyelftools' per-symbol objects or a tuple each. Names stay in the file (read at lookup)
    so a cached table holds numbers only. A table over MAX_SYMTAB_BYTES is not read (the
    next kind is tried): the last value says none could be."""
    count = elf.num_sections()
    if count > MAX_SECTIONS:
        return SymbolTable(()), (0, 0), False  # not a linked object's header table
    headers = [elf.get_section(i).header for i in range(count)]
    capped = False
    for wanted in ("SHT_SYMTAB", "SHT_DYNSYM"):
        for sh in headers:
            if sh.sh_type != wanted or sh.sh_link >= len(headers):
                continue
            strtab = headers[sh.sh_link]
            if strtab.sh_type == "SHT_NOBITS":
                continue
            if sh.sh_size > MAX_SYMTAB_BYTES:
                capped = True
                continue
            wide = elf.elfclass == 64
            fmt = ("<" if elf.little_endian else ">") + ("IBBHQQ" if wide else "IIIBBH")
            size = struct.calcsize(fmt)
            starts, ends, names = array("Q"), array("Q"), array("I")  # st_name: 32 bits
            chunk = SYMTAB_CHUNK - SYMTAB_CHUNK % size
            for at in range(0, sh.sh_size - sh.sh_size % size, chunk):
                data = os.pread(fd, min(chunk, sh.sh_size - at), sh.sh_offset + at)
                for entry in struct.iter_unpack(fmt, data[: len(data) - len(data) % size]):
                    if wide:
                        name, info, _, shndx, value, sym_size = entry
                    else:
                        name, value, sym_size, info, _, shndx = entry
                    if (
                        shndx != SHN_UNDEF
                        and info & 0xF in (STT_OBJECT, STT_FUNC)
                        and sym_size > 0
                        and value + sym_size < 1 << 64
                    ):
                        starts.append(value)
                        ends.append(value + sym_size)
                        names.append(name)
                if len(data) < chunk:
                    break  # the file ends before its section does
            table = SymbolTable.of_arrays(starts, ends, names)
            return table, (strtab.sh_offset, strtab.sh_size), False
    return SymbolTable(()), (0, 0), capped


_PARSING = threading.Lock()  # one object parsed at a time: the daemon's peak is one parse's


def _parse(fd: int) -> _Elf | None:
    """The object's segments and symbols; None for a file that is not ELF or not readable as
    one. Files come from the targets (a container's among them), so a malformed one must cost
    us a None, whatever pyelftools raises on it, and a huge one a bounded parse."""
    if os.pread(fd, 4, 0) != b"\x7fELF":
        return None  # a shared memory file, a data file: no symbols to look for
    try:
        with _PARSING, open(fd, "rb", closefd=False) as stream:
            elf = ELFFile(stream)
            if elf.num_segments() > MAX_SEGMENTS:
                return None
            loads = tuple(
                Load(p.header.p_offset, p.header.p_filesz, p.header.p_vaddr, p.header.p_memsz)
                for p in elf.iter_segments()
                if p.header.p_type == "PT_LOAD"
            )
            symbols, strtab, capped = _read_symbols(elf, fd)
    except Exception:
        return None
    return _Elf(loads, symbols, strtab, capped)


class _Cache:
    """Parsed objects by (st_dev, st_ino, st_mtime_ns), least recently used out first."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: OrderedDict[tuple[int, int, int], _Elf | None] = OrderedDict()
        self._symbols = 0

    def get(self, fd: int) -> _Elf | None:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        key = (st.st_dev, st.st_ino, st.st_mtime_ns)
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
        parsed = _parse(fd)  # outside the lock: two threads may parse one object, harmlessly
        with self._lock:
            if key not in self._items:
                self._items[key] = parsed
                self._symbols += len(parsed.symbols) if parsed else 0
            while len(self._items) > CACHE_OBJECTS or (
                self._symbols > CACHE_SYMBOLS and len(self._items) > 1
            ):
                _, old = self._items.popitem(last=False)
                self._symbols -= len(old.symbols) if old else 0
        return parsed

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._symbols = 0


_CACHE = _Cache()


def _name_at(fd: int, elf: _Elf, name_off: int) -> str | None:
    table_off, table_size = elf.strtab
    if name_off >= table_size:
        return None
    raw = os.pread(fd, min(MAX_NAME_BYTES, table_size - name_off), table_off + name_off)
    name = raw.split(b"\0", 1)[0].decode(errors="replace")
    return name or None


def _open_object(proc: ProcFS, target: confined.Target, m: MemMap) -> int:
    """An fd on the mapped file. map_files reaches the mapping's own file (even deleted, in
    the target's mount namespace) and needs CAP_SYS_ADMIN; it is opened through the target's
    own /proc directory, so never another process's that took its PID. Without it, the path
    from the maps is opened as the target would open it (agent.sources.confined: inside its
    root, with the rights fixed in ``target``), never as root through /proc/PID/root, where
    its symlinks would lead us out. Nothing is opened for a target that refuses reads."""
    if target.refusal is not None:
        raise OSError(errno.EACCES, target.refusal)
    try:
        return os.open(
            f"map_files/{m.start:x}-{m.end:x}", os.O_RDONLY | os.O_CLOEXEC, dir_fd=target.proc_fd
        )
    except OSError:
        return _OBJECTS.open(proc, target, m.path)


class _ConfinedObjects:
    """fds on objects opened by agent.sources.confined (a child process each time), kept a
    while by (proc root, pid, identity, path): a diagnosis asks about the same few objects
    many times, and a process that exec'd or a reused PID is another identity."""

    def __init__(self, limit: int = CACHE_OBJECTS, ttl_s: float = 60.0) -> None:
        self._items: OrderedDict[tuple[object, ...], tuple[float, int]] = OrderedDict()
        self._limit, self._ttl = limit, ttl_s
        self._lock = threading.Lock()

    def open(self, proc: ProcFS, target: confined.Target, path: str) -> int:
        key = (proc.root, target.pid, target.identity, path)
        now = time.monotonic()
        with self._lock:
            hit = self._items.get(key)
            if hit is not None and now - hit[0] < self._ttl:
                self._items.move_to_end(key)
                return os.dup(hit[1])
        got = confined.open_objects(target, [path], proc_root=proc.root).get(path)
        if not isinstance(got, int):
            raise OSError(errno.EACCES, got or "not opened")
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                os.close(old[1])
            self._items[key] = (now, got)
            while len(self._items) > self._limit:
                os.close(self._items.popitem(last=False)[1][1])
        return os.dup(got)


_OBJECTS = _ConfinedObjects()


def _object_name(path: str) -> str:
    if path.endswith(" (deleted)"):
        path = path[: -len(" (deleted)")]
    return os.path.basename(path)


def _file_backed(m: MemMap) -> bool:
    return m.inode != 0 and m.path.startswith("/")


def _load_base(maps: Sequence[MemMap], m: MemMap) -> int:
    """The lowest start of the mappings of ``m``'s file: offsets in names are from there."""
    return min(
        (x.start for x in maps if (x.dev, x.inode, x.path) == (m.dev, m.inode, m.path)),
        default=m.start,
    )


CAPPED = f"its symbol tables are over {MAX_SYMTAB_BYTES >> 20} MiB: not read"


def _symbol(
    proc: ProcFS, target: confined.Target, m: MemMap, addr: int
) -> tuple[str | None, bool, bool]:
    """The symbol that covers ``addr`` in ``m``'s object (``m`` holds ``addr`` or is the file
    mapping just before the anonymous one that does), whether ``addr`` is in the object's
    segments at all, and whether its symbol tables were too large to read. (None, True,
    False) when the file can be read but no symbol covers it."""
    fd = _open_object(proc, target, m)
    try:
        elf = _CACHE.get(fd)
        if elf is None:
            return None, m.start <= addr < m.end, False
        v = elf_vaddr(elf.loads, m, addr)
        if v is None:
            return None, m.start <= addr < m.end, elf.capped
        name_off = elf.symbols.find(v)
        return (_name_at(fd, elf, name_off) if name_off is not None else None), True, elf.capped
    finally:
        os.close(fd)


def _named(name: str | None, where: str) -> str:
    return f"`{name}` in {where}" if name else where


def _find_map(maps: Sequence[MemMap], starts: Sequence[int], addr: int) -> int | None:
    i = bisect.bisect_right(starts, addr) - 1
    return i if i >= 0 and addr < maps[i].end else None


def _holds_a_thread_stack(proc: ProcFS, pid: int, m: MemMap) -> bool:
    """Whether a thread's stack pointer is in ``m`` (glibc mmaps thread stacks anonymous)."""
    for tid in proc.tids(pid)[:MAX_THREADS_SCANNED]:
        line = proc.thread_syscall(pid, tid)
        if line is not None and line.sp is not None and m.start <= line.sp < m.end:
            return True
    return False


def _while_pinned(
    proc: ProcFS, pid: int, read: Callable[[confined.Target | None], T | None]
) -> T | None:
    """``read`` of a process pinned first: its objects are opened with the rights it had
    then, and what was read is dropped if it is no longer the same process after."""
    got = confined.Target.take(pid, proc.root)
    target = got if isinstance(got, confined.Target) else None
    try:
        said = read(target)
        return said if target is None or target.changed() is None else None
    finally:
        if target is not None:
            target.close()


def describe_address(pid: int, addr: int, proc: ProcFS) -> str | None:
    """What ``addr`` (a futex or lock word) is in process ``pid``: "`abba_a` in
    libabba.so+0x40a0" (the ELF symbol that covers it, from .symtab else .dynsym, and its
    offset from the object's load base), "libabba.so+0x40a0" (no symbol covers it, or its
    symbol tables are too large to read: then said so), "the heap", "a thread stack",
    "anonymous memory"; None when the maps cannot be read, nothing is mapped there, or the
    process changed identity (exec'd, or its PID was reused) while it was read. Without a
    fixed identity (a tree without one) nothing is named from its objects."""
    return _while_pinned(proc, pid, lambda target: _describe(pid, addr, proc, target))


def _symbol_of(
    proc: ProcFS, target: confined.Target | None, m: MemMap, addr: int
) -> tuple[str | None, bool, bool]:
    if target is None:
        return None, False, False
    try:
        return _symbol(proc, target, m, addr)
    except _FAILURES:
        return None, False, False  # the file cannot be read: its name and offset still say much


def _describe(pid: int, addr: int, proc: ProcFS, target: confined.Target | None) -> str | None:
    try:
        maps = proc.maps(pid)
        i = _find_map(maps, [m.start for m in maps], addr)
        if i is None:
            return None
        m = maps[i]
        if _file_backed(m):
            if m.path.startswith("/dev/zero"):
                return "shared anonymous memory"  # MAP_SHARED|MAP_ANONYMOUS shows as this
            where = f"{_object_name(m.path)}+0x{addr - _load_base(maps, m):x}"
            name, _, capped = _symbol_of(proc, target, m, addr)
            return _named(name, where) + (f" ({CAPPED})" if capped else "")
        if m.path == "[heap]":
            return "the heap"
        if m.path.startswith("[stack"):  # [stack], or [stack:TID] on kernels before 4.5
            return "a thread stack"
        if m.path and not m.path.startswith("[anon"):
            return f"{m.path}+0x{addr - m.start:x}"  # [vdso], [vvar], ...
        before = maps[i - 1] if i > 0 else None
        if before is not None and before.end == m.start and _file_backed(before):
            # the .bss of the object mapped just before, past its file's last page
            name, inside, capped = _symbol_of(proc, target, before, addr)
            if inside:
                where = f"{_object_name(before.path)}+0x{addr - _load_base(maps, before):x}"
                return _named(name, where) + (f" ({CAPPED})" if capped else "")
        if _holds_a_thread_stack(proc, pid, m):
            return "a thread stack"
        return "anonymous memory"
    except _FAILURES:
        return None


# --- return addresses on a blocked thread's stack -----------------------------------------


def _ff2_length(code: bytes, at: int) -> int | None:
    """Length of the ``FF /2`` (near indirect call) whose opcode is ``code[at]``, from its
    ModRM (and SIB) byte; None when it is not one. A REX prefix before it changes nothing
    in the length measured from the opcode."""
    if at + 1 >= len(code) or code[at] != 0xFF:
        return None
    modrm = code[at + 1]
    mod, reg, rm = modrm >> 6, (modrm >> 3) & 7, modrm & 7
    if reg != 2:
        return None  # FF /4 is jmp, /6 push, /3 a far call: not what leaves a return address
    if mod == 3:
        return 2  # call *%reg
    if rm == 4:  # a SIB byte follows
        if at + 2 >= len(code):
            return None
        if mod == 0:
            return 7 if code[at + 2] & 7 == 5 else 3  # base 101: disp32, no base register
        return 4 if mod == 1 else 7
    if mod == 0:
        return 6 if rm == 5 else 2  # rm 101: RIP-relative disp32
    return 3 if mod == 1 else 6


def indirect_call_before(before: bytes) -> bool:
    """Whether ``before`` (the bytes just before a return address) ends with an indirect
    ``call`` (FF /2: at ret-2, -3, -4, -6 or -7, its length agreeing with its ModRM)."""
    n = len(before)
    return any(_ff2_length(before, n - k) == k for k in (2, 3, 4, 6, 7) if k <= n)


def direct_call_target(before: bytes, ret: int) -> int | None:
    """The target of the ``call rel32`` (E8) that ends at ``ret``, if ``before`` ends with one."""
    if len(before) < 5 or before[-5] != 0xE8:
        return None
    return ret + int.from_bytes(before[-4:], "little", signed=True)


def after_call(before: bytes, ret: int, is_code: Callable[[int], bool]) -> bool:
    """Whether ``ret`` is a return address: preceded by a direct call into code (``is_code``
    of its target) or by an indirect call. Words on a stack that merely point into code
    (function pointers, stale values) rarely pass this."""
    target = direct_call_target(before, ret)
    if target is not None and is_code(target):
        return True
    return indirect_call_before(before)


def _is_libc(path: str) -> bool:
    name = _object_name(path)
    return name.startswith(_LIBC_PREFIXES)


def _return_address(
    mem: ProcessMemory,
    sp: int,
    stack: MemMap,
    candidate: Callable[[int], MemMap | None],
    is_code: Callable[[int], bool],
) -> tuple[MemMap, int] | None:
    """The first word of the stack from ``sp`` that points into a ``candidate`` object just
    after a call there, with that object; None when there is none or the stack is unreadable."""
    data = mem.read(sp, min(STACK_SCAN_BYTES, stack.end - sp))
    if data is None:
        return None
    for (word,) in struct.iter_unpack("<Q", data[: len(data) - len(data) % 8]):
        m = candidate(word)
        if m is None:
            continue
        start = max(word - 8, m.start)
        before = mem.read(start, word - start)
        if before is None:
            return None  # as unreadable as the stack: no answer, not a guess
        if after_call(before, word, is_code):
            return m, word
    return None


def caller_outside_libc(pid: int, tid: int, proc: ProcFS) -> NativeFrame | None:
    """The innermost native frame of thread ``tid`` of ``pid`` that is not in libc, ld.so,
    libpthread or the vDSO, for a thread blocked in a syscall: the code that called into the
    wait ("`abba_ab` in libabba.so+0x11a9"). None when it cannot be told.

    Read without stopping the thread: sp and pc from its syscall line, then up to 16 KiB of
    its stack from /proc/PID/mem, scanned word by word for the first value that points into
    executable code of another object and is preceded there by a call instruction (or pc
    itself, when the syscall instruction is outside libc: static code, a runtime's stubs).
    A scan, not an unwind: a stale return address left in a callee's frame can win, though
    the call check makes it rare. A blocked thread's stack does not move while it sleeps, but one
    that woke may be read mid-change: the answer is a hint, as everything sampled is.

    The interpreter (python3.x or libpython) is native code like any other, so for a Python
    thread this names a C function of CPython (lock acquisition, say); its Python stack, read
    elsewhere (agent/sources/pystacks.py), says far more about where it waits.

    The process's identity is fixed before its maps are read and checked after: a frame
    read of a process that exec'd or of a reused PID is None.
    """
    return _while_pinned(proc, pid, lambda target: _caller(pid, tid, proc, target))


def _caller(pid: int, tid: int, proc: ProcFS, target: confined.Target | None) -> NativeFrame | None:
    try:
        line = proc.thread_syscall(pid, tid)
        if line is None or line.sp is None or line.pc is None:
            return None
        sp, pc = line.sp, line.pc
        maps = proc.maps(pid)
        starts = [m.start for m in maps]

        def mapping(addr: int) -> MemMap | None:
            i = _find_map(maps, starts, addr)
            return maps[i] if i is not None else None

        def is_code(addr: int) -> bool:
            m = mapping(addr)
            return m is not None and "x" in m.perms

        def candidate(addr: int) -> MemMap | None:
            m = mapping(addr)
            if m is None or "x" not in m.perms or not _file_backed(m) or _is_libc(m.path):
                return None  # [vdso] and [vsyscall] are not file-backed
            return m

        stack = mapping(sp)
        if stack is None or "r" not in stack.perms:
            return None
        mem = proc.open_memory(pid)
        if mem is None:
            return None
        with mem:
            # A syscall issued outside libc (static code, a runtime's own stubs) is the frame.
            at_pc = candidate(pc)
            hit = (at_pc, pc) if at_pc is not None else None
            if hit is None:
                hit = _return_address(mem, sp, stack, candidate, is_code)
        if hit is None:
            return None
        found, ret = hit
        # ret - 1: the call itself, in the caller even when it is its last instruction
        name, _, _ = _symbol_of(proc, target, found, ret - 1)
        return NativeFrame(_object_name(found.path), ret - _load_base(maps, found), name, ret)
    except _FAILURES:
        return None
