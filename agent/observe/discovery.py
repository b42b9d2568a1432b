"""Which processes to watch, grouped into services.

A process matching a target is the root of a service named after the target; its
descendants (TP ranks, scheduler and detokenizer workers) belong to it, and a matched
process whose ancestor also matched folds into the ancestor's service. One listing of
/proc per interval; a process's cmdline and environment are read once (cached by PID and
start time, so a reused PID is read afresh) and again after it execs: its comm changed, or
the probe saw the exec (``exec_seen``; a launcher that execs the same interpreter keeps its
comm). Told of every exec and rename (``changes_reported``), a process outside the services
is not read again while its /proc entry is the one seen (see scan).

A target's origin selectors (uids, cgroup, units, started_by) are read from what the
process cannot choose: its real uid and the cgroup its launcher (systemd, a container
runtime, the kubelet) put it in. At most ``max_services`` services per target and in all are
watched; the rest are counted in ``excess``, never sampled or exported one by one.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from ..config import MAX_SERVICES, Target
from ..sources.procfs import ProcFS
from . import jobkey

log = logging.getLogger(__name__)

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


# A container runtime's cgroup: docker, containerd (CRI), CRI-O and podman scopes (systemd
# driver), a bare 64-hex id (cgroupfs driver), the kubelet's pods.
_CONTAINER_PART = re.compile(
    r"(?:docker|cri-containerd|crio|libpod)-[0-9a-f]{64}\.scope|[0-9a-f]{64}|kubepods(?:\.slice)?"
)
_USER_SLICE = re.compile(r"user-[0-9]+\.slice")
UNREAD = -1  # a _Known field not read yet


def cgroup_parts(path: str) -> list[str]:
    """The path's components, without the leading '..' that a cgroup namespace shows for a
    cgroup outside its own."""
    parts = [p for p in path.split("/") if p]
    while parts and parts[0] == "..":
        parts.pop(0)
    return parts


def unit_of(path: str) -> str | None:
    """The systemd unit a cgroup path belongs to: its first ``.service`` or ``.scope``
    component. Below a user's manager (``user@1000.service``) or a container's scope, the
    user or the container names further cgroups as it likes; the first one is systemd's."""
    return next((p for p in cgroup_parts(path) if p.endswith((".service", ".scope"))), None)


def operator_slice(own_path: str | None) -> tuple[str, ...] | None:
    """The user slice hangwatch itself runs in (``sudo hangwatch run`` from a login), or
    None (a system service, a container)."""
    parts = cgroup_parts(own_path or "")
    if len(parts) >= 2 and parts[0] == "user.slice" and _USER_SLICE.fullmatch(parts[1]):
        return tuple(parts[:2])
    return None


def origin_of(path: str, operator: tuple[str, ...] | None = None) -> str:
    """Who started a process, from its cgroup: ``user`` (a login session or a user's own
    manager, under ``user.slice``), ``operator`` (the user slice hangwatch was started from,
    or root's), ``container`` (a runtime's container or a pod) or ``system`` (any other: a
    system service). Only root and the runtimes create cgroups outside ``user.slice``;
    inside it, a user names its own (``systemd-run --user``, rootless podman), so nothing
    there counts as a container or a service."""
    parts = cgroup_parts(path)
    if parts[:1] == ["user.slice"] or (parts and _USER_SLICE.fullmatch(parts[0])):
        mine = operator is not None and tuple(parts[: len(operator)]) == operator
        return "operator" if mine or parts[:2] == ["user.slice", "user-0.slice"] else "user"
    if parts[:1] == ["machine.slice"] or any(_CONTAINER_PART.fullmatch(p) for p in parts):
        return "container"
    return "system"


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
    uid: int | None = UNREAD  # real uid (None: unreadable)
    cgroup: str | None = None
    cgroup_read: bool = False
    trust: int = UNREAD  # its rank's first key, from its uid and cgroup (see _rank)


def env_labels(environ: bytes, host: Callable[[], str] = lambda: "") -> dict[str, str]:
    """Allow-listed environment values, as label names in lower case, and the process's job
    (agent.observe.jobkey): ``job_key``, and ``rank`` and ``world_size`` from an MPI
    launcher's variables where torch's are absent. ``host`` names the process's host and
    network namespace, for a job on a loopback endpoint."""
    wanted = set(ENV_LABELS) | set(jobkey.VARIABLES)
    env: dict[str, str] = {}
    for item in environ.split(b"\0"):
        name, sep, value = item.partition(b"=")
        if sep:
            k = name.decode(errors="replace")
            if k in wanted:
                env[k] = value.decode(errors="replace")
    out = {k.lower(): v for k, v in env.items() if k in ENV_LABELS and _SAFE_VALUE.fullmatch(v)}
    key = jobkey.job_key(env, host)
    if key:
        out[jobkey.LABEL] = key
    rank, size = jobkey.rank_of(env), jobkey.world_size_of(env)
    if rank and "rank" not in out:
        out["rank"] = rank
    if size and "world_size" not in out:
        out["world_size"] = size
    return out


def process_labels(proc: ProcFS, pid: int) -> dict[str, str]:
    """env_labels of a live process (none where its environment is unreadable)."""
    raw = proc.environ(pid)
    return env_labels(raw, lambda: local_scope(proc, pid)) if raw else {}


def local_scope(proc: ProcFS, pid: int) -> str:
    """Where a loopback endpoint of process ``pid`` reaches: this host, and its network
    namespace where it is not the agent's (two containers' 127.0.0.1 are two places)."""
    host = "".join(c if c.isalnum() or c in "-_." else "_" for c in os.uname().nodename)[:64]
    theirs = proc.net_namespace(pid)
    if theirs is None or theirs == proc.net_namespace("self"):
        return host
    return f"{host}/net{theirs.removeprefix('net:[').removesuffix(']')}"


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


def _gpu_only(targets: Iterable[Target]) -> frozenset[str]:
    return frozenset(
        t.name for t in targets if t.gpu and t.cmdline is None and t.comm is None and not t.pids
    )


class Discovery:
    def __init__(
        self,
        proc: ProcFS,
        targets: Iterable[Target],
        self_pid: int | None = None,
        max_services: int = MAX_SERVICES,
    ) -> None:
        self.proc = proc
        self.targets = tuple(targets)
        self.self_pid = self_pid  # never watch ourselves
        self.max_services = max_services  # in all targets together
        self.operator = operator_slice(proc.cgroup(self_pid)) if self_pid else None
        # Per target: the services it selects beyond its cap (or the global one), not watched.
        self.excess: dict[str, int] = {t.name: 0 for t in self.targets}
        self._excess_told: set[str] = set()  # targets whose excess was logged (once each)
        self._gpu_only = _gpu_only(self.targets)
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
                k.uid, k.cgroup_read, k.trust = UNREAD, False, UNREAD
                k.checked = False

    def set_targets(self, targets: Iterable[Target], max_services: int | None = None) -> None:
        self.targets = tuple(targets)
        if max_services is not None:
            self.max_services = max_services
        self.excess = {t.name: 0 for t in self.targets}
        self._gpu_only = _gpu_only(self.targets)
        for k in self._known.values():
            k.checked = False  # match again against the new selectors

    def _match(self, pid: int, k: _Known, gpu: set[int]) -> str | None:
        for t in self.targets:
            if self._selects(t, pid, k, gpu):
                return t.name
        return None

    def _selects(self, t: Target, pid: int, k: _Known, gpu: set[int]) -> bool:
        """Any of the what-fields given, and every origin field given (the cheap and the
        likely-failing first: an origin is read only for a process the rest selects)."""
        if t.selects_by_what and not self._is_what(t, pid, k, gpu):
            return False
        if t.uids is not None and self._uid(pid, k) not in t.uids:
            return False
        if t.cgroup is not None or t.units or t.started_by:
            path = self._cgroup(pid, k)
            if path is None:
                return False  # unreadable: no origin is proven
            if t.cgroup is not None and not t.cgroup.match(path):
                return False
            if t.units and not t.unit_matches(unit_of(path) or ""):
                return False
            if t.started_by and origin_of(path, self.operator) not in t.started_by:
                return False
        return True

    def _is_what(self, t: Target, pid: int, k: _Known, gpu: set[int]) -> bool:
        if pid in t.pids or (t.gpu and pid in gpu):
            return True
        if t.comm is not None and t.comm.fullmatch(k.comm):
            return True
        if t.cmdline is not None:
            if k.cmdline is None:
                k.cmdline = self.proc.cmdline(pid) or ""
            if t.cmdline.search(k.cmdline):
                return True
        return False

    def _uid(self, pid: int, k: _Known) -> int | None:
        if k.uid == UNREAD:
            k.uid = self.proc.real_uid(pid)
        return k.uid

    def _cgroup(self, pid: int, k: _Known) -> str | None:
        if not k.cgroup_read:
            k.cgroup, k.cgroup_read = self.proc.cgroup(pid), True
        return k.cgroup

    def scan(self, gpu_pids: Collection[int] = frozenset()) -> dict[int, Service]:
        """Services by root PID, as /proc shows them now; ``gpu_pids``: the processes that
        hold GPU memory (NVML's last good reading), for the gpu selector."""
        gpu = set(gpu_pids) if any(t.gpu for t in self.targets) else set()
        seen: dict[int, _Known] = {}
        read: set[int] = set()  # whose stat was read this scan
        arrived: set[int] = set()  # new /proc entries: new processes, or PIDs reused
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
                and k.matched not in self._gpu_only
                and pid not in self._members
                and pid not in gpu
            ):
                # The same process (its /proc entry is; a reused PID gets a new one), not
                # exec'd nor renamed (it would be unchecked): its start and comm are as read,
                # and it matches as before: no target, or one whose cap left it out (a
                # tenant's flood: checked again only if it is to be kept, in _capped). Most
                # of a host's processes, every tick. A service's processes are read each
                # time: one turning zombie, or re-parented away by an exit, leaves it.
                # Re-parenting cannot bring one of these into a service: its new parent
                # (init, or a subreaper) is an ancestor of its old one, and was in no service
                # either.
                seen[pid] = k
                continue
            st = self.proc.main_stat(pid)
            self.stats_read += 1
            read.add(pid)
            if k is None or k.ino != ino:
                arrived.add(pid)
            if st is None or st.state in ("Z", "X"):
                continue
            # A new comm means an exec (or a prctl): read and match it afresh.
            if k is None or k.start != st.start_ticks or k.comm != st.comm:
                k = _Known(st.start_ticks, st.comm, st.ppid)
            k.ppid = st.ppid  # re-parenting happens
            k.ino = ino
            if not k.checked or pid in gpu or k.matched in self._gpu_only:
                k.matched = self._match(pid, k, gpu)
                k.checked = True
            seen[pid] = k
        if arrived:
            self._reparented(seen, read, arrived)
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
        services = self._capped(services, seen, read)
        self._members = {p for svc in services.values() for p in svc.pids}
        return services

    def _reparented(self, seen: dict[int, _Known], read: set[int], arrived: set[int]) -> None:
        """Read again the unread processes whose parent, as last read, is a PID that a new
        process now has: their parent exited (they were re-parented) and its PID was reused,
        and a stale parent would put them in the new process's service."""
        for pid in [p for p, k in seen.items() if p not in read and k.ppid in arrived]:
            st = self.proc.main_stat(pid)
            self.stats_read += 1
            read.add(pid)
            if st is None or st.state in ("Z", "X") or st.start_ticks != seen[pid].start:
                del seen[pid]  # gone, or another process: read afresh next scan
            else:
                seen[pid].ppid = st.ppid

    def _capped(
        self, services: dict[int, Service], seen: dict[int, _Known], read: set[int]
    ) -> dict[int, Service]:
        """At most each target's ``max_services``, and ``self.max_services`` in all; the
        rest counted in ``excess``. Which are kept is not the tenant's choice (``_rank``).
        One left out before and not read this scan is read before it is kept: it may have
        exited or turned zombie since."""
        roots: dict[str, list[int]] = {}
        for pid, svc in services.items():
            roots.setdefault(svc.name, []).append(pid)
        caps = {t.name: t.max_services for t in self.targets}
        by_name = {t.name: t for t in self.targets}
        excess = dict.fromkeys(caps, 0)
        kept: list[int] = []
        for name, pids in roots.items():
            cap = caps.get(name, len(pids))
            if len(pids) > cap:
                pids.sort(key=lambda p: self._rank(p, seen[p], by_name[name]))
            taken = 0
            for i, p in enumerate(pids):
                if taken == cap:
                    excess[name] += len(pids) - i
                    break
                if p in read or self._still_there(p, seen):
                    kept.append(p)
                    taken += 1
        if len(kept) > self.max_services:
            kept.sort(key=lambda p: self._rank(p, seen[p], by_name[services[p].name]))
            for p in kept[self.max_services :]:
                excess[services[p].name] += 1
            kept = kept[: self.max_services]
        self.excess = excess
        for name, n in excess.items():
            if n and name not in self._excess_told:
                self._excess_told.add(name)
                log.warning(
                    "target %s: %d services beyond max_services (its own or the global one) "
                    "are not watched; hangwatch_services_excess counts them",
                    name,
                    n,
                )
        if len(kept) == len(services):
            return services
        keep = set(kept)
        return {p: s for p, s in services.items() if p in keep}

    def _still_there(self, pid: int, seen: dict[int, _Known]) -> bool:
        st = self.proc.main_stat(pid)
        self.stats_read += 1
        k = seen[pid]
        if st is None or st.state in ("Z", "X") or st.start_ticks != k.start:
            del seen[pid]  # read afresh next scan, as a new process
            return False
        return True

    def _rank(self, pid: int, k: _Known, target: Target) -> tuple[int, int, int]:
        """Over a cap, first what no tenant can be (root's processes, or ones the config
        names by uid, cgroup or unit), then what no tenant can start outside its own session
        (a system service, a container, the operator's), then the rest; in each, the oldest
        first: a tenant can start processes at will, but none older than those running."""
        if target.uids is not None or target.cgroup is not None or target.units:
            return (0, k.start, pid)
        if k.trust == UNREAD:
            if self._uid(pid, k) == 0:
                k.trust = 0
            else:
                path = self._cgroup(pid, k)
                k.trust = 2 if path is None or origin_of(path, self.operator) == "user" else 1
        return (k.trust, k.start, pid)

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
            k.labels = process_labels(self.proc, pid)
        return k.labels
