"""Files a watched process names, read with its view and its rights, never the agent's.

A name a target chose (a Python frame's ``co_filename``, which ``compile()`` sets to anything;
the path of an object it maps), opened by root as ``/proc/PID/root`` + name, would resolve
``..`` and symlinks against the agent's root and read what the target could not. So each is
resolved inside the target's root and read by a child of this module that has taken the
target's file-system ids, fixed once by ``Target`` before anything is read on its behalf, and
dropped every capability; the child is killed at its timeout and reads a bounded amount. What
comes back is what the target could have read itself, or a short reason per name
(docs/security.md, "Rights fixed before the read").
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import socket
import stat
import subprocess
import sys
from collections import deque
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

TIMEOUT_S = 2.0  # one batch: a local file system answers in milliseconds
MAX_FILE_BYTES = 4 << 20  # of one source file: more is not source anyone reads by line
MAX_LINE_CHARS = 400  # of one line returned
MAX_FILES = 512  # names in one batch
MAX_SYMLINKS = 40  # in one resolution, as the kernel's own limit
MAX_FDS_PER_MESSAGE = 200  # below SCM_MAX_FD (253)
# All a child of ours inherits of our environment (this one, and py-spy): a PATH.
CHILD_ENV = {"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8"}

# Why a name gave no line (the JSON's "code_withheld"): one short phrase each.
RELATIVE = "relative file name"
NOT_FOUND = "no such file in the target's root"
NOT_READABLE = "not readable by the target"
NOT_REGULAR = "not a regular file"
LOOP = "a symlink loop"
TOO_LARGE = "larger than 4 MiB"
NO_LINE = "no such line"
NO_CREDENTIALS = "the agent cannot take the target's credentials"
GONE = "the target is gone"
CHANGED = "the target changed identity during the read"
SETID = "the target runs a setuid or setgid image"
NOT_DUMPABLE = "the target is not dumpable"
TIMED_OUT = "not read in time"
FAILED = "could not be read"

# openat2(2), include/uapi/linux/openat2.h. NO_XDEV is left out on purpose: the walk runs in
# the target's own mount namespace, so a mount it crosses is one the target sees, and NO_XDEV
# would refuse a /home or /app on its own file system, a bind mount in a container.
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_IN_ROOT = 0x10
SYS_OPENAT2 = 437  # the same number on every architecture (the generic table's)
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4


@dataclass(frozen=True)
class Credentials:
    """What the kernel checks a file access against: the file-system uid and gid (the fourth
    field of ``Uid:`` and ``Gid:`` in /proc/PID/status) and the supplementary groups."""

    uid: int
    gid: int
    groups: tuple[int, ...] = ()


def credentials(status_text: str) -> Credentials | None:
    """From /proc/PID/status; None when a line is missing or malformed."""
    uid = gid = None
    groups: tuple[int, ...] = ()
    try:
        for line in status_text.splitlines():
            key, _, rest = line.partition(":")
            if key == "Uid":
                uid = int(rest.split()[3])
            elif key == "Gid":
                gid = int(rest.split()[3])
            elif key == "Groups":
                groups = tuple(int(g) for g in rest.split())
    except (ValueError, IndexError):
        return None
    if uid is None or gid is None or uid < 0 or gid < 0:
        return None
    return Credentials(uid, gid, groups)


@dataclass(frozen=True)
class FileLines:
    """The lines asked for of one file (1-based; only those that exist and are not blank), or
    why there are none; ``short``: the name from the topmost directory that is a Python
    package (``uvicorn/server.py``), as py-spy would shorten it, checked with the target's
    view and rights too."""

    lines: Mapping[int, str] = field(default_factory=dict)
    withheld: str | None = None
    short: str | None = None


# --- resolution inside a root (used by the child, and tested on its own) -----------------


class _Errno(OSError):
    def __init__(self, code: int) -> None:
        super().__init__(code, os.strerror(code))


class _NotRegular(_Errno):
    """A directory, FIFO, socket or device: never opened for reading."""


_libc = ctypes.CDLL(None, use_errno=True)


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def openat2_in_root(root_fd: int, path: str) -> int:
    """An O_PATH fd on ``path`` resolved inside ``root_fd`` by the kernel. Raises OSError
    (ENOSYS on kernels before 5.6)."""
    how = _OpenHow(os.O_PATH | os.O_CLOEXEC, 0, RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)
    fd = _libc.syscall(
        ctypes.c_long(SYS_OPENAT2),
        ctypes.c_int(root_fd),
        ctypes.c_char_p(os.fsencode(path)),
        ctypes.byref(how),
        ctypes.c_size_t(ctypes.sizeof(how)),
    )
    if fd < 0:
        raise _Errno(ctypes.get_errno())
    return int(fd)


def _parts(path: str) -> list[str]:
    return [p for p in path.split("/") if p]


def walk_in_root(root_fd: int, path: str) -> int:
    """The same as ``openat2_in_root`` without openat2: one component at a time, each opened
    ``O_PATH | O_NOFOLLOW`` in the directory before it. ``..`` goes back to the directory it
    came from and never above the root; a symlink's text is read and resolved by these same
    rules (an absolute one from the root again), so the kernel never follows one (nor a magic
    link: /proc/PID/root reads as text like any other)."""
    stack = [os.dup(root_fd)]  # directories from the root down
    todo = deque(_parts(path))
    links = 0
    must_be_dir = path.endswith("/")
    try:
        while todo:
            name = todo.popleft()
            if name == ".":
                continue
            if name == "..":
                if len(stack) > 1:
                    os.close(stack.pop())
                continue
            fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=stack[-1])
            mode = os.fstat(fd).st_mode
            if stat.S_ISLNK(mode):
                links += 1
                try:
                    if links > MAX_SYMLINKS:
                        raise _Errno(errno.ELOOP)
                    target = os.readlink(name, dir_fd=stack[-1])
                finally:
                    os.close(fd)
                if target.startswith("/"):
                    while len(stack) > 1:
                        os.close(stack.pop())
                todo.extendleft(reversed(_parts(target)))
                continue
            stack.append(fd)
            if (todo or must_be_dir) and not stat.S_ISDIR(mode):
                raise _Errno(errno.ENOTDIR)
        return stack.pop() if len(stack) > 1 else os.dup(stack[0])
    finally:
        for fd in stack:
            os.close(fd)


def open_in_root(root_fd: int, path: str) -> int:
    """An O_PATH fd on ``path`` as the target's root sees it; the kernel's openat2 first."""
    try:
        return openat2_in_root(root_fd, path)
    except OSError as e:
        if e.errno not in (errno.ENOSYS, errno.E2BIG, errno.EINVAL):
            raise
    return walk_in_root(root_fd, path)


def reopen_regular(path_fd: int) -> int:
    """An O_RDONLY fd on the regular file behind an O_PATH fd; the open checks the caller's
    rights (reopening through /proc/self/fd is an ordinary open of that inode)."""
    if not stat.S_ISREG(os.fstat(path_fd).st_mode):
        raise _NotRegular(errno.EISDIR)
    return os.open(f"/proc/self/fd/{path_fd}", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)


def open_regular(root_fd: int, path: str) -> int:
    """An O_RDONLY fd on the regular file ``path`` names inside ``root_fd``."""
    pfd = open_in_root(root_fd, path)
    try:
        return reopen_regular(pfd)
    finally:
        os.close(pfd)


def _reason(e: OSError) -> str:
    if isinstance(e, _NotRegular) or e.errno == errno.EISDIR:
        return NOT_REGULAR
    if e.errno in (errno.EACCES, errno.EPERM):
        return NOT_READABLE
    if e.errno in (errno.ENOENT, errno.ENOTDIR, errno.EXDEV):
        return NOT_FOUND
    if e.errno == errno.ELOOP:
        return LOOP
    return FAILED


# --- the child: take the target's rights, then read ----------------------------------------


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def _capabilities() -> int:
    header, data = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0), (_CapData * 2)()
    if _libc.capget(ctypes.byref(header), data) != 0:
        raise _Errno(ctypes.get_errno())
    return data[0].effective | data[0].permitted | data[1].effective | data[1].permitted


def _drop_capabilities() -> None:
    header, data = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0), (_CapData * 2)()
    _libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    if _libc.capset(ctypes.byref(header), data) != 0:
        raise _Errno(ctypes.get_errno())


def take_credentials(who: Credentials) -> None:
    """Become ``who`` for every file access, with no capability left; raises OSError when
    the agent may not (no CAP_SETUID/CAP_SETGID and ``who`` is not already us). Only in a
    single-threaded child: the change is the whole process's."""
    theirs = {who.gid, *who.groups}
    # Groups we cannot change are still safe when they are a subset of the target's: fewer
    # rights, never more (root under systemd and a root target often differ only there).
    if set(os.getgroups()) != set(who.groups):
        try:
            os.setgroups(list(who.groups))
        except PermissionError:
            if not set(os.getgroups()) <= theirs:
                raise
    if set(os.getresgid()) != {who.gid}:
        try:
            os.setresgid(who.gid, who.gid, who.gid)
        except PermissionError:
            if not set(os.getresgid()) <= theirs:
                raise
    if set(os.getresuid()) != {who.uid}:
        os.setresuid(who.uid, who.uid, who.uid)
    _drop_capabilities()
    _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    if _capabilities() != 0 or set(os.getresuid()) != {who.uid}:
        raise _Errno(errno.EPERM)


def _read_file(root_fd: int, path: str) -> tuple[list[str] | None, str | None]:
    try:
        fd = open_regular(root_fd, path)
    except OSError as e:
        return None, _reason(e)
    try:
        with os.fdopen(fd, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        return None, _reason(e)
    if len(data) > MAX_FILE_BYTES:
        return None, TOO_LARGE
    return data.decode("utf-8", errors="replace").splitlines(), None


def _exists(root_fd: int, path: str) -> bool:
    try:
        os.close(open_in_root(root_fd, path))
        return True
    except OSError:
        return False


def short_name(path: str, is_file: Any) -> str:
    """py-spy's short file name: the path below the topmost directory of the chain of Python
    packages (directories with an ``__init__.py``) that holds the file. ``is_file(path)``
    answers for the target's root."""
    parts = [p for p in _parts(path) if p != "."]
    keep = 1
    while keep < len(parts) and is_file("/" + "/".join([*parts[:-keep], "__init__.py"])):
        keep += 1
    return "/".join(parts[-keep:]) if parts else path


def _serve_lines(root_fd: int, files: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for item in files[:MAX_FILES]:
        path, wanted = str(item["path"]), [int(n) for n in item["lines"]]
        lines, why = _read_file(root_fd, path)
        got: dict[str, str] = {}
        if lines is not None:
            for n in wanted:
                if 1 <= n <= len(lines) and lines[n - 1].strip():
                    got[str(n)] = lines[n - 1].strip()[:MAX_LINE_CHARS]
        out.append(
            {
                "path": path,
                "lines": got,
                "withheld": why,
                "short": short_name(path, lambda p: _exists(root_fd, p)),
            }
        )
    return out


def _serve_objects(root_fd: int, paths: Sequence[str], sock: socket.socket) -> list[str | None]:
    """Opens each object and sends the fds over ``sock``, in order; the answer says, per
    path, whether an fd was sent or why not."""
    fds: list[int] = []
    out: list[str | None] = []
    try:
        for path in paths[:MAX_FILES]:
            try:
                fds.append(open_regular(root_fd, path))
                out.append(None)
            except OSError as e:
                out.append(_reason(e))
        for i in range(0, len(fds), MAX_FDS_PER_MESSAGE):
            socket.send_fds(sock, [b"f"], fds[i : i + MAX_FDS_PER_MESSAGE])
    finally:
        for fd in fds:
            os.close(fd)
    return out


def _child_main() -> int:
    """The child, run as ``python -I -B -m agent.sources.confined``; it imports nothing from
    the rest of the agent, and nothing once it has dropped its rights. Request on stdin:
    {"uid", "gid", "groups", "root_fd", "op": "lines"|"objects", "files" | "paths", "sock"}.
    Answer on stdout (JSON); the fds of ELF objects go back over the socket pair ``sock``."""
    req = json.load(sys.stdin)
    try:
        take_credentials(Credentials(int(req["uid"]), int(req["gid"]), tuple(req["groups"])))
    except OSError:
        json.dump({"error": NO_CREDENTIALS}, sys.stdout)
        return 0
    root_fd = int(req["root_fd"])
    if req["op"] == "lines":
        json.dump({"files": _serve_lines(root_fd, req["files"])}, sys.stdout)
    else:
        sock = socket.socket(fileno=int(req["sock"]))
        json.dump({"objects": _serve_objects(root_fd, req["paths"], sock)}, sys.stdout)
    return 0


# --- the parent ------------------------------------------------------------------------------


def _ids(text: str, key: str) -> tuple[int, int, int, int] | None:
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name == key:
            try:
                got = tuple(int(x) for x in rest.split())
            except ValueError:
                return None
            return (got[0], got[1], got[2], got[3]) if len(got) == 4 else None
    return None


def start_ticks(stat_text: str) -> int | None:
    """Field 22 of /proc/PID/stat (after the parenthesised comm, which may hold anything);
    None for a process that has exited (a zombie, not yet reaped: no memory, no files)."""
    fields = stat_text.rpartition(")")[2].split()
    try:
        return int(fields[19]) if fields[0] not in ("Z", "X") else None
    except (IndexError, ValueError):
        return None


@dataclass(frozen=True)
class Identity:
    """Who a process is, as far as what it may read goes: taken once, before anything is
    read on its behalf, and compared after each read that depends on it. An exec keeps the
    PID and start time but changes the executable and, for a setuid image, the ids; a reused
    PID changes the start time; a process that gained or dropped privileges is made
    non-dumpable by the kernel, which then gives the files in its /proc directory to root."""

    start_ticks: int
    uids: tuple[int, int, int, int]  # real, effective, saved, file-system (/proc/PID/status)
    gids: tuple[int, int, int, int]
    groups: tuple[int, ...]
    exe: tuple[int, int] | None  # (st_dev, st_ino) of /proc/PID/exe; None when it has none
    owner: tuple[int, int]  # of /proc/PID/stat: its effective ids unless it is not dumpable

    @property
    def creds(self) -> Credentials:
        return Credentials(self.uids[3], self.gids[3], self.groups)

    @property
    def refusal(self) -> str | None:
        """Why nothing may be read on its behalf at all: a setuid or setgid image (its
        rights are not its user's), or a process the kernel made non-dumpable (it changed
        credentials: even its own user may not read its memory)."""
        if len(set(self.uids)) > 1 or len(set(self.gids)) > 1:
            return SETID
        if self.owner != (self.uids[1], self.gids[1]):
            return NOT_DUMPABLE
        return None


def identity(proc_fd: int) -> Identity | None:
    """The identity of the process whose /proc directory ``proc_fd`` is; None when it is
    gone (an fd on /proc/PID stays with that process: a reused PID is never read through
    it) or a file does not parse."""
    try:
        with open(os.open("stat", os.O_RDONLY | os.O_CLOEXEC, dir_fd=proc_fd), "rb") as f:
            ticks = start_ticks(f.read(4096).decode(errors="replace"))
            # A file, not the directory: /proc/PID itself always shows the effective ids.
            st = os.fstat(f.fileno())
        with open(os.open("status", os.O_RDONLY | os.O_CLOEXEC, dir_fd=proc_fd), "rb") as f:
            status = f.read(1 << 16).decode(errors="replace")
        try:
            exe = os.stat("exe", dir_fd=proc_fd)
            exe_id: tuple[int, int] | None = (exe.st_dev, exe.st_ino)
        except FileNotFoundError:
            exe_id = None  # a kernel thread, or a tree without one: nothing to compare
    except OSError:
        return None
    uids, gids, creds = _ids(status, "Uid"), _ids(status, "Gid"), credentials(status)
    if ticks is None or uids is None or gids is None or creds is None:
        return None
    return Identity(ticks, uids, gids, creds.groups, exe_id, (st.st_uid, st.st_gid))


class Target:
    """A process fixed for the reads made on its behalf: its identity, an fd on its /proc
    directory and one on its root, all taken at one moment. Every later read uses these
    (the confined child takes ``identity.creds``, never ones read again), and ``changed``
    says whether the process is still the one they were taken from. Close it when done."""

    def __init__(self, pid: int, proc_fd: int, root_fd: int, ident: Identity) -> None:
        self.pid = pid
        self.proc_fd = proc_fd
        self.root_fd = root_fd
        self.identity = ident

    @classmethod
    def take(cls, pid: int, proc_root: str = "/proc", start: int | None = None) -> Target | str:
        """The target ``pid`` now (and started at ``start`` ticks, when given), or why not."""
        try:
            proc_fd = os.open(
                os.path.join(proc_root, str(pid)), os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC
            )
        except OSError:
            return GONE
        try:
            root_fd = os.open("root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=proc_fd)
        except OSError:
            os.close(proc_fd)
            return GONE
        ident = identity(proc_fd)  # after the root: the root is the process's whose ids these are
        if ident is None or (start is not None and ident.start_ticks != start):
            os.close(root_fd)
            os.close(proc_fd)
            return GONE
        return cls(pid, proc_fd, root_fd, ident)

    @property
    def creds(self) -> Credentials:
        return self.identity.creds

    @property
    def refusal(self) -> str | None:
        return self.identity.refusal

    def changed(self) -> str | None:
        """None while the process is the one taken (same start time, executable, ids and
        dumpability); else why its reads cannot be trusted: gone, or changed."""
        now = identity(self.proc_fd)
        if now is None:
            return GONE
        return None if now == self.identity else CHANGED

    def close(self) -> None:
        for fd in (self.root_fd, self.proc_fd):
            if fd >= 0:
                os.close(fd)
        self.root_fd = self.proc_fd = -1

    def __enter__(self) -> Target:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _run_child(
    t: Target, request: dict[str, Any], timeout_s: float, extra_fds: Sequence[int] = ()
) -> dict[str, Any] | str:
    """The child's answer, or why there is none."""
    request = {
        **request,
        "uid": t.creds.uid,
        "gid": t.creds.gid,
        "groups": list(t.creds.groups),
        "root_fd": t.root_fd,
    }
    try:
        child = subprocess.Popen(
            # -I: none of our environment or cwd steers it; -B: it writes no bytecode
            [sys.executable, "-I", "-B", "-m", "agent.sources.confined"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            pass_fds=(t.root_fd, *extra_fds),
            cwd="/",
            env=CHILD_ENV,
        )
    except OSError:
        return FAILED
    try:
        out, _ = child.communicate(json.dumps(request).encode(), timeout=timeout_s)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        return TIMED_OUT
    if child.returncode != 0:
        return FAILED
    try:
        answer = json.loads(out)
    except ValueError:
        return FAILED
    if not isinstance(answer, dict):
        return FAILED
    if "error" in answer:
        return str(answer["error"])
    return answer


def _fixed(target: int | Target, proc_root: str) -> tuple[Target | str, bool]:
    """``target`` itself, or the process ``target`` names taken now; and whether it is
    ours to close."""
    if isinstance(target, Target):
        return target, False
    return Target.take(target, proc_root), True


def read_lines(
    target: int | Target,
    wanted: Mapping[str, Collection[int]],
    proc_root: str = "/proc",
    timeout_s: float = TIMEOUT_S,
) -> dict[str, FileLines]:
    """The lines asked for of each file the target names, as it would read them: with the
    identity fixed in ``target`` (a PID is taken now), and none when that identity refuses
    reads or changed before the child was done. Every name gets an answer; never raises."""
    out: dict[str, FileLines] = {}
    todo = {}
    for path, nums in wanted.items():
        if not path.startswith("/"):
            out[path] = FileLines(withheld=RELATIVE)
        else:
            todo[path] = sorted({n for n in nums if n >= 1})
    if not todo:
        return out
    t, owned = _fixed(target, proc_root)
    if isinstance(t, str):
        return {**out, **{p: FileLines(withheld=t) for p in todo}}
    try:
        answer: dict[str, Any] | str | None = t.refusal
        if answer is None:
            files = [{"path": p, "lines": n} for p, n in list(todo.items())[:MAX_FILES]]
            answer = _run_child(t, {"op": "lines", "files": files}, timeout_s)
            answer = t.changed() or answer  # lines of another process's files: not shown
    finally:
        if owned:
            t.close()
    if isinstance(answer, str):
        return {**out, **{p: FileLines(withheld=answer) for p in todo}}
    for item in answer.get("files", []):
        path = str(item.get("path"))
        if path not in todo:
            continue
        lines = {int(n): str(s) for n, s in (item.get("lines") or {}).items()}
        why = item.get("withheld")
        if why is None and not lines:
            why = NO_LINE
        out[path] = FileLines(lines, why, item.get("short"))
    for path in todo:
        out.setdefault(path, FileLines(withheld=FAILED))
    return out


def open_objects(
    target: int | Target,
    paths: Sequence[str],
    proc_root: str = "/proc",
    timeout_s: float = TIMEOUT_S,
) -> dict[str, int | str]:
    """Read-only fds on the files the target names (its mapped objects), opened as it would
    open them with the identity fixed in ``target``, or why not. The caller owns (and
    closes) every fd returned."""
    names = [p for p in dict.fromkeys(paths) if p.startswith("/")][:MAX_FILES]
    out: dict[str, int | str] = {p: RELATIVE for p in paths if not p.startswith("/")}
    if not names:
        return out
    t, owned = _fixed(target, proc_root)
    if isinstance(t, str):
        return {**out, **dict.fromkeys(names, t)}
    if t.refusal is not None:
        if owned:
            t.close()
        return {**out, **dict.fromkeys(names, t.refusal)}
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    received: list[int] = []
    try:
        answer = _run_child(
            t,
            {"op": "objects", "paths": names, "sock": theirs.fileno()},
            timeout_s,
            extra_fds=(theirs.fileno(),),
        )
        theirs.close()
        if isinstance(answer, str):
            return {**out, **dict.fromkeys(names, answer)}
        results = answer.get("objects") or []
        want = sum(1 for r in results if r is None)
        ours.settimeout(timeout_s)
        while len(received) < want:
            _, fds, _, _ = socket.recv_fds(ours, 16, MAX_FDS_PER_MESSAGE)
            if not fds:
                break
            received.extend(fds)
        why_not = t.changed()
        if why_not is not None:  # opened for another process than the one taken
            for got in received:
                os.close(got)
            received = []
            return {**out, **dict.fromkeys(names, why_not)}
        it = iter(received)
        for path, why in zip(names, results):
            if why is None:
                fd = next(it, None)
                out[path] = fd if fd is not None else FAILED
            else:
                out[path] = str(why)
        for fd in it:  # more than were announced: not ours to keep
            os.close(fd)
        received = []
        for path in names:
            out.setdefault(path, FAILED)
        return out
    except OSError:
        for fd in received:
            os.close(fd)
        return {**out, **dict.fromkeys(names, FAILED)}
    finally:
        ours.close()
        if theirs.fileno() >= 0:
            theirs.close()
        if owned:
            t.close()


if __name__ == "__main__":
    sys.exit(_child_main())
