"""`hangwatch run`: watch every inference service on the host and export what it sees.

One loop, one interval; each step: read NVML, discover services, observe (the same code path
as `diagnose`), judge over the progress window, log state changes, publish the exposition
that the /metrics collectors read. Each stage (``STAGES``) is timed and exported as a
collector; a stage that fails is logged and the next step tries again, and a judgement that
raises ends its tick alone, the last verdicts still served.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from types import FrameType
from typing import Any, TypeVar

from . import __version__, buildinfo
from . import config as config_mod
from . import session as session_mod
from .analysis.history import StateHistory, carried
from .analysis.lockwords import words_wanted
from .analysis.sites import leads_rank
from .analysis.stacks import native_asks, stack_facts
from .analysis.verdict import DEADLOCKED, STALLED, ServiceVerdict
from .analysis.window import Tick
from .errors import HangwatchError, UsageError
from .explain import explain
from .export import statusproto
from .export.build import build_exposition
from .export.exposition import (
    BPF_STATS,
    DISCOVERY,
    GPU,
    JUDGE,
    PROC,
    AgentStatus,
    CollectorStatus,
    Exposition,
)
from .export.status import Peer, StatusServer
from .model import (
    Enrichment,
    FrontDoorConfig,
    GpuDevice,
    GpuReading,
    ProgramStats,
    StackRead,
    Wanted,
)
from .observe.discovery import Discovery, Service
from .observe.observer import Scope
from .observe.sitebook import Park, SiteBook, read_site
from .report import status as status_report
from .report.sentences import render
from .session import Session
from .settings import STACKS_BUDGET_S
from .sources.procfs import ProcFS
from .sources.protocols import GpuSource, ProbeSource
from .sources.pystacks import SourceLines
from .sources.tcpinfo import NETNS
from .worker import MAX_PENDING, BoundedWorker

log = logging.getLogger(__name__)

T = TypeVar("T")


# The loop's wait is cut into drains this short, so that a stop set by another thread is
# seen soon; a signal's ends the drain at once (it interrupts the poll, the main thread's).
# Each drain wakes the daemon: at 0.1 s, ten wakeups a second cost 0.3% of a core here.
DRAIN_SLICE_S = 0.5
# A tick that raises is logged with its traceback at most once in this long (the count is
# exported every time): one that fails each tick would otherwise fill the journal.
TICK_ERROR_LOG_S = 60.0


def _as_reported(reading: GpuReading) -> CollectorStatus:
    # NVML's source never raises and times its own reads (a cached one keeps its read's time).
    return CollectorStatus(reading.ok, reading.duration_s)


@dataclass(frozen=True)
class Change:
    """A service's change of state, as the loop saw it, for the flight recorder."""

    service: str  # the target's name
    old: str | None  # None: the service is new
    verdict: ServiceVerdict
    tick: Tick


class Daemon:
    """The loop, its state, and what it publishes. /proc is a constructor argument; the
    probe and GPU source come with the session (``start()``, or ``with_sources`` in tests)."""

    def __init__(
        self, cfg: config_mod.Config, proc: ProcFS, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.cfg = cfg
        self.proc = proc
        self.clock = clock  # the loop's schedule (tests give one that the fake probe advances)
        self.session: Session | None = None
        self.gpus: tuple[GpuDevice, ...] = ()  # devices of the last good NVML reading
        self.gpu_errors = 0
        self.discovery = Discovery(
            proc, cfg.targets, self_pid=os.getpid(), max_services=cfg.max_services
        )
        self.services: dict[int, Service] = {}
        self.exposition: Exposition | None = None
        self.states: dict[tuple[str, int], str] = {}  # (service, root) -> last logged state
        self.collectors: dict[str, CollectorStatus] = {}
        self.stop = threading.Event()
        self.reload_requested = threading.Event()
        self.config_path: str | None = None
        self.source_lines = SourceLines(proc)  # the lines stacks point at, kept between changes
        # The flight record: each change's lines and, at a change to stalled or deadlocked, its
        # stacks (up to the stacks budget: seconds), written beside the loop so that no verdict
        # waits for them; only its thread uses source_lines. Past MAX_PENDING waiting, a change
        # is logged at once with what its verdict alone says, and counted.
        self.flight: BoundedWorker[Change] = BoundedWorker(
            self._record, self._record_at_once, name="hangwatch-flight", what="flight record"
        )
        self.sites = SiteBook(lambda park: read_site(self.proc, park))  # where parked ones wait
        self.tick_errors = 0  # ticks that raised: counted, logged, and the loop went on
        self._tick_error_logged: float | None = None  # monotonic time of the last one logged
        self._tick_errors_unlogged = 0
        # Connections /metrics ended, by reason (run() gives the server's count).
        self.http_dropped: Callable[[], Mapping[str, int]] = dict
        # What `hangwatch status` reads (agent.export.status): each service's state since
        # when and its changes, kept by the loop; the last flight record of each service,
        # kept by the recorder's thread (under the lock, held only to swap references); and
        # the view of the last tick, replaced whole each tick so that a reader in the status
        # thread never sees half of one.
        self.history = StateHistory()
        self._flights: dict[tuple[str, int], status_report.Flight] = {}
        self._flights_lock = threading.Lock()
        self.status_view: status_report.StatusView | None = None
        self.status_server: StatusServer | None = None  # bound by run(), started here

    def start_workers(self) -> None:
        """Start the threads the loop hands work to (the flight recorder, the site reader, the
        network namespaces' socket maker): at start-up, so that no tick starts a thread.
        RuntimeError if one cannot start."""
        self.flight.start()
        self.sites.start()
        NETNS.start()  # sockets of other network namespaces (containers' tcp_info)
        if self.status_server is not None:
            self.status_server.start()

    @classmethod
    def with_sources(
        cls,
        cfg: config_mod.Config,
        proc: ProcFS,
        probe: ProbeSource | None,
        gpu: GpuSource | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> Daemon:
        """A daemon over given sources (tests: a fixture /proc, a fake NVML, a real probe)."""
        d = cls(cfg, proc, clock)
        d.session = Session(cfg.settings, probe, gpu, proc)
        d.start_workers()
        return d

    def _scope(self) -> Scope:
        """What this tick watches: discovery's services, and the front doors their targets
        declare."""
        doors: dict[str, FrontDoorConfig | None] = {}
        for t in self.cfg.targets:  # the first target of a name, as discovery matches them
            doors.setdefault(t.name, t.front_doors)
        declared = {root: doors.get(s.name) for root, s in self.services.items()}
        return Scope(
            {root: s.pids for root, s in self.services.items()},
            {root: d for root, d in declared.items() if d is not None},
        )

    def _gpu_pids(self, session: Session) -> set[int]:
        """The processes holding GPU memory, asked only when a target selects by it."""
        if session.gpu is None or not any(t.gpu for t in self.cfg.targets):
            return set()
        return session.gpu.pids()

    def _timed(
        self,
        name: str,
        fn: Callable[[], T],
        status: Callable[[T], CollectorStatus] | None = None,
    ) -> T | None:
        """``fn()`` as the stage ``name`` (one of ``STAGES``), exported as its collector: its
        success and duration, or what ``status`` says of its result (a source that never
        raises and times itself). A stage that raises is logged and gives None."""
        t0 = time.monotonic()
        try:
            result = fn()
        except Exception:
            self.collectors[name] = CollectorStatus(False, time.monotonic() - t0)
            log.exception("collector %s failed; retrying next interval", name)
            return None
        took = time.monotonic() - t0
        self.collectors[name] = CollectorStatus(True, took) if status is None else status(result)
        return result

    def _read_gpu(self, session: Session) -> GpuReading | None:
        """NVML once per step, before discovery (the gpu selector needs it); a failed read is
        exported as a failed collector and used as no evidence."""
        if session.gpu is None:
            return None
        reading = self._timed(GPU, session.gpu.read, _as_reported)
        if reading is None:
            return None
        self.gpu_errors = reading.errors_total
        if reading.ok:
            self.gpus = reading.devices
        return reading

    def step(self) -> None:
        """One pass of the loop, top-down: NVML, discovery and the observation (the reads),
        then the judgement, then the log of state changes and a new exposition with the BPF
        programs' run time. Each is a timed stage. Without an observation nothing new is
        published, and /metrics serves the last exposition, its last-tick time saying how old
        it is."""
        session = self.session
        assert session is not None, "step() before a session was attached"
        gpu = self._read_gpu(session)
        renewed = session.probe.take_execs() if session.probe is not None else None
        self.discovery.changes_reported = renewed is not None
        self.discovery.exec_seen(renewed or ())
        services = self._timed(DISCOVERY, lambda: self.discovery.scan(self._gpu_pids(session)))
        if services is not None:
            self.services = services
        # A service that is gone logs "new" if its root PID comes back: bounded by live ones.
        self.states = {k: v for k, v in self.states.items() if k[1] in self.services}
        scope = self._scope()
        tick = self._timed(PROC, lambda: session.observe(scope, gpu))
        if tick is None:
            return
        # A process that exec'd is matched again by its new command line.
        self.discovery.exec_seen([*(e.tgid for e in tick.reading.execs), *tick.reading.renamed])
        self._forget_gone(session, tick)
        verdicts = self._judged(session)
        self._log_changes(verdicts, tick)
        labels = {pid: self.discovery.labels(pid) for pid in tick.snapshot.processes}
        sites = self._sites_of(verdicts, tick, labels)
        names = {root: svc.name for root, svc in self.services.items()}
        self.exposition = build_exposition(
            verdicts, names, tick, labels, self._agent_status(session, tick), sites
        )
        self._publish_status(session, verdicts, tick)

    def _publish_status(self, session: Session, verdicts: list[ServiceVerdict], tick: Tick) -> None:
        """The status socket's view of this tick: the history updated, and one immutable
        view of it, the verdicts and what the observer carries, swapped in whole."""
        keyed = [(self._key(v), v) for v in verdicts]
        self.history.update(keyed, tick.snapshot.wall)
        history = self.history.view()
        window = session.observer.window()
        with self._flights_lock:
            self._flights = {k: f for k, f in self._flights.items() if k in history}
            flights = dict(self._flights)
        self.status_view = status_report.StatusView(
            daemon_pid=os.getpid(),
            version=__version__,
            wall=tick.snapshot.wall,
            threshold_s=self.cfg.park_threshold_seconds,
            interval_s=self.cfg.interval_seconds,
            services=tuple(
                status_report.ServiceStatus(
                    key[0],
                    v,
                    tuple(window.members.get(v.pid, (v.pid,))),
                    history.get(key),
                    carried(window, v),
                )
                for key, v in keyed
            ),
            flights=flights,
        )

    def _key(self, v: ServiceVerdict) -> tuple[str, int]:
        svc = self.services.get(v.pid)
        return (svc.name if svc else "unknown", v.pid)

    def answer_status(self, req: statusproto.Request, _peer: Peer) -> Mapping[str, object]:
        """The status socket's answer (in its thread): from the last tick's view alone."""
        view = self.status_view
        if view is None:
            return statusproto.error(
                statusproto.STARTING, "the daemon has not finished its first tick: ask again"
            )
        return status_report.answer(view, req.pid, time.time())

    def _judged(self, session: Session) -> list[ServiceVerdict]:
        """The verdicts over the window, as the stage ``JUDGE``: timed, and a rule that raises
        is exported as the stage failed and ends this tick alone (``tick`` counts and logs
        it; /metrics keeps the last verdicts, dated by the last good tick)."""
        t0 = time.monotonic()
        try:
            verdicts = session.verdicts()
        except Exception:
            self.collectors[JUDGE] = CollectorStatus(False, time.monotonic() - t0)
            raise
        self.collectors[JUDGE] = CollectorStatus(True, time.monotonic() - t0)
        return verdicts

    def _sites_of(
        self,
        verdicts: list[ServiceVerdict],
        tick: Tick,
        labels: Mapping[int, Mapping[str, str]],
    ) -> dict[int, str]:
        """Where each parked process that leads its rank waits, as read for its park
        (agent.observe.sitebook); reads are asked for the parks that have lasted half the threshold."""
        snap = tick.snapshot
        parked_s: dict[Park, float] = {}  # each park, and how long it has lasted
        for v in verdicts:
            for p in v.processes:
                sample = snap.processes.get(p.pid)
                if p.gone or sample is None or p.parked_seconds <= 0:
                    continue
                if p.parked_threads < p.threads or not leads_rank(
                    labels.get(p.pid, {}), labels.get(sample.ppid)
                ):
                    continue
                since = snap.mono_ns - int(p.parked_seconds * 1e9)
                parked_s[Park(p.pid, sample.start_ticks, since)] = p.parked_seconds
        after = self.cfg.park_threshold_seconds / 2
        self.sites.update(parked_s, lambda park: self.cfg.stacks and parked_s[park] >= after)
        sites = {park.pid: self.sites.site(park) for park in parked_s}
        return {pid: site for pid, site in sites.items() if site is not None}

    def _forget_gone(self, session: Session, tick: Tick) -> None:
        """Per-process kernel state of processes that exited, so maps stay bounded."""
        if session.probe is None:
            return
        live = set(tick.snapshot.processes)
        r = tick.reading
        known = set(r.accepts) | set(r.writes) | set(r.wait_histogram) | set(r.shares)
        gone = known - live
        if gone:
            session.probe.forget_processes(gone)

    def _agent_status(self, session: Session, tick: Tick) -> AgentStatus:
        c = tick.reading.counters
        programs: dict[str, ProgramStats] = {}
        if self.cfg.bpf_stats and session.probe is not None:
            programs = self._timed(BPF_STATS, session.probe.program_stats) or {}
        return AgentStatus(
            version=__version__,
            events_dropped_total=c.get("events_dropped", 0),
            host_events_dropped_total=c.get("host_events_dropped", 0),
            maps_full_total=sum(v for k, v in c.items() if k.endswith("_full")),
            programs=programs,
            collectors=dict(self.collectors),
            gpus=self.gpus,
            gpu_errors_total=self.gpu_errors,
            last_tick_seconds=time.time(),
            park_threshold_seconds=self.cfg.park_threshold_seconds,
            tick_errors_total=self.tick_errors,
            http_connections_dropped=dict(self.http_dropped()),
            services_excess=dict(self.discovery.excess),
        )

    def _log_changes(self, verdicts: list[ServiceVerdict], tick: Tick) -> None:
        """A log line for every state change of a service, whether or not anyone scraped it;
        on a change to stalled or deadlocked, the Python stacks of its processes at that
        moment (a flight record: by the time someone looks, the process may be gone). Both
        are written beside the loop (agent.worker): the tick does not wait for them."""
        for v in verdicts:
            key = self._key(v)
            old = self.states.get(key)
            if old == v.state:
                continue
            self.states[key] = v.state
            self.flight.submit(Change(key[0], old, v, tick))

    def _record(self, change: Change) -> None:
        """A change's log lines, with its lock words named and, at a change to stalled or
        deadlocked, its stacks (in the flight recorder's thread)."""
        v, tick = change.verdict, change.tick
        flight = v.state in (STALLED, DEADLOCKED) and self.cfg.stacks
        # Lock words named from memory at the change only: it reads /proc/PID/maps
        # and symbol tables, too much to do every tick for every service.
        budget = STACKS_BUDGET_S if flight else 0.0
        snap = tick.snapshot
        pids = [p.pid for p in v.processes if not p.gone and p.pid in snap.processes]

        def wanted(stacks: Mapping[int, StackRead]) -> Wanted:
            natives = [
                ask
                for pid, read in stacks.items()
                for ask in native_asks(snap.processes[pid], read)
            ]
            return Wanted(natives, words_wanted([v], snap), fds=list(stacks))

        told = explain(
            self.proc, snap, [v], pids if flight else [], wanted, budget, self.source_lines
        )
        (v,) = told.verdicts
        self._log_change(change.service, change.old, v)
        if flight:
            self._log_stacks(change.service, v, tick, told.inputs)

    def _record_at_once(self, change: Change) -> None:
        """A change's line with what the verdict alone says: the recorder is full."""
        self._log_change(change.service, change.old, change.verdict)
        log.warning(
            "service %s pid %d: no flight record (%d changes already waiting for theirs)",
            change.service,
            change.verdict.pid,
            MAX_PENDING,
        )

    @staticmethod
    def _log_change(service: str, old: str | None, v: ServiceVerdict) -> None:
        log.info(
            "service %s pid %d: %s -> %s: %s",
            service,
            v.pid,
            old or "new",
            v.state,
            "; ".join(map(render, v.reasons)),
        )

    def _log_stacks(self, name: str, v: ServiceVerdict, tick: Tick, inputs: Enrichment) -> None:
        """Log the stacks of a service's processes, as read."""
        snap = tick.snapshot
        lines = []
        for pid, read in inputs.stacks.items():
            facts = stack_facts(
                snap.processes[pid],
                read,
                snap.wall,
                snap.mono_ns,
                natives=inputs.natives,
                fds=inputs.fds,
            )
            for f in facts:
                log.info("service %s pid %d: process %d: %s", name, v.pid, pid, render(f))
                lines.append(f"process {pid}: {render(f)}")
        # Kept for `hangwatch status`, the last per service (bounded lines, bounded services)
        flight = status_report.Flight.of(snap.wall, v.state, lines)
        with self._flights_lock:
            self._flights[(name, v.pid)] = flight

    def reload(self) -> None:
        """SIGHUP: load the config again; a bad one is logged and the old one kept."""
        try:
            new = config_mod.load(self.config_path)
        except UsageError as e:
            log.error("reload failed, keeping the running config: %s", e)
            return
        if new.listen != self.cfg.listen:
            log.warning(
                "listen %s -> %s needs a restart; keeping %s",
                self.cfg.listen_text,
                new.listen_text,
                self.cfg.listen_text,
            )
            new = replace(new, listen=self.cfg.listen)
        # Set once at start: the socket is bound and the kernel's stats switched on then.
        for key in ("status_socket", "status_group", "bpf_stats"):
            if getattr(new, key) != getattr(self.cfg, key):
                log.warning(
                    "%s %s needs a restart; keeping %s",
                    key,
                    getattr(new, key),
                    getattr(self.cfg, key),
                )
                new = replace(new, **{key: getattr(self.cfg, key)})
        self.discovery.set_targets(new.targets, new.max_services)
        if self.session is not None:
            self.session.reconfigure(new.settings)
        self.cfg = new
        log.info("reloaded %s: %d targets", new.source, len(new.targets))

    def loop(self) -> None:
        try:
            while not self.stop.is_set():
                started = self.clock()
                self.tick()
                self._wait_until(started + self.cfg.interval_seconds)
        finally:
            self.flight.close(STACKS_BUDGET_S)  # the changes seen before the stop, logged
            self.sites.close(0.0)  # a site read left is of no use once /metrics is gone

    def tick(self) -> None:
        """A reload if one was asked, then a step. Whatever either raises is counted
        (hangwatch_tick_errors_total), logged, and survived: the next tick tries again, and
        /metrics goes on serving the last verdicts with the count and their age."""
        try:
            if self.reload_requested.is_set():
                self.reload_requested.clear()
                self.reload()
            self.step()
        except Exception:
            self._tick_failed()

    def _tick_failed(self) -> None:
        """Count the exception being handled; log it with its traceback unless one was
        logged less than TICK_ERROR_LOG_S ago; export the count at once."""
        self.tick_errors += 1
        now = time.monotonic()
        if self._tick_error_logged is not None and now - self._tick_error_logged < TICK_ERROR_LOG_S:
            self._tick_errors_unlogged += 1
        else:
            log.exception(
                "tick failed (%d since start, %d not logged since the last one logged); "
                "the loop goes on",
                self.tick_errors,
                self._tick_errors_unlogged,
            )
            self._tick_error_logged, self._tick_errors_unlogged = now, 0
        # The last verdicts stay, dated by the last good tick; what failed is exported now.
        last = self.exposition or Exposition((), AgentStatus(version=__version__))
        agent = replace(
            last.agent,
            collectors=dict(self.collectors),
            tick_errors_total=self.tick_errors,
            http_connections_dropped=dict(self.http_dropped()),
            park_threshold_seconds=self.cfg.park_threshold_seconds,
        )
        self.exposition = replace(last, agent=agent)

    def _wait_until(self, deadline: float) -> None:
        """Sleep until the next step, draining the ring buffer meanwhile: drained once per
        step, its 64 pages would hold about 4,000 events a second."""
        probe = self.session.probe if self.session is not None else None
        while not self.stop.is_set():
            left = deadline - self.clock()
            if left <= 0:
                return
            if probe is None:
                self.stop.wait(left)
                continue
            try:
                probe.drain(min(left, DRAIN_SLICE_S))  # a slice, so that a stop is seen quickly
            except Exception:
                self._tick_failed()
                self.stop.wait(min(left, DRAIN_SLICE_S))  # the wait still waits


def run(config_path: str | None, listen: str | None, web_config: str | None = None) -> int:
    from prometheus_client import make_wsgi_app

    from .export import webconfig
    from .export.metrics import registry_for

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s hangwatch %(levelname)s %(message)s"
    )
    # First, so that a journal says which build ran before anything it may complain about.
    log.info("hangwatch %s", buildinfo.describe())
    # Handlers first: a SIGTERM while the port is bound or the probes compile (seconds) must
    # still mean a clean exit 0, not death by the default action.
    stop, reload_requested = threading.Event(), threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        if signum == signal.SIGHUP:
            reload_requested.set()
        else:
            stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    # Every input is checked before anything else, and exits 2 naming what is wrong.
    cfg = config_mod.load(config_path)
    if listen is not None:
        cfg = replace(cfg, listen=config_mod.parse_listen(listen))
    web = webconfig.load(web_config) if web_config is not None else None
    daemon = Daemon(cfg, ProcFS())
    daemon.config_path = config_path
    daemon.stop, daemon.reload_requested = stop, reload_requested
    registry = registry_for(lambda: daemon.exposition, commit=buildinfo.commit())
    host, port = cfg.listen
    status = StatusServer(cfg.status_socket, cfg.status_group, daemon.answer_status)
    try:  # every thread the daemon needs, started now: no tick starts one
        # bind before attaching: a port or a socket path in use must change nothing
        if status.bind():
            daemon.status_server = status
        daemon.start_workers()
        server, _ = webconfig.serve(host, port, make_wsgi_app(registry), web)
    except OSError as e:
        status.close()
        raise UsageError(f"listen {cfg.listen_text}: {e.strerror or e}") from None
    except RuntimeError as e:
        status.close()
        raise HangwatchError(
            f"cannot start the daemon's threads: {e}",
            "the unit's TasksMax (or the host's pid limit) leaves it none",
        ) from None
    daemon.http_dropped = server.dropped_total
    if web is not None and web.users and web.tls is None:
        log.warning("basic auth without TLS: passwords cross the network in the clear")
    try:
        if stop.is_set():  # asked to stop before anything was attached
            return _stopped()
        with session_mod.start(
            cfg.settings, proc=daemon.proc, bpf_stats=cfg.bpf_stats, notice=log.info
        ) as session:
            daemon.session = session
            log.info(
                "serving /metrics on %s%s; %d targets from %s; interval %g s, threshold %g s",
                cfg.listen_text,
                _web_text(web),
                len(cfg.targets),
                cfg.source,
                cfg.interval_seconds,
                cfg.park_threshold_seconds,
            )
            daemon.loop()
    finally:
        server.shutdown()
        server.server_close()
        status.close()  # the socket file removed: a client then says no daemon answers
    return _stopped()


def _stopped() -> int:
    log.info("stopped; probes detached")
    return 0


def _web_text(web: Any) -> str:
    if web is None:
        return " (http, no auth)"
    scheme = "https" if web.tls is not None else "http"
    auth = f"basic auth for {len(web.users)} users" if web.users else "no auth"
    return f" ({scheme}, {auth}, from {web.source})"
