"""Build ``abba.c`` into a shared library (stdlib only: the tests import this too)."""

from __future__ import annotations

import os
import secrets
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "abba.c"
DEFAULT_OUT_DIR = HERE.parent.parent / "fixtures" / "build"  # tests/fixtures/build (ignored)
CFLAGS = ("-O1", "-g", "-pthread", "-Wall", "-Werror", "-shared", "-fPIC")


def build_abba(out_dir: Path = DEFAULT_OUT_DIR) -> Path:
    """Compile ``abba.c`` to ``out_dir/libabba.so`` unless it is up to date; its path.

    Like ``scripts.fixturelib.build``: each builder compiles to its own temporary name and
    ``os.replace`` swaps the result in, so concurrent builds are safe.
    """
    out = out_dir / "libabba.so"
    try:
        if out.stat().st_mtime_ns >= SOURCE.stat().st_mtime_ns:
            return out
    except FileNotFoundError:
        pass
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f".libabba.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    cmd = [os.environ.get("CC", "gcc"), *CFLAGS, "-o", str(tmp), str(SOURCE)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"building {SOURCE.name} failed: {' '.join(cmd)}\n{proc.stderr}")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out
