"""agent/sources/confined.py in its child process: reads of lines and objects run in a process
of their own, so every test here starts one; a real target that execs or exits between the
reads. The walk itself, on fake trees, is in tests/test_confined.py. No root needed."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from agent.sources import confined
from tests.test_confined import STAT, _fake_target

# --- the walk agrees with the kernel, on any tree -------------------------------------------


def test_lines_of_our_own_files(tmp_path: Path) -> None:
    """The whole path, child and all, on a file we may read; a FIFO is withheld, not opened
    (the read would never end), and a huge file is not read."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "mod.py").write_text("one\n\n  three  \n")
    os.mkfifo(tmp_path / "fifo")
    big = tmp_path / "big.py"
    with open(big, "wb") as f:
        f.truncate(confined.MAX_FILE_BYTES + 1)
    got = confined.read_lines(
        os.getpid(),
        {str(pkg / "mod.py"): [1, 2, 3, 9], str(tmp_path / "fifo"): [1], str(big): [1]},
    )
    assert got[str(pkg / "mod.py")] == confined.FileLines(
        {1: "one", 3: "three"}, None, "pkg/mod.py"
    )
    assert got[str(tmp_path / "fifo")].withheld == confined.NOT_REGULAR
    assert got[str(big)].withheld == confined.TOO_LARGE


# --- the target's identity, fixed before the reads and checked after -----------------------


@pytest.mark.parametrize(
    "change",
    [
        lambda pid: (pid / "stat").write_text(STAT.format(start=778)),  # another process
        lambda pid: (pid / "status").write_text("Uid:\t7\t7\t7\t7\nGid:\t7\t7\t7\t7\nGroups:\t\n"),
        lambda pid: (pid / "exe").symlink_to("/bin/sh"),  # exec'd
    ],
)
def test_a_target_that_changed_between_the_reads_is_not_read_for(tmp_path: Path, change) -> None:
    pid = _fake_target(tmp_path)
    (pid / "root" / "app.py").write_text("line\n")
    t = confined.Target.take(42, str(tmp_path))
    assert isinstance(t, confined.Target)
    with t:
        assert confined.read_lines(t, {"/app.py": [1]}, str(tmp_path))["/app.py"].lines == {
            1: "line"
        }
        change(pid)
        assert t.changed() == confined.CHANGED
        got = confined.read_lines(t, {"/app.py": [1]}, str(tmp_path))
        assert got["/app.py"] == confined.FileLines(withheld=confined.CHANGED)
        assert confined.open_objects(t, ["/app.py"], str(tmp_path)) == {"/app.py": confined.CHANGED}


def test_a_real_process_that_execs_or_exits_is_another_identity(
    tmp_path: Path, execer: subprocess.Popen[bytes]
) -> None:
    """An exec keeps the PID and the start time, not the executable; a process that exited
    is gone for good: its /proc directory, held open, never shows the PID's next owner."""
    src = tmp_path / "app.py"
    src.write_text("line\n")
    child = execer
    t = confined.Target.take(child.pid)
    assert isinstance(t, confined.Target)
    with t:
        assert t.changed() is None and t.refusal is None
        child.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 10
        while os.path.basename(os.readlink(f"/proc/{child.pid}/exe")) != "sleep":
            assert time.monotonic() < deadline, "the child did not exec"
            time.sleep(0.01)
        assert t.changed() == confined.CHANGED
        got = confined.read_lines(t, {str(src): [1]})
        assert got[str(src)].withheld == confined.CHANGED
        child.kill()
        child.wait()
        assert t.changed() == confined.GONE
        assert confined.read_lines(t, {str(src): [1]})[str(src)].withheld == confined.GONE
