"""Which processes to watch, grouped into services.

A process matching a target is the root of a service named after the target; its
descendants (TP ranks, scheduler and detokenizer workers) belong to it, and a matched
process whose ancestor also matched folds into the ancestor's service. One listing of
/proc per interval; a process's cmdline and environment are read once (cached by PID and
start time, so a reused PID is read afresh) and again after it execs: its comm changed, or
the probe saw the exec (``exec_seen``; a launcher that execs the same interpreter keeps its
comm). Told of every exec and rename (``changes_reported``), a process outside the services
is not read again while its /proc entry is the one seen (see scan).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from ..config import Target
from ..sources.procfs import ProcFS

# Environment variables that identify ranks and jobs; nothing else from the environment or
# the command line ever becomes a label. Values must look like identifiers.
ENV_LABELS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "NODE_RANK",
    "TORCHELASTIC_RUN_ID",
    "SLURM_JOB_ID",
    "SLURM_PROCID",
    "SLURM_LOCALID",
)
_SAFE_VALUE = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


@dataclass(frozen=True)
class Service:
    name: str  # the target's name
    root: int
    pids: tuple[int, ...]  # root first, then descendants


@dataclass
class _Known:
    start: int
    comm: str
    ppid: int
    cmdline: str | None = None
    labels: dict[str, str] | None = None
    matched: str | None = field(default=None)
    checked: bool = False
    ino: int = 0  # the inode of its /proc entry: another process's if the PID is reused


def env_labels(environ: bytes) -> dict[str, str]:
    """Allow-listed environment values, as label names in lower case."""
    out = {}
    for item in environ.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if not sep:
            continue
        k = key.decode(errors="replace")
        if k in ENV_LABELS:
            v = value.decode(errors="replace")
            if _SAFE_VALUE.fullmatch(v):
                out[k.lower()] = v
    return out


def subtree(children: Mapping[int, Sequence[int]], root: int) -> list[int]:
    """``root`` and its descendants, depth first, root first; of each process's children the
    last listed is walked first (callers that want ascending PIDs list them descending)."""
    members, todo = [], [root]
    while todo:
        pid = todo.pop()
        members.append(pid)
        todo.extend(children.get(pid, ()))
    return members


def descendants(proc: ProcFS, roots: Iterable[int]) -> dict[int, list[int]]:
    """root -> [root, its descendants...] from one pass over /proc's ppids (children in the
    order /proc lists them, so the last listed comes first: the order diagnose reports in)."""
    children: dict[int, list[int]] = {}
    for pid in proc.pids():
        st = proc.stat(pid)
        if st is not None:
            children.setdefault(st.ppid, []).append(pid)
    return {root: subtree(children, root) for root in roots}


class Discovery:
    def __init__(
        self,
        proc: ProcFS,
        targets: Iterable[Target],
        gpu_pids: Callable[[], set[int]] = set,
        self_pid: int | None = None,
    ) -> None:
        self.proc = proc
        self.targets = tuple(targets)
        self.gpu_pids = gpu_pids
        self.self_pid = self_pid  # never watch ourselves
        self._known: dict[int, _Known] = {}
        # Whether every exec and rename since the last scan was reported (exec_seen): then a
        # process outside the services whose /proc entry is the one seen last needs no read
        # (see scan). The daemon sets it from the probe, each scan.
        self.changes_reported = False
        self._members: set[int] = set()  # the services' processes at the last scan
        self.stats_read = 0  # /proc/PID/stat reads (tests, the bench)

    def exec_seen(self, tgids: Iterable[int]) -> None:
        """Processes that exec'd or were renamed since the last scan: read and matched afresh
        at the next one (a process seen between fork and exec kept its parent's command
        line; a rename changes its comm)."""
        for pid in tgids:
            k = self._known.get(pid)
            if k is not None:
                k.cmdline = k.labels = None
                k.checked = False

    def set_targets(self, targets: Iterable[Target]) -> None:
        self.targets = tuple(targets)
        for k in self._known.values():
            k.checked = False  # match again against the new selectors

    def _match(self, pid: int, k: _Known, gpu: set[int]) -> str | None:
        for t in self.targets:
            if pid in t.pids or (t.gpu and pid in gpu):
                return t.name
            if t.comm is not None and t.comm.fullmatch(k.comm):
                return t.name
            if t.cmdline is not None:
                if k.cmdline is None:
                    k.cmdline = self.proc.cmdline(pid) or ""
                if t.cmdline.search(k.cmdline):
                    return t.name
        return None

    def scan(self) -> dict[int, Service]:
        """Services by root PID, as /proc shows them now."""
        gpu = self.gpu_pids() if any(t.gpu for t in self.targets) else set()
        seen: dict[int, _Known] = {}
        listed = self.proc.pid_inodes()
        known = self._known
        for pid, ino in listed.items():
            if pid == self.self_pid:
                continue
            k = known.get(pid)
            if (
                self.changes_reported
                and k is not None
                and k.ino == ino
                and k.checked
                and k.matched is None
                and pid not in self._members
                and pid not in gpu
            ):
                # The same process (its /proc entry is; a reused PID gets a new one), not
                # exec'd nor renamed (it would be unchecked): its start and comm are as read,
                # and it matches no target as before. Most of a host's processes, every
                # tick. A service's processes are read each time: one turning zombie, or
                # re-parented away by an exit, leaves it. Re-parenting cannot bring one of
                # these into a service: its new parent (init, or a subreaper) is an ancestor
                # of its old one, and was in no service either.
                seen[pid] = k
                continue
            st = self.proc.main_stat(pid)
            self.stats_read += 1
            if st is None or st.state in ("Z", "X"):
                continue
            # A new comm means an exec (or a prctl): read and match it afresh.
            if k is None or k.start != st.start_ticks or k.comm != st.comm:
                k = _Known(st.start_ticks, st.comm, st.ppid)
            k.ppid = st.ppid  # re-parenting happens
            k.ino = ino
            if not k.checked or pid in gpu or (k.matched and self._gpu_only(k.matched)):
                k.matched = self._match(pid, k, gpu)
                k.checked = True
            seen[pid] = k
        self._known = seen  # forget exited processes: bounded by live ones
        children: dict[int, list[int]] = {}
        for pid, k in seen.items():
            children.setdefault(k.ppid, []).append(pid)
        for kids in children.values():
            kids.sort(reverse=True)  # walked last first: children by ascending PID
        services = {}
        for pid, k in seen.items():
            if k.matched is None or self._matched_ancestor(pid, seen):
                continue
            services[pid] = Service(k.matched, pid, tuple(subtree(children, pid)))
        self._members = {p for svc in services.values() for p in svc.pids}
        return services

    def _gpu_only(self, name: str) -> bool:
        """A match by GPU memory alone is re-checked: the process may release the GPU."""
        t = next((t for t in self.targets if t.name == name), None)
        return t is not None and t.gpu and t.cmdline is None and t.comm is None and not t.pids

    def _matched_ancestor(self, pid: int, seen: Mapping[int, _Known]) -> bool:
        p = seen[pid].ppid
        hops = 0
        while p in seen and hops < 4096:  # a cycle in ppids cannot happen, but be bounded
            if seen[p].matched is not None:
                return True
            p = seen[p].ppid
            hops += 1
        return False

    def labels(self, pid: int) -> dict[str, str]:
        """The allow-listed environment labels of a watched process (read once)."""
        k = self._known.get(pid)
        if k is None:
            return {}
        if k.labels is None:
            raw = self.proc.environ(pid)
            k.labels = env_labels(raw) if raw is not None else {}
        return k.labels
