"""Discovery: selectors, services as root + descendants, folding, labels (fixture /proc)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from agent.config import Target
from agent.observe.discovery import Discovery, Service, env_labels
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


# --- told of every exec and rename: a process seen before is not read again -------------


def replaced(root: Path, pid: int, ppid: int, comm: str, cmdline: str, start: int) -> None:
    """Process ``pid`` exits and another gets its PID: a new /proc entry (made before the
    old one goes, so that the filesystem cannot hand the old inode number back)."""
    fresh = root / f".new-{pid}"
    write(fresh / "stat", stat_line(pid, comm, ppid=ppid, start=start))
    write(fresh / "cmdline", cmdline.replace(" ", "\0").encode() + b"\0")
    write(fresh / "environ", b"\0")
    shutil.rmtree(root / str(pid))
    fresh.rename(root / str(pid))


def told(root: Path) -> Discovery:
    d = Discovery(ProcFS(str(root)), TARGETS)
    d.changes_reported = True
    return d


def test_told_of_changes_only_the_services_and_new_processes_are_read_again(tmp_path):
    root = tree(tmp_path)
    d = told(root)
    first = d.scan()
    assert d.stats_read == 8
    assert d.scan() == first
    assert d.stats_read == 8 + 6  # 100-103 and 300-301; init and the shell are not read
    add(root, 500, 200, "sleep", "sleep 1")
    assert d.scan() == first
    assert d.stats_read == 14 + 7  # and the new one, once
    d.scan()
    assert d.stats_read == 21 + 6


def test_not_told_of_changes_every_process_is_read(tmp_path):
    root = tree(tmp_path)
    d = Discovery(ProcFS(str(root)), TARGETS)
    d.scan()
    d.scan()
    assert d.stats_read == 16


def test_a_reused_pid_is_read_again_by_its_new_entry(tmp_path):
    root = tree(tmp_path)
    d = told(root)
    assert 200 not in d.scan()
    replaced(root, 200, 1, "python3", "python3 -m sglang.launch_server", start=900)
    services = d.scan()
    assert services[200] == Service("sglang", 200, (200,))


def test_a_rename_or_exec_reported_is_read_again(tmp_path):
    root = tree(tmp_path)
    d = Discovery(ProcFS(str(root)), (Target("eng", comm=re.compile("engine")),))
    d.changes_reported = True
    assert d.scan() == {}
    write(root / "200/stat", stat_line(200, "engine", ppid=1, start=100))  # prctl: same entry
    assert d.scan() == {}  # not reported: not read (the probe reports every one)
    d.exec_seen([200])
    assert d.scan() == {200: Service("eng", 200, (200,))}


def test_a_service_process_re_parented_by_an_exit_leaves_the_service(tmp_path):
    """Re-parenting happens when a parent exits: a child kept unread would keep its old
    parent, and stay in the service."""
    root = tree(tmp_path)
    add(root, 400, 200, "bash", "bash")
    add(root, 401, 400, "python3", "python3 helper.py")
    d = Discovery(ProcFS(str(root)), (*TARGETS, Target("shell", comm=re.compile("bash"))))
    d.changes_reported = True
    assert d.scan()[200].pids == (200, 400, 401)
    shutil.rmtree(root / "400")
    write(root / "401/stat", stat_line(401, "python3", ppid=1, start=100))
    services = d.scan()
    assert services[200].pids == (200,)
    assert 401 not in {p for s in services.values() for p in s.pids}


def test_a_service_process_turning_zombie_leaves_it(tmp_path):
    root = tree(tmp_path)
    d = told(root)
    assert d.scan()[100].pids == (100, 101, 103, 102)
    write(root / "103/stat", stat_line(103, "detok", state="Z", ppid=101, start=100))
    assert d.scan()[100].pids == (100, 101, 102)


OPS = st.lists(
    st.tuples(
        st.sampled_from(["spawn", "exit", "zombie", "exec", "rename", "reuse"]),
        st.integers(0, 1000),
        st.booleans(),
    ),
    max_size=25,
)


@settings(max_examples=60, deadline=None)
@given(ops=OPS)
def test_told_of_changes_scans_as_a_full_read_would(tmp_path_factory, ops):
    """Whatever processes do between scans (fork, exit and re-parent, turn zombie, exec,
    rename, a PID reused), a discovery told of every exec and rename finds the services
    that one reading every process afresh finds."""
    root = tree(tmp_path_factory.mktemp("ops"))
    targets = (*TARGETS, Target("eng", comm=re.compile("engine")))
    d = Discovery(ProcFS(str(root)), targets)
    d.changes_reported = True
    live = {1: 0, 100: 1, 101: 100, 102: 100, 103: 101, 200: 1, 300: 1, 301: 300}  # pid: ppid
    comms = {1: "init", 100: "python3", 101: "python3", 102: "python3", 103: "detok"}
    comms |= {200: "bash", 300: "torchrun", 301: "python3"}
    zombies: set[int] = set()
    next_pid, start = 600, 200

    def put(pid: int, cmdline: str | None = None, state: str = "S") -> None:
        write(root / f"{pid}/stat", stat_line(pid, comms[pid], state, live[pid], start))
        if cmdline is not None:
            write(root / f"{pid}/cmdline", cmdline.replace(" ", "\0").encode() + b"\0")

    def orphan(pid: int) -> None:
        for child in [c for c, p in live.items() if p == pid]:
            live[child] = 1
            put(child, state="Z" if child in zombies else "S")

    for op, pick, flag in ops:
        d.scan()
        start += 1
        alive = sorted(p for p in live if p != 1 and p not in zombies)
        cmdline = "python3 -m sglang.launch_server" if flag else "python3 worker.py"
        if op == "spawn" or not alive:
            parent = sorted(p for p in live if p not in zombies)[pick % (len(live) - len(zombies))]
            live[next_pid], comms[next_pid] = parent, "python3"
            put(next_pid, cmdline)
            next_pid += 1
            continue
        pid = alive[pick % len(alive)]
        if op == "exit":
            shutil.rmtree(root / str(pid))
            del live[pid]
            orphan(pid)
        elif op == "zombie":
            zombies.add(pid)
            put(pid, state="Z")
            orphan(pid)
        elif op in ("exec", "rename"):
            comms[pid] = "engine" if flag and op == "rename" else comms[pid]
            put(pid, cmdline if op == "exec" else None)
            d.exec_seen([pid])
        else:  # reuse: the process exits, another comes on its PID under init
            orphan(pid)
            live[pid], comms[pid] = 1, "python3"
            replaced(root, pid, 1, "python3", cmdline, start)
    assert d.scan() == Discovery(ProcFS(str(root)), targets).scan()
