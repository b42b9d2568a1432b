"""agent/sources/confined.py: a name the target chose resolves inside its root, and nowhere else.

The rule is the kernel's RESOLVE_IN_ROOT: ``..`` stops at the root, an absolute symlink starts
again from it, a magic link is refused. The walk used where openat2 is missing must agree
with the kernel on every tree and name, and neither may ever reach a file outside the root.
No root needed: openat2 and the walk work for any user.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.sources import confined
from agent.sources.confined import (
    Credentials,
    credentials,
    open_in_root,
    openat2_in_root,
    walk_in_root,
)

STATUS = """Name:\tpython3
Umask:\t0022
State:\tS (sleeping)
Uid:\t1000\t1001\t1002\t1003
Gid:\t2000\t2001\t2002\t2003
FDSize:\t64
Groups:\t4 24 27
"""


def test_credentials_are_the_file_system_ids_and_groups() -> None:
    assert credentials(STATUS) == Credentials(1003, 2003, (4, 24, 27))
    assert credentials(STATUS.replace("Groups:\t4 24 27", "Groups:\t")) == Credentials(1003, 2003)


@pytest.mark.parametrize(
    "broken",
    [
        STATUS.replace("Uid:\t1000\t1001\t1002\t1003\n", ""),
        STATUS.replace("Gid:\t2000\t2001\t2002\t2003", "Gid:\t2000"),
        STATUS.replace("Groups:\t4 24 27", "Groups:\t4 x"),
        "",
    ],
)
def test_credentials_that_cannot_be_read_are_none(broken: str) -> None:
    assert credentials(broken) is None


@contextmanager
def opened(path: Path) -> Iterator[int]:
    fd = os.open(path, os.O_PATH | os.O_DIRECTORY)
    try:
        yield fd
    finally:
        os.close(fd)


def identity(fd: int) -> tuple[int, int]:
    try:
        st = os.fstat(fd)
        return st.st_dev, st.st_ino
    finally:
        os.close(fd)


def resolve(how, root_fd: int, path: str) -> tuple[int, int] | str:
    """(dev, ino) of what ``path`` leads to, or "error"."""
    try:
        return identity(how(root_fd, path))
    except OSError:
        return "error"


@pytest.fixture
def world(tmp_path: Path) -> tuple[Path, Path]:
    """A root with a few files, symlinks that try to leave it, and a secret just outside."""
    root = tmp_path / "root"
    (root / "app").mkdir(parents=True)
    (root / "etc").mkdir()
    (root / "app" / "ok.py").write_text("ok\n")
    (root / "etc" / "passwd").write_text("theirs\n")
    secret = tmp_path / "secret"
    secret.write_text("ours\n")
    (root / "app" / "abs").symlink_to(secret)  # absolute, to the outside
    (root / "app" / "dots").symlink_to("../../../secret")  # relative, climbing out
    (root / "app" / "etc").symlink_to("/etc")  # absolute, to the root's own /etc
    (root / "app" / "proc").symlink_to("/proc/self/root")  # through a magic link, as text
    (root / "loop").symlink_to("loop")
    return root, secret


@pytest.mark.parametrize("how", [openat2_in_root, walk_in_root], ids=["openat2", "walk"])
def test_names_resolve_inside_the_root(world: tuple[Path, Path], how) -> None:
    root, secret = world
    with opened(root) as fd:
        mine = resolve(how, fd, "/app/ok.py")
        assert mine == identity(os.open(root / "app" / "ok.py", os.O_PATH))
        theirs = identity(os.open(root / "etc" / "passwd", os.O_PATH))
        assert resolve(how, fd, "/app/etc/passwd") == theirs  # /etc of the root, not ours
        assert resolve(how, fd, "/../../../../etc/passwd") == theirs  # .. stops at the root
        assert resolve(how, fd, "/app/../app/./ok.py") == mine
        for escape in (
            "/app/abs",
            "/app/dots",
            str(secret),
            "/../secret",
            "/app/../../secret",
            "/app/proc/" + str(secret).lstrip("/"),
        ):
            assert resolve(how, fd, escape) == "error", escape
        with pytest.raises(OSError) as loop:
            how(fd, "/loop")
        assert loop.value.errno == errno.ELOOP


def test_a_magic_link_is_never_followed(world: tuple[Path, Path]) -> None:
    """/proc/self/root inside the name: the kernel refuses it (NO_MAGICLINKS); the walk reads
    it as text ("/"), which resolves inside the root again."""
    root, _ = world
    with opened(root) as fd:
        me = f"/proc/{os.getpid()}/root/etc/passwd"
        assert resolve(openat2_in_root, fd, me) == "error"
        assert resolve(walk_in_root, fd, me) == "error"  # the root has no /proc


# --- the walk agrees with the kernel, on any tree -------------------------------------------

NAMES = ["a", "b", "c"]
component = st.sampled_from([*NAMES, "..", "."])
link_target = st.lists(component, min_size=1, max_size=4).flatmap(
    lambda parts: st.sampled_from(["/".join(parts), "/" + "/".join(parts)])
)
tree = st.dictionaries(
    st.lists(st.sampled_from(NAMES), min_size=1, max_size=3).map(tuple),
    st.one_of(st.just("dir"), st.just("file"), link_target),
    max_size=12,
)


# O_NOFOLLOW on a link fails (ELOOP, or ENOTDIR with O_DIRECTORY); not O_PATH, which would
# open the link itself
DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW


def build(base: Path, spec: dict[tuple[str, ...], str]) -> None:
    """Make the drawn tree under ``base`` and nowhere else. Each entry is made relative to its
    parent's descriptor, and every parent is opened with O_NOFOLLOW: an entry whose path passes
    through a link the tree holds (``/a``, ``../..``) is not made, instead of landing wherever
    that link leads (once at the file system's root)."""
    for parts, kind in sorted(spec.items(), key=lambda kv: len(kv[0])):
        parent = os.open(base, DIRECTORY)
        try:
            for step in parts[:-1]:
                child = os.open(step, DIRECTORY, dir_fd=parent)
                os.close(parent)
                parent = child
            name = parts[-1]
            # each call refuses an existing entry (EEXIST), a link included, and follows none
            if kind == "dir":
                os.mkdir(name, dir_fd=parent)
            elif kind == "file":
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                fd = os.open(name, flags, 0o644, dir_fd=parent)
                try:
                    os.write(fd, "/".join(parts).encode())
                finally:
                    os.close(fd)
            else:
                os.symlink(kind, name, dir_fd=parent)
        except OSError:
            continue  # a parent missing, not a directory, or a link: the entry is not made
        finally:
            os.close(parent)


@settings(max_examples=300, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=tree, outside=tree, name=st.lists(component, min_size=1, max_size=6))
def test_the_walk_agrees_with_openat2_and_never_leaves(
    tmp_path_factory: pytest.TempPathFactory, spec, outside, name
) -> None:
    base = tmp_path_factory.mktemp("w")
    root = base / "root"
    root.mkdir()
    build(root, spec)
    build(base, outside)  # beside the root: what an escape would reach
    inside = set()
    for dirpath, dirnames, filenames in os.walk(root):
        for n in [*dirnames, *filenames, "."]:
            st_ = os.lstat(os.path.join(dirpath, n))
            inside.add((st_.st_dev, st_.st_ino))
    path = "/" + "/".join(name)
    with opened(root) as fd:
        kernel, walked = resolve(openat2_in_root, fd, path), resolve(walk_in_root, fd, path)
    assert walked == kernel, path
    assert walked == "error" or walked in inside, path


def test_open_in_root_falls_back_to_the_walk(world: tuple[Path, Path], monkeypatch) -> None:
    root, _ = world

    def no_openat2(root_fd: int, path: str) -> int:
        raise OSError(errno.ENOSYS, "no openat2")

    monkeypatch.setattr(confined, "openat2_in_root", no_openat2)
    with opened(root) as fd:
        assert resolve(open_in_root, fd, "/app/etc/passwd") == identity(
            os.open(root / "etc" / "passwd", os.O_PATH)
        )
        assert resolve(open_in_root, fd, "/app/abs") == "error"


def test_only_a_regular_file_is_opened(tmp_path: Path) -> None:
    """A FIFO would block an open for reading; a device's open can act. Neither is opened."""
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "file").write_text("x\n")
    (tmp_path / "dir").mkdir()
    with opened(tmp_path) as fd:
        for name in ("fifo", "dir"):
            pfd = open_in_root(fd, name)
            try:
                with pytest.raises(OSError):
                    confined.reopen_regular(pfd)
            finally:
                os.close(pfd)
        pfd = open_in_root(fd, "file")
        try:
            with os.fdopen(confined.reopen_regular(pfd)) as f:
                assert f.read() == "x\n"
        finally:
            os.close(pfd)


def test_short_names_stop_at_the_topmost_package() -> None:
    files = {"/srv/a/__init__.py", "/srv/a/b/__init__.py"}
    assert confined.short_name("/srv/a/b/c.py", files.__contains__) == "a/b/c.py"
    assert confined.short_name("/srv/x/c.py", files.__contains__) == "c.py"
    assert confined.short_name("/c.py", files.__contains__) == "c.py"


# --- the target's identity, fixed before the reads and checked after -----------------------

STAT = "42 (a) b) S 1 42 42 0 -1 4194560 1 0 0 0 0 0 0 0 20 0 1 0 {start} 1 1 1 1 1 1\n"


def _fake_target(tmp_path: Path, uids: str = "", gids: str = "") -> Path:
    """Process 42 in a tree of our own: our ids (or those given), started at tick 777."""
    me = f"{os.getuid()}\t" * 4
    mine = f"{os.getgid()}\t" * 4
    pid = tmp_path / "42"
    (pid / "root").mkdir(parents=True)
    (pid / "stat").write_text(STAT.format(start=777))
    (pid / "status").write_text(f"Uid:\t{uids or me}\nGid:\t{gids or mine}\nGroups:\t\n")
    return pid


def test_the_start_time_is_field_22_whatever_the_name_holds() -> None:
    assert confined.start_ticks(STAT.format(start=777)) == 777
    assert confined.start_ticks("42 (x) S") is None


def test_a_target_is_fixed_with_its_ids_start_time_and_root(tmp_path: Path) -> None:
    _fake_target(tmp_path)
    t = confined.Target.take(42, str(tmp_path))
    assert isinstance(t, confined.Target)
    with t:
        assert t.identity.start_ticks == 777
        assert t.creds == Credentials(os.getuid(), os.getgid())
        assert t.refusal is None and t.changed() is None
    assert confined.Target.take(42, str(tmp_path), start=778) == confined.GONE  # not that one
    assert confined.Target.take(43, str(tmp_path)) == confined.GONE


@pytest.mark.parametrize(
    ("uids", "gids", "why"),
    [
        ("1000\t0\t0\t0", "", confined.SETID),  # su, before it dropped to its user
        ("", "1000\t42\t42\t42", confined.SETID),  # a setgid image
        ("65534\t65534\t65534\t65534", "65534\t65534\t65534\t65534", confined.NOT_DUMPABLE),
    ],
)
def test_a_setuid_or_non_dumpable_target_is_not_read_for(
    tmp_path: Path, uids: str, gids: str, why: str
) -> None:
    """Ids that differ: a setuid or setgid image. Ids that are not those of the owner of the
    files in its /proc directory: the kernel gave them to root, the sign of a process it
    made non-dumpable (here: files of ours for a process of nobody's)."""
    if why == confined.NOT_DUMPABLE and os.getuid() == 65534:
        pytest.skip("we are nobody")
    _fake_target(tmp_path, uids, gids)
    (tmp_path / "42" / "root" / "app.py").write_text("line\n")
    t = confined.Target.take(42, str(tmp_path))
    assert isinstance(t, confined.Target)
    with t:
        assert t.refusal == why
        got = confined.read_lines(t, {"/app.py": [1]}, str(tmp_path))
        assert got["/app.py"] == confined.FileLines(withheld=why)
        assert confined.open_objects(t, ["/app.py"], str(tmp_path)) == {"/app.py": why}
