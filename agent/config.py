"""The daemon's configuration: YAML, validated completely before anything is attached.

Every error names the key that is wrong (``targets[2].cmdline``) and the bad value; unknown
keys are errors, so a typo never silently turns a setting off.
"""

from __future__ import annotations

import difflib
import fnmatch
import ipaddress
import os
import pwd
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import yaml

from .errors import UsageError, show
from .model import PID_MAX_LIMIT, FrontDoorConfig
from .settings import INTERVAL, PARK_THRESHOLD, Seconds, Settings

DEFAULT_PORT = 9817
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")  # becomes a label value
MAX_REGEX = 1024  # characters: a selector is a short pattern, not a document
MAX_CONFIG_BYTES = 1 << 20  # a config is a page of YAML; more is a wrong file
TOP_KEYS = (
    "listen",
    INTERVAL.key,
    PARK_THRESHOLD.key,
    "bpf_stats",
    "stacks",
    "max_services",
    "status_socket",
    "status_group",
    "targets",
)
# What a process is (tenant-chosen: a command line, a comm, GPU memory) and who started it and
# where (not the tenant's to choose: its real uid, the cgroup its launcher put it in).
WHAT_KEYS = ("cmdline", "comm", "pids", "gpu")
ORIGIN_KEYS = ("uids", "cgroup", "units", "started_by")
TARGET_KEYS = (
    "name",
    *WHAT_KEYS,
    *ORIGIN_KEYS,
    "max_services",
    "front_door_ports",
    "front_door",
)
# started_by: a system service (a cgroup outside user.slice, not a container's), a
# container runtime's container or pod, or the user slice of whoever started hangwatch.
ORIGINS = ("system", "container", "operator")
# Services per target, and in all: each costs a few dozen series and a sample a tick.
MAX_SERVICES_PER_TARGET = 32
MAX_SERVICES = 128
MAX_SERVICES_LIMIT = 4096
_UNIT = re.compile(r"[A-Za-z0-9:_.\\@*?\[\]-]{1,256}\.(service|scope)")
MAX_UID = (1 << 32) - 2  # (uid_t)-1 means "no uid"
# `hangwatch status` asks the daemon here (agent.export.status); the group may ask too.
DEFAULT_STATUS_SOCKET = "/run/hangwatch/status.sock"
DEFAULT_STATUS_GROUP = "hangwatch"
MAX_SOCKET_PATH = 107  # bytes: sun_path holds 108 with its NUL
_GROUP = re.compile(r"[a-z_][a-z0-9_-]{0,31}")  # the names groupadd accepts by default


@dataclass(frozen=True)
class Target:
    """A selector: a process matching any of its what-fields (cmdline, comm, pids, gpu) and
    every origin field given (uids, cgroup, units, started_by) is watched, with its
    descendants. The what-fields are the process's to choose; the origin fields are not."""

    name: str
    cmdline: re.Pattern[str] | None = None  # searched in the space-joined /proc/PID/cmdline
    comm: re.Pattern[str] | None = None  # matched in full against /proc/PID/comm
    pids: frozenset[int] = frozenset()
    gpu: bool = False  # any process that holds GPU memory
    # Its front-door ports as declared (empty: it has none); None: found from its connections
    front_doors: FrontDoorConfig | None = None
    uids: frozenset[int] | None = None  # its real uid, one of these
    cgroup: re.Pattern[str] | None = None  # matched from the start of its cgroup v2 path
    units: tuple[str, ...] = ()  # globs on the systemd unit its cgroup path names
    started_by: frozenset[str] = frozenset()  # ORIGINS: where its cgroup says it came from
    max_services: int = MAX_SERVICES_PER_TARGET

    @property
    def selects_by_what(self) -> bool:
        return bool(self.cmdline or self.comm or self.pids or self.gpu)

    @property
    def selects_by_origin(self) -> bool:
        return bool(self.uids is not None or self.cgroup or self.units or self.started_by)

    def unit_matches(self, unit: str) -> bool:
        return any(fnmatch.fnmatchcase(unit, u) for u in self.units)


@dataclass(frozen=True)
class Config:
    listen: tuple[str, int] = ("0.0.0.0", DEFAULT_PORT)
    interval_seconds: float = INTERVAL.default
    park_threshold_seconds: float = PARK_THRESHOLD.default
    targets: tuple[Target, ...] = field(default_factory=tuple)
    source: str = "built-in default"
    # The kernel's per-program run-time accounting: two clock reads per program run, for
    # every BPF program on the host; it made an unwatched futex call ~40% dearer. Opt-in.
    bpf_stats: bool = False
    # Python stacks of a service's processes, logged when it turns stalled or deadlocked:
    # read with py-spy --nonblocking (never stops the target), only at those changes.
    stacks: bool = True
    max_services: int = MAX_SERVICES  # in all targets together
    status_socket: str = DEFAULT_STATUS_SOCKET
    status_group: str = DEFAULT_STATUS_GROUP

    @property
    def settings(self) -> Settings:
        """What the observer runs on: the one path from these keys to the classifier."""
        return Settings.daemon(self.park_threshold_seconds, self.interval_seconds)

    @property
    def listen_text(self) -> str:
        host, port = self.listen
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _err(source: str, key: str, what: str) -> UsageError:
    if source.startswith("--"):  # a flag, not a file: "--listen: ..."
        return UsageError(f"{source}: {what}")
    return UsageError(f"config {source}: {key}: {what}")


def unknown_key(raw: Mapping[Any, Any], known: tuple[str, ...]) -> tuple[str, str] | None:
    """The first key not in ``known``, and what to say about it (the closest known key)."""
    bad = sorted((k for k in raw if k not in known), key=show)  # keys of any YAML type
    if not bad:
        return None
    key = bad[0]
    # A plain key as written; anything else (too long, a newline, not text) as repr().
    plain = isinstance(key, str) and len(key) <= 60 and key.isprintable()
    name = key if plain else show(key)
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    hint = f"unknown key (did you mean {close[0]!r}?)" if close else "unknown key"
    return name, f"{hint}; known: {', '.join(known)}"


def parse_listen(text: object, key: str = "listen", source: str = "--listen") -> tuple[str, int]:
    """'HOST:PORT', '[v6]:PORT' or ':PORT' (all interfaces)."""
    if not isinstance(text, str):
        raise _err(source, key, f"want a string HOST:PORT, got {show(text)}")
    m = re.fullmatch(r"(?:\[([0-9A-Fa-f:.]+)\]|([^:\[\]]*)):(\d{1,5})", text.strip())
    if not m:
        raise _err(source, key, f"{show(text)} is not HOST:PORT")
    host = m.group(1) or m.group(2) or "0.0.0.0"
    port = int(m.group(3))
    if not 1 <= port <= 65535:
        raise _err(source, key, f"port {port} is out of range 1-65535")
    if m.group(1):
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise _err(source, key, f"{show(host)} is not an IPv6 address") from None
    elif not re.fullmatch(r"[A-Za-z0-9.-]{1,253}", host):
        raise _err(source, key, f"{show(host)} is not a host name or address")
    return host, port


def _seconds(raw: Mapping[str, Any], setting: Seconds, src: str) -> float:
    if setting.key not in raw:
        return setting.default
    return setting.check(raw[setting.key], f"config {src}: {setting.key}")


def _regex(value: object, key: str, src: str) -> re.Pattern[str]:
    if not isinstance(value, str) or not value:
        raise _err(src, key, f"want a regular expression string, got {show(value)}")
    if len(value) > MAX_REGEX:
        raise _err(src, key, f"regular expression of {len(value)} characters (at most {MAX_REGEX})")
    try:
        return re.compile(value)
    except re.error as e:
        raise _err(src, key, f"invalid regular expression {show(value)}: {e}") from None
    except (OverflowError, RecursionError, ValueError) as e:  # a{99999999999}, deep nesting
        raise _err(src, key, f"invalid regular expression {show(value)}: {e}") from None


def _target(raw: object, i: int, src: str) -> Target:
    where = f"targets[{i}]"
    if not isinstance(raw, dict):
        raise _err(src, where, f"want a mapping with a name and selectors, got {show(raw)}")
    unknown = unknown_key(raw, TARGET_KEYS)
    if unknown:
        raise _err(src, f"{where}.{unknown[0]}", unknown[1])
    name = raw.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise _err(
            src, f"{where}.name", f"want a short name of letters, digits, '_.-', got {show(name)}"
        )
    cmdline = _regex(raw["cmdline"], f"{where}.cmdline", src) if "cmdline" in raw else None
    comm = _regex(raw["comm"], f"{where}.comm", src) if "comm" in raw else None
    pids = raw.get("pids", [])
    if not isinstance(pids, list):
        raise _err(src, f"{where}.pids", f"want a list of PIDs, got {show(pids)}")
    for p in pids:
        if isinstance(p, bool) or not isinstance(p, int) or not 0 < p <= PID_MAX_LIMIT:
            raise _err(src, f"{where}.pids", f"{show(p)} is not a PID (1-{PID_MAX_LIMIT})")
    gpu = raw.get("gpu", False)
    if not isinstance(gpu, bool):
        raise _err(src, f"{where}.gpu", f"want true or false, got {show(gpu)}")
    target = Target(
        name,
        cmdline,
        comm,
        frozenset(pids),
        gpu,
        _front_doors(raw, where, src),
        uids=_uids(raw["uids"], f"{where}.uids", src) if "uids" in raw else None,
        cgroup=_regex(raw["cgroup"], f"{where}.cgroup", src) if "cgroup" in raw else None,
        units=_units(raw["units"], f"{where}.units", src) if "units" in raw else (),
        started_by=_started_by(raw["started_by"], f"{where}.started_by", src)
        if "started_by" in raw
        else frozenset(),
        max_services=_max_services(raw, f"{where}.max_services", src, MAX_SERVICES_PER_TARGET),
    )
    if not target.selects_by_what and not target.selects_by_origin:
        raise _err(
            src,
            where,
            f"target {name!r} selects nothing: give {', '.join(WHAT_KEYS + ORIGIN_KEYS[:-1])} "
            f"or {ORIGIN_KEYS[-1]}",
        )
    return target


def _nonempty_list(value: object, key: str, src: str, what: str) -> list[Any]:
    if not isinstance(value, list) or not value:
        raise _err(src, key, f"want a non-empty list of {what}, got {show(value)}")
    return value


def _uids(value: object, key: str, src: str) -> frozenset[int]:
    """Uids, or user names resolved now (at load and at each reload): a name the host does
    not know is an error, never a selector that silently matches nobody."""
    out = set()
    for u in _nonempty_list(value, key, src, "uids or user names"):
        if isinstance(u, int) and not isinstance(u, bool):
            if not 0 <= u <= MAX_UID:
                raise _err(src, key, f"{show(u)} is not a uid (0-{MAX_UID})")
            out.add(u)
        elif isinstance(u, str) and _NAME.fullmatch(u):
            try:
                out.add(pwd.getpwnam(u).pw_uid)
            except KeyError:
                raise _err(src, key, f"no user {u!r} on this host") from None
        else:
            raise _err(src, key, f"{show(u)} is not a uid or a user name")
    return frozenset(out)


def _units(value: object, key: str, src: str) -> tuple[str, ...]:
    units = _nonempty_list(value, key, src, "systemd unit names")
    for u in units:
        if not isinstance(u, str) or not _UNIT.fullmatch(u):
            raise _err(
                src, key, f"{show(u)} is not a unit name ending in .service or .scope (* globs)"
            )
    return tuple(units)


def _started_by(value: object, key: str, src: str) -> frozenset[str]:
    origins = _nonempty_list(value, key, src, f"origins ({', '.join(ORIGINS)})")
    for o in origins:
        if o not in ORIGINS:
            raise _err(src, key, f"{show(o)} is not one of {', '.join(ORIGINS)}")
    return frozenset(origins)


def _max_services(raw: Mapping[Any, Any], key: str, src: str, default: int) -> int:
    value = raw.get(key.rsplit(".", 1)[-1], default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _err(src, key, f"want a whole number of services, got {show(value)}")
    if not 1 <= value <= MAX_SERVICES_LIMIT:
        raise _err(src, key, f"{value} is out of range 1-{MAX_SERVICES_LIMIT}")
    return value


def _front_doors(raw: Mapping[Any, Any], where: str, src: str) -> FrontDoorConfig | None:
    """``front_door_ports: [8000]`` (exactly these) or ``front_door: false`` (none)."""
    if "front_door_ports" in raw and "front_door" in raw:
        raise _err(src, where, "give front_door_ports or front_door: false, not both")
    if "front_door" in raw:
        value = raw["front_door"]
        if value is not False:
            raise _err(
                src,
                f"{where}.front_door",
                f"want false (it has no front door), got {show(value)}; "
                "to name its front doors, list them in front_door_ports",
            )
        return FrontDoorConfig()
    if "front_door_ports" not in raw:
        return None
    ports = raw["front_door_ports"]
    key = f"{where}.front_door_ports"
    if not isinstance(ports, list) or not ports:
        raise _err(src, key, f"want a non-empty list of ports, got {show(ports)}")
    for p in ports:
        if isinstance(p, bool) or not isinstance(p, int) or not 0 < p <= 65535:
            raise _err(src, key, f"{show(p)} is not a port (1-65535)")
    return FrontDoorConfig(frozenset(ports))


def validate(raw: object, source: str) -> Config:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise _err(source, "(top level)", f"want a mapping, got {type(raw).__name__}")
    unknown = unknown_key(raw, TOP_KEYS)
    if unknown:
        raise _err(source, *unknown)
    listen = parse_listen(raw.get("listen", f":{DEFAULT_PORT}"), "listen", source)
    interval = _seconds(raw, INTERVAL, source)
    threshold = _seconds(raw, PARK_THRESHOLD, source)
    bpf_stats, stacks = (
        _flag(raw, k, d, source) for k, d in (("bpf_stats", False), ("stacks", True))
    )
    targets_raw = raw.get("targets")
    if not isinstance(targets_raw, list) or not targets_raw:
        raise _err(source, "targets", f"want a non-empty list of targets, got {show(targets_raw)}")
    targets = tuple(_target(t, i, source) for i, t in enumerate(targets_raw))
    names = [t.name for t in targets]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup:
        raise _err(source, "targets", f"name {dup!r} is used twice")
    max_services = _max_services(raw, "max_services", source, MAX_SERVICES)
    return Config(
        listen,
        interval,
        threshold,
        targets,
        source,
        bpf_stats,
        stacks,
        max_services,
        status_socket(raw.get("status_socket", DEFAULT_STATUS_SOCKET), "status_socket", source),
        _status_group(raw.get("status_group", DEFAULT_STATUS_GROUP), source),
    )


def status_socket(value: object, key: str = "status_socket", source: str = "--socket") -> str:
    """An absolute path a unix socket can be bound at."""
    if not isinstance(value, str) or not value.startswith("/") or value.endswith("/"):
        raise _err(source, key, f"want an absolute path to a socket file, got {show(value)}")
    if "\0" in value or len(value.encode()) > MAX_SOCKET_PATH:
        raise _err(source, key, f"{show(value)}: at most {MAX_SOCKET_PATH} bytes, no NUL")
    return value


def _status_group(value: object, source: str) -> str:
    """A group name; a group the host does not have is no error (the socket is then
    root's alone, and the daemon says how to make the group)."""
    if not isinstance(value, str) or not _GROUP.fullmatch(value):
        raise _err(source, "status_group", f"want a group name, got {show(value)}")
    return value


def _flag(raw: Mapping[Any, Any], key: str, default: bool, source: str) -> bool:
    value = raw.get(key, default)
    if not isinstance(value, bool):
        raise _err(source, key, f"want true or false, got {show(value)}")
    return value


def load_text(text: str, source: str) -> Config:
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        what = " ".join(str(e).split())
        raise UsageError(f"config {source}: not valid YAML: {what}") from None
    except RecursionError:  # "[[[[..." thousands deep
        raise UsageError(f"config {source}: not valid YAML: nested too deeply") from None
    return validate(raw, source)


def default_text() -> str:
    """The built-in config, as shipped (`hangwatch run --print-default-config`)."""
    return resources.files("agent").joinpath("default-config.yaml").read_text()


def untrusted(path: str) -> str | None:
    """Why a file that steers the agent (its config, the web config and the TLS files it
    names) cannot be trusted, or None. The agent runs as root, so a file that someone else
    could change would let them steer it (which processes to read, which key to serve): as
    sshd does, the file and every directory above it (as written and once resolved) must be
    owned by root or by the agent's own user and writable by no one else. A directory that
    others may write is accepted with the sticky bit (/tmp: they cannot replace what they do
    not own) or on a read-only mount (a Kubernetes ConfigMap's 0777 directories)."""
    us = {0, os.geteuid()}
    full = os.path.abspath(path)
    seen: set[str] = set()
    for start in (full, os.path.realpath(full)):
        here = start
        while here not in seen:
            seen.add(here)
            try:
                st = os.stat(here)
            except OSError:
                return None  # the open that follows says why it cannot be read
            if st.st_uid not in us:
                return f"{here} is owned by uid {st.st_uid}, not by root"
            if st.st_mode & 0o022 and not (
                (stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX)
                or os.statvfs(here).f_flag & os.ST_RDONLY
            ):
                return f"{here} is writable by others (mode {stat.S_IMODE(st.st_mode):04o})"
            if here == "/":
                break
            here = os.path.dirname(here)
    return None


def check_trusted(path: str, what: str) -> None:
    why = untrusted(path)
    if why is not None:
        raise UsageError(
            f"{what} {path}: {why}; refusing it: anyone who can change it could steer hangwatch",
            "make it and its directories owned by root and not writable by others "
            "(chown root, chmod go-w)",
        )


def load(path: str | None) -> Config:
    """The config at ``path``, or the built-in default."""
    if path is None:
        return load_text(default_text(), "built-in default")
    check_trusted(path, "config")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise UsageError(f"config {path}: cannot read it: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise UsageError(f"config {path}: not UTF-8 text (byte {e.start})") from None
    if len(text) > MAX_CONFIG_BYTES:
        raise UsageError(f"config {path}: larger than {MAX_CONFIG_BYTES} characters")
    return load_text(text, path)
