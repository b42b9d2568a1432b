"""An ELF symbol-table bomb: a real shared object with millions of function symbols added to
its .symtab, for the test that holds the daemon's memory while it names a lock word in one
(tests/privileged/test_tenant_reads.py) and for the benchmark that times the parse (bench)."""

from __future__ import annotations

import struct
from pathlib import Path


def symbol_bomb(lib: Path, out: Path, count: int) -> None:
    """``lib`` (an x86-64 ELF shared object) with ``count`` function symbols added to its
    .symtab, all in .text (16 bytes each, scattered): the file's own symbols still name its
    data. A new .symtab and section header table are written at the end of the file."""
    data = bytearray(lib.read_bytes())
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    sh = struct.Struct("<IIQQQQIIQQ")
    headers = [list(sh.unpack_from(data, shoff + i * shentsize)) for i in range(shnum)]
    names_at = headers[shstrndx][4]

    def name(h: list[int]) -> bytes:
        return bytes(data[names_at + h[0] :].split(b"\0", 1)[0])

    symtab = next(i for i, h in enumerate(headers) if h[1] == 2)  # SHT_SYMTAB
    text = next(i for i, h in enumerate(headers) if name(h) == b".text")
    text_addr, text_size = headers[text][3], headers[text][5]
    old = bytes(data[headers[symtab][4] : headers[symtab][4] + headers[symtab][5]])
    sym = struct.Struct("<IBBHQQ")
    with open(out, "wb") as f:
        f.write(data)
        f.write(bytes(-len(data) % 8))
        at = f.tell()
        f.write(old)
        for lo in range(0, count, 1 << 16):
            f.write(
                b"".join(
                    sym.pack(0, 0x12, 0, text, text_addr + (i * 7919) % (text_size - 16), 16)
                    for i in range(lo, min(lo + (1 << 16), count))
                )
            )
        headers[symtab][4], headers[symtab][5] = at, len(old) + count * sym.size
        new_shoff = f.tell()
        f.write(b"".join(sh.pack(*h) for h in headers))
        f.seek(0x28)
        f.write(struct.pack("<Q", new_shoff))
