"""The constants shared with the BPF programs, read from bpf/hangwatch.h: declared once, in C.

The futex commands and the event kinds are numbers the kernel side and this side must agree
on; the header is the one place they are written, and this module reads its ``HW_*`` defines.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

HEADER = "hangwatch.h"


def _bpf_dir() -> Path:
    """$HANGWATCH_BPF_DIR, else the package's own copy (agent/bpf: a wheel or the .deb, which
    have no checkout around them), else the checkout's bpf/ beside agent/."""
    explicit = os.environ.get("HANGWATCH_BPF_DIR")
    if explicit:
        return Path(explicit)
    here = Path(__file__).resolve().parent
    packaged = here / "bpf"
    return packaged if (packaged / HEADER).is_file() else here.parent / "bpf"


BPF_DIR = _bpf_dir()


def header_defines(path: Path | None = None) -> dict[str, int]:
    """The HW_* integer constants of bpf/hangwatch.h."""
    text = (path or BPF_DIR / HEADER).read_text()
    return {
        m.group(1): int(m.group(2), 0)
        for m in re.finditer(r"^#define\s+(HW_\w+)\s+(0x[0-9a-fA-F]+|\d+)\b", text, re.M)
    }


HW = header_defines()
