"""Discovery: selectors, services as root + descendants, folding, labels (fixture /proc)."""

from __future__ import annotations

import re
from pathlib import Path

from agent.config import Target
from agent.observe.discovery import Discovery, env_labels
from agent.sources.procfs import ProcFS
from tests.test_procfs import stat_line, write


def add(
    root: Path, pid: int, ppid: int, comm: str, cmdline: str = "", env: str = "", start: int = 100
) -> None:
    write(root / f"{pid}/stat", stat_line(pid, comm, ppid=ppid, start=start))
    write(root / f"{pid}/cmdline", cmdline.replace(" ", "\0").encode() + b"\0")
    write(root / f"{pid}/environ", env.replace(" ", "\0").encode() + b"\0")


def tree(tmp_path: Path) -> Path:
    """1 init; 100 the launcher (sglang) with ranks 101, 102 (which match too) and a
    detokenizer 103; 200 an unrelated shell; 300 a torchrun with one worker 301."""
    root = tmp_path / "proc"
    add(root, 1, 0, "init", "/sbin/init")
    add(root, 100, 1, "python3", "python3 -m sglang.launch_server --tp 2", "HOME=/root")
    add(
        root,
        101,
        100,
        "python3",
        "python3 -m sglang.launch_server --rank 0",
        "RANK=0 WORLD_SIZE=2 SECRET=x",
    )
    add(
        root, 102, 100, "python3", "python3 -m sglang.launch_server --rank 1", "RANK=1 WORLD_SIZE=2"
    )
    add(root, 103, 101, "detok", "detokenizer")
    add(root, 200, 1, "bash", "bash")
    add(root, 300, 1, "torchrun", "/usr/bin/python3 /usr/local/bin/torchrun train.py")
    add(root, 301, 300, "python3", "python3 train.py", "LOCAL_RANK=0 TOKEN=hunter2")
    return root


TARGETS = (
    Target("sglang", cmdline=re.compile(r"sglang\.launch_server")),
    Target("torchrun", cmdline=re.compile(r"\btorchrun\b")),
)


def test_services_are_roots_with_descendants_and_matched_children_fold_in(tmp_path):
    d = Discovery(ProcFS(str(tree(tmp_path))), TARGETS)
    services = d.scan()
    assert set(services) == {100, 300}
    assert services[100].name == "sglang"
    assert services[100].pids[0] == 100 and set(services[100].pids) == {100, 101, 102, 103}
    assert services[300].pids == (300, 301)


def test_new_processes_are_picked_up_and_exited_ones_disappear(tmp_path):
    root = tree(tmp_path)
    d = Discovery(ProcFS(str(root)), TARGETS)
    d.scan()
    add(root, 104, 100, "python3", "python3 -m sglang.launch_server --rank 2")
    for f in (root / "300").iterdir():
        f.unlink()
    (root / "300").rmdir()
    services = d.scan()
    assert set(services) == {100}
    assert 104 in services[100].pids
    # 301 lost its parent: it is re-parented to 1 and no longer in any service
    add(root, 301, 1, "python3", "python3 train.py")
    assert all(301 not in s.pids for s in d.scan().values())


def test_comm_pids_and_gpu_selectors(tmp_path):
    root = tree(tmp_path)
    gpu = {200}
    d = Discovery(
        ProcFS(str(root)),
        (
            Target("shell", comm=re.compile("bash")),
            Target("pinned", pids=frozenset({300})),
            Target("gpu", gpu=True),
        ),
        gpu_pids=lambda: gpu,
    )
    services = d.scan()
    assert services[200].name == "shell"
    assert services[300].name == "pinned"
    d.set_targets((Target("gpu", gpu=True),))
    assert set(d.scan()) == {200}
    gpu.clear()  # released its GPU memory
    assert d.scan() == {}


def test_never_watches_itself(tmp_path):
    d = Discovery(ProcFS(str(tree(tmp_path))), TARGETS, self_pid=100)
    services = d.scan()
    assert 100 not in services and {101, 102} <= set(services)


def test_reused_pid_is_matched_afresh(tmp_path):
    root = tree(tmp_path)
    d = Discovery(ProcFS(str(root)), TARGETS)
    assert 300 in d.scan()
    add(root, 300, 1, "bash", "bash", start=999)  # same PID, another process
    assert 300 not in d.scan()


def test_exec_with_a_new_comm_is_matched_afresh(tmp_path):
    """A process seen between fork and exec (the parent's comm and cmdline) that then execs
    the target: the new comm in stat is enough to read it again."""
    root = tree(tmp_path)
    add(root, 400, 200, "bash", "bash -c launch", "RANK=9")
    d = Discovery(ProcFS(str(root)), TARGETS)
    assert 400 not in d.scan() and d.labels(400) == {"rank": "9"}
    add(root, 400, 200, "python3", "python3 -m sglang.launch_server", "RANK=3")
    services = d.scan()
    assert services[400].name == "sglang"
    assert d.labels(400) == {"rank": "3"}


def test_exec_seen_matches_afresh_with_the_same_comm(tmp_path):
    """A python launcher that execs python: same comm, so only the probe's exec says so."""
    root = tree(tmp_path)
    add(root, 400, 200, "python3", "python3 launcher.py", "RANK=9")
    d = Discovery(ProcFS(str(root)), TARGETS)
    assert 400 not in d.scan() and d.labels(400) == {"rank": "9"}
    add(root, 400, 200, "python3", "python3 -m sglang.launch_server", "RANK=3")
    assert 400 not in d.scan()  # read once: the exec is not visible in stat
    d.exec_seen([400, 12345])  # 12345: an exec of a process never scanned
    services = d.scan()
    assert services[400].name == "sglang"
    assert d.labels(400) == {"rank": "3"}
    assert 12345 not in services


def test_exec_away_from_the_target_ends_the_service(tmp_path):
    root = tree(tmp_path)
    d = Discovery(ProcFS(str(root)), TARGETS)
    assert 300 in d.scan()
    add(root, 300, 1, "torchrun", "/usr/bin/python3 cleanup.py")
    d.exec_seen([300])
    assert 300 not in d.scan()


def test_labels_are_allow_listed_environment_values_only(tmp_path):
    d = Discovery(ProcFS(str(tree(tmp_path))), TARGETS)
    d.scan()
    assert d.labels(101) == {"rank": "0", "world_size": "2"}
    assert d.labels(301) == {"local_rank": "0"}
    assert d.labels(100) == {}
    assert env_labels(b"RANK=0; rm -rf /\0LOCAL_RANK=1\0") == {"local_rank": "1"}
