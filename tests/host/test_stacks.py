"""agent.sources.pystacks with stand-in readers (shell scripts) for the ways a real py-spy fails,
source lines read in the confined child, and targets that change while read. Every test here
starts a process; tests/test_stacks.py holds the pure ones and tests/privileged/test_stacks.py
runs the real py-spy."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from agent.sources import pystacks
from agent.sources.confined import FileLines
from agent.sources.procfs import ProcFS
from agent.sources.pystacks import (
    SourceLines,
    StackRead,
    is_python,
    parse_dump,
    read_stacks,
)
from tests.test_stacks import DUMP, PROC

# --- parse_dump -------------------------------------------------------------------------------


def test_a_dump_gets_its_source_lines(tmp_path: Path):
    src = tmp_path / "server.py"
    src.write_text("import queue\n\n\n    item = work.get()  \n")
    text = DUMP.replace("/srv/app/server.py", str(src))
    threads = parse_dump(os.getpid(), text, SourceLines(PROC))
    assert threads[4244].frames[2].code == "item = work.get()"  # stripped
    assert threads[4245].frames[0].code is None  # line 8: past the end


# --- SourceLines ------------------------------------------------------------------------------


def test_source_lines_are_read_as_the_target_reads_them(tmp_path: Path):
    src = tmp_path / "app.py"
    src.write_text("import os\n\n    with self.lock:   \n")
    me = os.getpid()
    got = SourceLines(PROC).of(
        me,
        [
            (str(src), 1),
            (str(src), 3),
            (str(src), 2),
            (str(src), 4),
            ("<frozen importlib._bootstrap>", 1),
            ("<string>", 1),
            (str(tmp_path / "missing.py"), 1),
            ("relative.py", 1),
        ],
    )
    assert got[str(src)].lines == {1: "import os", 3: "with self.lock:"}  # blank, past end: no
    assert got[str(src)].withheld is None and got[str(src)].short == "app.py"
    assert got["<string>"].withheld == "not a file" and got["<string>"].short == "<string>"
    assert got[str(tmp_path / "missing.py")].withheld == "no such file in the target's root"
    assert got["relative.py"].withheld == "relative file name"
    gone = SourceLines(PROC).of(2**22 + 1, [(str(src), 1)])  # no such process: nothing read
    assert gone[str(src)] == FileLines(withheld="the target is gone")
    # Read in the tree it is given: a tree without this process has no target to read as.
    elsewhere = SourceLines(ProcFS(str(tmp_path))).of(me, [(str(src), 1)])
    assert elsewhere[str(src)] == FileLines(withheld="the target is gone")


def test_a_dump_says_why_a_frame_has_no_line(tmp_path: Path):
    src = tmp_path / "server.py"
    src.write_text("import queue\n")
    text = DUMP.replace("/srv/app/server.py", str(src))
    threads = parse_dump(os.getpid(), text, SourceLines(PROC))
    frames = {(f.file, f.line): f for t in threads.values() for f in t.frames}
    assert frames[(str(src), 4)].code is None
    assert frames[(str(src), 4)].code_withheld == "no such line"
    assert all(f.code_withheld is None for f in frames.values() if f.code is not None)


@pytest.fixture
def sleeper(tmp_path: Path):
    """A process that runs no Python: `sleep`, once it has exec'd (before that, the child of a
    Python process is itself Python)."""
    cwd = tmp_path / "its-cwd"
    cwd.mkdir()
    proc = subprocess.Popen(["sleep", "30"], cwd=cwd)
    try:
        deadline = time.monotonic() + 10
        while os.path.basename(os.readlink(f"/proc/{proc.pid}/exe")) != "sleep":
            assert time.monotonic() < deadline, "sleep did not exec"
            time.sleep(0.01)
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_a_relative_file_is_never_read_from_our_own_cwd(tmp_path: Path, sleeper, monkeypatch):
    ours = tmp_path / "agent-cwd"
    ours.mkdir()
    (ours / "job.py").write_text("ours = 1\n")
    (tmp_path / "its-cwd" / "job.py").write_text("theirs = 1\n")
    monkeypatch.chdir(ours)
    got = SourceLines(PROC).of(sleeper.pid, [("job.py", 1)])["job.py"]
    assert got == FileLines(withheld="relative file name")


# --- read_stacks with a stand-in reader -------------------------------------------------------


def reader(tmp_path: Path, body: str) -> str:
    path = tmp_path / "py-spy"
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return str(path)


def test_a_python_process_is_read_with_a_nonblocking_dump(tmp_path: Path):
    argv = tmp_path / "argv"
    exe = reader(tmp_path, f'echo "$@" > {argv}\necho "[]"')
    read = read_stacks(os.getpid(), PROC, reader=exe)
    assert read == StackRead(os.getpid(), {}, None, read.seconds)
    assert argv.read_text().split() == [
        "dump",
        "--nonblocking",
        "--json",
        "--full-filenames",
        "--pid",
        str(os.getpid()),
    ]


def test_a_reader_that_fails_says_why(tmp_path: Path):
    exe = reader(tmp_path, 'echo "Error: Permission denied (os error 13)" >&2\nexit 1')
    read = read_stacks(os.getpid(), PROC, reader=exe)
    assert read is not None and read.threads == {}
    assert read.error == "py-spy failed: permission denied"


def test_a_readers_other_words_are_never_shown(tmp_path: Path):
    """py-spy may quote what it read of a file the target named (an ELF header it could not
    parse): only its known failures are told, in our words, and the rest by status."""
    exe = reader(tmp_path, 'echo "Error: Invalid magic number: 0x54455243455350" >&2\nexit 1')
    read = read_stacks(os.getpid(), PROC, reader=exe)
    assert read is not None and read.error == "py-spy failed with exit status 1"


def test_the_reader_inherits_nothing_of_ours(tmp_path: Path, monkeypatch):
    seen = tmp_path / "seen"
    monkeypatch.setenv("HANGWATCH_TEST_SECRET", "s3cr3t")
    exe = reader(tmp_path, f'{{ env; echo "cwd=$(pwd)"; ls -l /proc/$$/fd; }} > {seen}\necho "[]"')
    with open(tmp_path / "held", "w"):  # an fd of ours
        read_stacks(os.getpid(), PROC, reader=exe)
    told = seen.read_text()
    assert "s3cr3t" not in told
    assert "cwd=/\n" in told  # not ours
    assert "held" not in told  # none of our fds


def test_a_reader_that_fails_silently_gives_its_status(tmp_path: Path):
    read = read_stacks(os.getpid(), PROC, reader=reader(tmp_path, "exit 3"))
    assert read is not None and read.error is not None and "3" in read.error


def test_a_reader_past_its_timeout_is_killed(tmp_path: Path):
    exe = reader(tmp_path, "exec sleep 30")
    start = time.monotonic()
    read = read_stacks(os.getpid(), PROC, timeout_s=0.3, reader=exe)
    assert time.monotonic() - start < 5
    assert read is not None and read.error is not None and "timed out" in read.error
    assert read.threads == {}


@pytest.mark.parametrize("out", ["Error: not json", '{"threads": 1}', "[1, 2]", "[{"])
def test_output_that_is_not_a_dump_is_not_understood(tmp_path: Path, out: str):
    read = read_stacks(os.getpid(), PROC, reader=reader(tmp_path, f"echo '{out}'"))
    assert read is not None and read.threads == {}
    assert read.error is not None and "not understood" in read.error


def test_a_reader_that_cannot_run(tmp_path: Path):
    read = read_stacks(os.getpid(), PROC, reader=str(tmp_path / "no-such-py-spy"))
    assert read is not None and read.error is not None and "could not run" in read.error


def test_a_process_that_runs_no_python_is_not_read(tmp_path: Path, sleeper):
    exe = reader(tmp_path, f"touch {tmp_path / 'ran'}\necho '[]'")
    assert is_python(os.getpid(), PROC) and not is_python(sleeper.pid, PROC)
    assert read_stacks(sleeper.pid, PROC, reader=exe) is None
    assert not (tmp_path / "ran").exists()
    assert read_stacks(2**22 + 1, PROC, reader=exe) is None  # no such process


# --- the target fixed before the dump, checked after it ---------------------------------------


ONE_FRAME = (
    '[{"os_thread_id": 1, "thread_name": "t", "owns_gil": false,'
    ' "frames": [{"name": "f", "filename": "/etc/hostname", "line": 1}]}]'
)


@pytest.mark.parametrize(
    ("signal_name", "why"),
    [("USR1", "the target changed identity during the read"), ("USR2", "the target is gone")],
)
def test_a_dump_of_a_target_that_changed_while_read_is_not_shown(
    tmp_path: Path, execer, signal_name: str, why: str
):
    """py-spy reads by PID: what it dumped after the target exec'd, or after its PID could
    be another process's, is not that target's, nor are the rights to read its lines."""
    exe = reader(tmp_path, f"kill -{signal_name} $6\nsleep 0.3\necho '{ONE_FRAME}'")
    read = read_stacks(execer.pid, PROC, reader=exe, source=SourceLines(PROC))
    assert read is not None and read.threads == {}
    assert read.error == f"not read: {why}"


def test_a_reader_that_writes_past_the_cap_is_killed(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(pystacks, "MAX_OUTPUT", 1 << 20)
    exe = reader(tmp_path, "exec yes '[1111111111111111111111111111111111111]'")
    read = read_stacks(os.getpid(), PROC, reader=exe)
    assert read is not None and read.threads == {}
    assert read.error == "py-spy wrote over 1 MiB"


def test_a_pid_that_is_no_longer_the_process_meant_is_not_read(tmp_path: Path):
    """The snapshot's start time travels with the PID: another process that took the PID
    since (here: the same PID with another start time) is not read at all."""
    ran = tmp_path / "ran"
    exe = reader(tmp_path, f"touch {ran}\necho '[]'")
    stat = Path("/proc/self/stat").read_text()
    start = int(stat.rpartition(")")[2].split()[19])
    read = read_stacks(os.getpid(), PROC, reader=exe, start=start + 1)
    assert read == StackRead(os.getpid(), error="not read: the target is gone")
    assert not ran.exists()  # py-spy never ran
    read = read_stacks(os.getpid(), PROC, reader=exe, start=start)
    assert read is not None and read.error is None and ran.exists()
