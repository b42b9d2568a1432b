"""Bad input and a kernel that lacks something: the real command exits 2 or 3 with one line
that names the problem, and leaves nothing behind (no BPF program, no bound port).

test_daemon.py covers a bad regex, a port in use and an unparsable --listen; test_diagnose.py
a missing PID, a negative threshold, a thread ID, no capabilities at all and missing kernel
headers. This file adds the rest of README's exit-code contract.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.bpfobjs import leaked, prog_ids
from scripts.fixturelib import REPO_ROOT
from tests.limits import HANG_S
from tests.privileged.daemonlib import free_port

CMD = [sys.executable, "-m", "agent"]
TARGETS = "targets: [{name: a, pids: [1]}]\n"


def hangwatch(*args: str, wrap: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run the real command; assert it left no BPF program in the kernel.

    Other tests may load programs meanwhile: a new program that a live process holds is
    theirs (ours has exited); one that nobody holds and that stays is a leak.
    """
    before = prog_ids()
    r = subprocess.run(
        [*(wrap or []), *CMD, *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=HANG_S,
        check=False,
    )
    left = leaked(prog_ids() - before, grace_s=3)
    assert not left, f"BPF programs left behind: {sorted(left)}\n{r.stderr}"
    return r


def one_line_error(r: subprocess.CompletedProcess[str], code: int, *names: str) -> str:
    msg = f"exit {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    assert r.returncode == code, msg
    assert "Traceback" not in r.stderr, msg
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("hangwatch: ")]
    assert len(lines) == 1, msg
    for name in names:
        assert name in lines[0], msg
    return lines[0]


@pytest.mark.parametrize(
    ("config", "names"),
    [
        ("intervall_seconds: 1\n" + TARGETS, ["intervall_seconds", "did you mean 'interval_seconds'"]),
        ("targets: [{name: a, pid: [1]}]\n", ["targets[0].pid", "did you mean 'pids'"]),
        ("interval_seconds: 0\n" + TARGETS, ["interval_seconds", "0 is out of range"]),
        ("interval_seconds: 1e9\n" + TARGETS, ["interval_seconds", "1e9 is out of range"]),
        ("park_threshold_seconds: -1\n" + TARGETS, ["park_threshold_seconds", "-1 is out of range"]),
        ("listen: ':70000'\n" + TARGETS, ["listen", "70000"]),
        ("targets: [{name: a, cmdline: 'a{99999999999}'}]\n", ["targets[0].cmdline", "a{99999999999}"]),
        ("targets: [{name: a, comm: '[z-a]'}]\n", ["targets[0].comm", "[z-a]"]),
    ],
)  # fmt: skip
def test_bad_config_exits_2_naming_it(tmp_path: Path, config: str, names: list[str]) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(config)
    line = one_line_error(hangwatch("run", "--config", str(cfg)), 2, str(cfg), *names)
    assert line.startswith(f"hangwatch: config {cfg}: "), line


@pytest.mark.parametrize(
    ("listen", "names"),
    [
        ("192.0.2.1:9817", ["listen 192.0.2.1:9817", "assign"]),  # TEST-NET: not ours
        ("no-such-host.invalid:9817", ["listen no-such-host.invalid:9817"]),
        ("127.0.0.1:0", ["--listen", "port 0 is out of range"]),
        ("[::1:9817", ["--listen", "[::1:9817"]),
    ],
)
def test_listen_address_that_cannot_be_bound_exits_2(listen: str, names: list[str]) -> None:
    one_line_error(hangwatch("run", "--listen", listen), 2, *names)


def test_bad_web_config_exits_2_before_binding(tmp_path: Path) -> None:
    web = tmp_path / "web.yml"
    web.write_text("tls_server_config:\n  cert_file: missing.crt\n  key_file: missing.key\n")
    port = free_port()
    r = hangwatch("run", "--listen", f"127.0.0.1:{port}", "--web-config", str(web))
    one_line_error(r, 2, f"web config {web}", "cert_file", "missing.crt")
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # still free: nothing was bound


def test_missing_web_config_file_exits_2(tmp_path: Path) -> None:
    r = hangwatch("run", "--web-config", str(tmp_path / "nope.yml"))
    one_line_error(r, 2, "nope.yml", "cannot read it")


@pytest.mark.parametrize("pid", ["0", "4194305", "99999999999"])
def test_diagnose_of_a_pid_that_cannot_exist_exits_2(pid: str) -> None:
    one_line_error(hangwatch("diagnose", "--pid", pid), 2, f"--pid {pid}")


@pytest.mark.parametrize(
    ("flag", "value"), [("--duration", "nan"), ("--duration", "1e9"), ("--threshold", "0")]
)
def test_diagnose_absurd_numbers_exit_2(flag: str, value: str) -> None:
    one_line_error(hangwatch("diagnose", "--pid", str(os.getpid()), flag, value), 2, flag)


def test_diagnose_non_numeric_pid_exits_2() -> None:
    r = hangwatch("diagnose", "--pid", "abc")
    assert r.returncode == 2 and "not a PID: 'abc'" in r.stderr, r.stderr


# --- a kernel without BTF or without the tracepoints: exit 3 -------------------------------------
# A private mount namespace hides them from this one command: the host is left as it was.


def _hidden(*paths: str) -> list[str]:
    mounts = " && ".join(f"mount -t tmpfs hidden {p}" for p in paths if os.path.isdir(p))
    return [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        f'{mounts} && exec "$@"',
        "sh",
    ]


@pytest.mark.parametrize("command", ["run", "diagnose"])
def test_kernel_without_btf_exits_3(command: str) -> None:
    args = (
        ["run", "--listen", f"127.0.0.1:{free_port()}"]
        if command == "run"
        else ["diagnose", "--pid", str(os.getpid())]
    )
    r = hangwatch(*args, wrap=_hidden("/sys/kernel/btf"))
    one_line_error(r, 3, "BTF", "/sys/kernel/btf/vmlinux", "CONFIG_DEBUG_INFO_BTF")


def test_kernel_without_futex_tracepoints_exits_3() -> None:
    dirs = [f"{d}/events/syscalls" for d in ("/sys/kernel/tracing", "/sys/kernel/debug/tracing")]
    r = hangwatch("diagnose", "--pid", str(os.getpid()), wrap=_hidden(*dirs))
    one_line_error(r, 3, "sys_enter_futex", "sys_exit_futex", "CONFIG_FTRACE_SYSCALLS")
