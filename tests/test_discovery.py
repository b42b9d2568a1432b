"""Discovery: selectors, services as root + descendants, folding, labels (fixture /proc)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from agent.config import Target
from agent.observe.discovery import (
    Discovery,
    Service,
    env_labels,
    operator_slice,
    origin_of,
    unit_of,
)
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
    )
    services = d.scan(gpu)
    assert services[200].name == "shell"
    assert services[300].name == "pinned"
    d.set_targets((Target("gpu", gpu=True),))
    assert set(d.scan(gpu)) == {200}
    gpu.clear()  # released its GPU memory
    assert d.scan(gpu) == {}


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


def test_an_orphan_does_not_join_the_process_that_reuses_its_parents_pid(tmp_path):
    """401's parent 400 exits (401 goes to init) and a new process, a target, gets PID 400:
    401, not read again (nothing of its own changed), must not join its service."""
    root = tree(tmp_path)
    add(root, 400, 200, "bash", "bash")
    add(root, 401, 400, "python3", "python3 helper.py")
    d = told(root)
    assert 400 not in d.scan()
    write(root / "401/stat", stat_line(401, "python3", ppid=1, start=100))
    replaced(root, 400, 1, "python3", "python3 -m sglang.launch_server", start=900)
    assert d.scan()[400] == Service("sglang", 400, (400,))


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
@given(ops=OPS, cap=st.sampled_from([1, 2, 32]))
def test_told_of_changes_scans_as_a_full_read_would(tmp_path_factory, ops, cap):
    """Whatever processes do between scans (fork, exit and re-parent, turn zombie, exec,
    rename, a PID reused), a discovery told of every exec and rename finds the services
    that one reading every process afresh finds, also when a cap leaves some out (those are
    not read again until they are to be kept)."""
    root = tree(tmp_path_factory.mktemp("ops"))
    targets = (
        *(Target(t.name, cmdline=t.cmdline, max_services=cap) for t in TARGETS),
        Target("eng", comm=re.compile("engine")),
    )
    d = Discovery(ProcFS(str(root)), targets)
    d.changes_reported = True
    live = {1: 0, 100: 1, 101: 100, 102: 100, 103: 101, 200: 1, 300: 1, 301: 300}  # pid: ppid
    comms = {1: "init", 100: "python3", 101: "python3", 102: "python3", 103: "detok"}
    comms |= {200: "bash", 300: "torchrun", 301: "python3"}
    zombies: set[int] = set()
    next_pid, start = 600, 200
    starts = dict.fromkeys(live, 100)  # a process keeps its start time for its life

    def put(pid: int, cmdline: str | None = None, state: str = "S") -> None:
        write(root / f"{pid}/stat", stat_line(pid, comms[pid], state, live[pid], starts[pid]))
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
            live[next_pid], comms[next_pid], starts[next_pid] = parent, "python3", start
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
            live[pid], comms[pid], starts[pid] = 1, "python3", start
            replaced(root, pid, 1, "python3", cmdline, start)
    assert d.scan() == Discovery(ProcFS(str(root)), targets).scan()


# --- origin selectors: who started a process, not what it calls itself ----------------------

SPOOF = "python3 -m sglang.launch_server"  # anyone can run a process under this name


def with_origin(root: Path, pid: int, uid: int, cgroup: str | None) -> None:
    """Give a fixture process a real uid (Uid: real effective saved fs) and a cgroup."""
    write(root / f"{pid}/status", f"Name:\tx\nUid:\t{uid}\t0\t0\t0\nGid:\t{uid}\t0\t0\t0\n")
    if cgroup is not None:
        write(root / f"{pid}/cgroup", f"2:cpu:/\n1:name=systemd:{cgroup}\n0::{cgroup}\n")


def hosted(tmp_path: Path) -> Path:
    """A shared host: the operator's SGLang as a system service (root, 100 with ranks) and a
    torchrun in a pod; a tenant's login session running two processes named like SGLang
    (700, 701) and one in its own user manager's "service" (702); hangwatch itself (900) run
    by a system service."""
    root = tree(tmp_path)
    with_origin(root, 100, 0, "/system.slice/sglang.service")
    pod = "/kubepods.slice/kubepods-pod1.slice/cri-containerd-" + "a" * 64 + ".scope"
    with_origin(root, 300, 1000, pod)
    for pid, cg in (
        (700, "/user.slice/user-1001.slice/session-4.scope"),
        (701, "/user.slice/user-1001.slice/session-4.scope"),
        (702, "/user.slice/user-1001.slice/user@1001.service/app.slice/sglang.service"),
    ):
        add(root, pid, 1, "sleep", SPOOF, start=50 + pid)
        with_origin(root, pid, 1001, cg)
    add(root, 900, 1, "hangwatch", "hangwatch run")
    with_origin(root, 900, 0, "/system.slice/hangwatch.service")
    return root


def roots(d: Discovery) -> dict[int, str]:
    return {pid: s.name for pid, s in d.scan().items()}


def target(**kw: object) -> Target:
    return Target("sglang", cmdline=re.compile(r"sglang\.launch_server"), **kw)  # type: ignore[arg-type]


def test_a_command_line_alone_selects_a_tenants_spoofs(tmp_path):
    assert roots(Discovery(ProcFS(str(hosted(tmp_path))), (target(),))) == {
        100: "sglang",
        700: "sglang",
        701: "sglang",
        702: "sglang",
    }


def test_uids_and_the_command_line_together(tmp_path):
    d = Discovery(ProcFS(str(hosted(tmp_path))), (target(uids=frozenset({0})),))
    assert roots(d) == {100: "sglang"}
    # By uid alone: every process of 1001's, each a service (no parent of theirs matches).
    d.set_targets((Target("tenant", uids=frozenset({1001})),))
    assert set(roots(d)) == {700, 701, 702}


def test_started_by_reads_the_cgroup_not_the_name(tmp_path):
    root = hosted(tmp_path)
    d = Discovery(ProcFS(str(root)), (target(started_by=frozenset({"system"})),), self_pid=900)
    assert roots(d) == {100: "sglang"}
    d.set_targets((Target("pods", started_by=frozenset({"container"})),))
    assert roots(d) == {300: "pods"}
    # The tenant's "sglang.service" lives under its own user manager: a user's, not a unit's.
    d.set_targets((target(started_by=frozenset({"system", "container", "operator"})),))
    assert roots(d) == {100: "sglang"}


def test_operator_is_the_login_hangwatch_was_started_from(tmp_path):
    """sudo hangwatch run from user 1001's own session: their servers are the operator's."""
    root = hosted(tmp_path)
    with_origin(root, 900, 0, "/user.slice/user-1001.slice/session-9.scope")
    d = Discovery(ProcFS(str(root)), (target(started_by=frozenset({"operator"})),), self_pid=900)
    assert set(roots(d)) == {700, 701, 702}
    with_origin(root, 900, 0, "/user.slice/user-1002.slice/session-9.scope")
    d = Discovery(ProcFS(str(root)), (target(started_by=frozenset({"operator"})),), self_pid=900)
    assert roots(d) == {}


def test_units_and_cgroup_regexes(tmp_path):
    root = hosted(tmp_path)
    d = Discovery(ProcFS(str(root)), (Target("svc", units=("sglang.service",)),))
    assert roots(d) == {100: "svc"}  # not 702: its first unit is user@1001.service
    d.set_targets((Target("svc", units=("user@*.service",)),))
    assert roots(d) == {702: "svc"}
    d.set_targets((target(cgroup=re.compile(r"/system\.slice/")),))
    assert roots(d) == {100: "sglang"}
    # Matched from the start of the path: a tenant's "/system.slice/" deeper down is not it.
    with_origin(root, 701, 1001, "/user.slice/user-1001.slice/x/system.slice/y")
    d.set_targets((target(cgroup=re.compile(r"/system\.slice/")),))
    assert roots(d) == {100: "sglang"}


def test_an_unreadable_origin_selects_nothing(tmp_path):
    root = hosted(tmp_path)
    (root / "100/cgroup").unlink()
    (root / "100/status").unlink()
    for t in (target(uids=frozenset({0})), target(started_by=frozenset({"system"}))):
        assert roots(Discovery(ProcFS(str(root)), (t,))) == {}


def test_origin_of_cgroup_paths():
    c64 = "c" * 64
    for path, origin in [
        ("/system.slice/vllm.service", "system"),
        ("/", "system"),
        ("/init.scope", "system"),
        ("/system.slice/slurmstepd.scope/job_7/step_0/user/task_0", "system"),
        (f"/system.slice/docker-{c64}.scope", "container"),
        (f"/docker/{c64}", "container"),
        (f"/kubepods/burstable/pod1234/{c64}", "container"),
        ("/machine.slice/libpod-" + c64 + ".scope", "container"),
        ("/user.slice/user-1000.slice/session-2.scope", "user"),
        ("/user.slice/user-1000.slice/user@1000.service/app.slice/vllm.service", "user"),
        # rootless podman: the user names its own cgroups, so no container is believed there
        (f"/user.slice/user-1000.slice/user@1000.service/user.slice/libpod-{c64}.scope", "user"),
        ("/user.slice/user-0.slice/session-1.scope", "operator"),  # root's own logins
        # as a cgroup namespace of the agent's own shows cgroups outside it
        ("/../../user.slice/user-1000.slice/session-2.scope", "user"),
        ("/../../user-1000.slice/session-2.scope", "user"),
        (f"/../../kubepods-besteffort-pod9.slice/cri-containerd-{c64}.scope", "container"),
    ]:
        assert origin_of(path) == origin, path
    mine = operator_slice("/user.slice/user-1000.slice/session-3.scope")
    assert mine == ("user.slice", "user-1000.slice")
    assert origin_of("/user.slice/user-1000.slice/user@1000.service/x", mine) == "operator"
    assert origin_of("/user.slice/user-1001.slice/session-3.scope", mine) == "user"
    assert operator_slice("/system.slice/hangwatch.service") is None
    assert operator_slice(None) is None


def test_unit_of_cgroup_paths():
    assert unit_of("/system.slice/vllm.service") == "vllm.service"
    assert unit_of("/gpu.slice/sglang@0.service/worker") == "sglang@0.service"
    assert (
        unit_of("/user.slice/user-1.slice/user@1.service/app.slice/a.service") == "user@1.service"
    )
    assert unit_of("/user.slice/user-1.slice/session-2.scope") == "session-2.scope"
    assert unit_of("/") is None


# --- the caps: a tenant's flood is counted, not watched --------------------------------------


def flooded(tmp_path: Path, n: int) -> Path:
    """``n`` tenant processes named like SGLang, in a login session, each its own service,
    started after the operator's (100, a system service)."""
    root = hosted(tmp_path)
    for i in range(n):
        pid = 1000 + i
        add(root, pid, 1, "sleep", SPOOF, start=5000 + i)
        with_origin(root, pid, 1001, "/user.slice/user-1001.slice/session-4.scope")
    return root


def test_a_target_watches_at_most_max_services_the_rest_counted(tmp_path, caplog):
    root = flooded(tmp_path, 40)
    d = Discovery(ProcFS(str(root)), (target(max_services=8),))
    services = d.scan()
    # The system service first, then the tenant's oldest (the fixture's 700-702 are older).
    assert sorted(services) == [100, 700, 701, 702, 1000, 1001, 1002, 1003]
    assert d.excess == {"sglang": 43 + 1 - 8}
    d.scan()
    assert sum("services beyond max_services" in r.message for r in caplog.records) == 1


def test_the_global_cap_keeps_the_trusted_and_oldest_across_targets(tmp_path):
    root = flooded(tmp_path, 10)
    d = Discovery(
        ProcFS(str(root)),
        (Target("pods", started_by=frozenset({"container"})), target()),
        max_services=5,
    )
    services = d.scan()
    # 300 is selected by origin: first; 100 is root's; then the tenant's oldest.
    assert sorted(services) == [100, 300, 700, 701, 702]
    assert d.excess == {"pods": 0, "sglang": 10}
    # A newer tenant process never displaces those: a reload resets the count, not the rank.
    add(root, 2000, 1, "sleep", SPOOF, start=1)
    with_origin(root, 2000, 1001, "/user.slice/user-1001.slice/session-4.scope")
    d.set_targets(d.targets, max_services=3)
    assert sorted(d.scan()) == [100, 300, 2000]


@settings(max_examples=40, deadline=None)
@given(
    cap=st.integers(1, 6),
    total=st.integers(1, 12),
    tenants=st.lists(st.tuples(st.integers(1, 500), st.booleans()), max_size=12),
)
def test_caps_hold_and_nothing_selected_is_lost(tmp_path_factory, cap, total, tenants):
    """Whatever the processes: no target has more than its cap, none more than the global
    one in all, every selected root is either watched or counted, and no process a tenant
    started (login session) is watched while one started by the system is left out."""
    root = hosted(tmp_path_factory.mktemp("caps"))
    for i, (start, in_session) in enumerate(tenants):
        pid = 1000 + i
        add(root, pid, 1, "sleep", SPOOF, start=start)
        cg = "/user.slice/user-1001.slice/session-4.scope" if in_session else "/system.slice/x"
        with_origin(root, pid, 1001, cg)
    targets = (target(max_services=cap), Target("pods", started_by=frozenset({"container"})))
    d = Discovery(ProcFS(str(root)), targets, max_services=total)
    watched = d.scan()
    everything = Discovery(
        ProcFS(str(root)), (target(max_services=4096), targets[1]), max_services=4096
    ).scan()
    assert set(watched) <= set(everything)
    assert len(watched) <= total
    for t in targets:
        n = sum(s.name == t.name for s in watched.values())
        assert n <= t.max_services
        assert n + d.excess[t.name] == sum(s.name == t.name for s in everything.values())
    in_session = {700, 701, 702} | {1000 + i for i, (_, ses) in enumerate(tenants) if ses}
    if set(watched) & in_session:
        assert set(everything) - in_session <= set(watched)
