"""Fuzzing the input the agent does not control: config files, web config files, and /proc.

A config gives a UsageError or a Config, never another exception. A /proc file with any
bytes at all gives None, an empty list or a value in its field's range: /proc is written by
the kernel, but a comm, a path or a half-read file can hold anything.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.config import TOP_KEYS, load_text, validate
from agent.errors import UsageError
from agent.export.webconfig import parse as parse_web
from agent.sources.procfs import (
    ProcFS,
    parse_cgroup_path,
    parse_epoll_inputs,
    parse_exec_start_ms,
    parse_io_wchar,
    parse_maps_line,
    parse_net_tcp,
    parse_real_uid,
    parse_schedstat,
    parse_stat,
    parse_syscall,
)

# --- config ---------------------------------------------------------------------------------

_scalar = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(-3, 3).map(lambda k: k * 10**4400)  # too long for str()
    | st.floats()  # NaN and infinities too
    | st.text(max_size=20)
    | st.binary(max_size=8)
    | st.sampled_from(["1e9", "-1", ".nan", "a{99999999999}", ":70000", "[::1]:0"])
    | st.integers(1, 3).map(lambda k: "(" * 1000 * k + ")" * 1000 * k)  # deep regex
)
_key = st.text(max_size=12) | st.integers() | st.none() | st.booleans() | st.sampled_from(TOP_KEYS)
_value = st.recursive(
    _scalar,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_key, inner, max_size=4),
    max_leaves=16,
)
_target_key = st.sampled_from(["name", "cmdline", "comm", "pids", "gpu", "nme", "pid"]) | _key
_target = st.dictionaries(_target_key, _value, max_size=6)


def _config_error_only(fn, *args):
    try:
        fn(*args)
    except UsageError as e:
        msg = str(e)
        assert "\n" not in msg, msg
        assert len(msg) < 600, msg  # names the bad value, does not dump it
        assert e.exit_code == 2


@given(_value | st.dictionaries(_key, _value, max_size=5))
def test_validate_any_value(raw):
    _config_error_only(validate, raw, "fuzz.yaml")


@given(st.lists(_target, max_size=4), st.dictionaries(st.sampled_from(TOP_KEYS), _value))
def test_validate_any_targets(targets, rest):
    _config_error_only(validate, {**rest, "targets": targets}, "fuzz.yaml")


# YAML-ish text: the characters YAML gives meaning to, plus keys and words it knows.
_yaml_token = st.sampled_from(
    [
        *TOP_KEYS,
        "name",
        "cmdline",
        "pids",
        "gpu",
        ":",
        " ",
        "\n",
        "  ",
        "- ",
        "[",
        "]",
        "{",
        "}",
        ",",
        "'",
        '"',
        "&a ",
        "*a",
        "!!binary ",
        "!!set ",
        "!!python/name:os.system ",
        "? ",
        "|",
        ">",
        "#",
        "%YAML 1.1\n",
        "---\n",
        "...",
        "1e9",
        "0x1F",
        "0o17",
        "~",
        "yes",
        ".inf",
        "2001-01-01",
        "\t",
        "\x00",
        "\ufeff",
        "é",
    ]
)
_yamlish_text = st.lists(_yaml_token | st.text(max_size=4), max_size=40).map("".join)


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(_yamlish_text | st.text(max_size=200))
def test_load_text_any_document(text):
    _config_error_only(load_text, text, "fuzz.yaml")


@given(_yamlish_text | st.text(max_size=200))
def test_web_config_any_document(text):
    _config_error_only(parse_web, text, "web.yml", "/nonexistent")


@given(st.dictionaries(_key, _value, max_size=4))
def test_web_config_any_structure(raw):
    import yaml

    try:
        text = yaml.safe_dump(raw)
    except (yaml.YAMLError, ValueError, RecursionError):
        return  # not representable: nothing to feed
    _config_error_only(parse_web, text, "web.yml", "/nonexistent")


# --- /proc parsers --------------------------------------------------------------------------

# Text that is almost right is the interesting case: real lines, cut and mutated.
_REAL = {
    "stat": "4242 (py (x) y) S 1 4242 4242 0 -1 4194560 1 0 0 0 3 1 0 0 20 0 9 0 123456 "
    "1000 100 18446744073709551615 1 1 0 0 0 0 0 4096 0 0 0 0 17 1 0 0 0 0 0\n",
    "syscall": "202 0x5613a001c0a0 0x80 0x2 0x0 0x0 0x0 0x7ffd1000 0x7f00aa\n",
    "sched": "py (4242, #threads: 3)\n---------\nse.exec_start   :   265462.412643\n",
    "schedstat": "1000 20 3\n",
    "fdinfo/epoll": "pos:\t0\nflags:\t02\nmnt_id:\t17\nino:\t1039\n"
    "tfd:        4 events: 80000019 data:                4  pos:0 ino:b2721 sdev:9\n",
    "io": "rchar: 1\nwchar: 12345\nsyscr: 2\n",
    "maps": "7f00aa000000-7f00aa021000 rw-p 00000000 00:00 0    [heap]\n",
    "status": "Name:\tpy\nTgid:\t4242\nPid:\t4243\n",
    "net/tcp": "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt"
    "   uid  timeout inode\n   0: 0100007F:1F90 00000000:0000 0A 00000000:00000002 00:00000000"
    " 00000000     0        0 777 1 0000000000000000 100 0 0 10 0\n",
}


def _mutations(real: str) -> st.SearchStrategy[str]:
    cut = st.integers(0, len(real)).map(lambda n: real[:n])
    splice = st.tuples(st.integers(0, len(real)), st.text(max_size=8)).map(
        lambda t: real[: t[0]] + t[1] + real[t[0] :]
    )
    words = st.lists(st.sampled_from(real.split()) | st.text(max_size=6), max_size=60).map(" ".join)
    return cut | splice | words | st.text(max_size=200)


def _uint_or_none(v):
    return v is None or (isinstance(v, int) and 0 <= v < 1 << 64)


@given(_mutations(_REAL["stat"]))
def test_parse_stat_any_text(text):
    s = parse_stat(text)
    if s is not None:
        assert 0 < s.pid < 1 << 31 and 0 <= s.ppid < 1 << 31 and s.start_ticks >= 0
        assert len(s.state) == 1


@given(_mutations(_REAL["syscall"]) | _mutations("-1 0x7ffd1000 0x401000\n"))
def test_parse_syscall_any_text(text):
    sc = parse_syscall(text)
    if sc is not None:
        assert sc.nr == -1 or 0 <= sc.nr < 1 << 16
        assert all(0 <= a < 1 << 64 for a in sc.args) and _uint_or_none(sc.sp)


@given(_mutations(_REAL["sched"]))
def test_parse_exec_start_any_text(text):
    ms = parse_exec_start_ms(text)
    assert ms is None or 0 <= ms < 2.0**64


@given(_mutations(_REAL["fdinfo/epoll"]))
def test_parse_epoll_inputs_any_text(text):
    assert all(_uint_or_none(i) for i in parse_epoll_inputs(text))


@given(_mutations(_REAL["schedstat"]) | _mutations(_REAL["io"]))
def test_parse_counters_any_text(text):
    assert _uint_or_none(parse_schedstat(text))
    assert _uint_or_none(parse_io_wchar(text))


_CGROUP = "12:pids:/system.slice/x.service\n1:name=systemd:/system.slice/x.service\n0::/a\n"
_STATUS = "Name:\tsleep\nUmask:\t0022\nUid:\t65534\t65534\t65534\t65534\nGid:\t0\t0\t0\t0\n"


@given(_mutations(_CGROUP) | _mutations(_STATUS))
def test_parse_origin_any_text(text):
    path = parse_cgroup_path(text)
    assert path is None or (path.startswith("/") and "\n" not in path)
    uid = parse_real_uid(text)
    assert uid is None or 0 <= uid < 1 << 32


@given(_mutations(_REAL["maps"]))
def test_parse_maps_any_line(line):
    m = parse_maps_line(line)
    if m is not None:
        assert 0 <= m.start <= m.end < 1 << 64 and m.inode >= 0


@given(_mutations(_REAL["net/tcp"]), st.sampled_from(["tcp", "tcp6"]))
def test_parse_net_tcp_any_text(text, family):
    for s in parse_net_tcp(text, family):
        assert 0 <= s.port < 1 << 16 and 0 <= s.state < 256 and s.inode >= 0
        assert 0 <= s.tx_queue < 1 << 32 and 0 <= s.rx_queue < 1 << 32


# --- ProcFS on a tree of arbitrary bytes ------------------------------------------------------

_FILES = [
    "stat",
    "status",
    "cmdline",
    "environ",
    "io",
    "maps",
    "net/tcp",
    "net/tcp6",
    "task/7/stat",
    "task/7/schedstat",
    "task/7/sched",
    "task/7/syscall",
]


def _real_or_any(name: str) -> st.SearchStrategy[bytes]:
    real = _REAL.get(name.rsplit("/", 1)[-1] if name.startswith("task/") else name)
    texts = _mutations(real) if real else st.text(max_size=100)
    return texts.map(lambda t: t.encode("utf-8", "surrogatepass")) | st.binary(max_size=200)


@settings(max_examples=150, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.fixed_dictionaries({name: _real_or_any(name) for name in _FILES}))
def test_procfs_never_raises_on_any_bytes(tmp_path_factory: pytest.TempPathFactory, files):
    root = tmp_path_factory.mktemp("proc")
    for name, data in files.items():
        path = root / "7" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    (root / "7" / "fd").mkdir()
    os.symlink("socket:[not-a-number]", root / "7" / "fd" / "3")
    os.symlink("socket:[42]", root / "7" / "fd" / "4")
    proc = ProcFS(str(root))
    assert proc.pids() == [7]
    s = proc.stat(7)
    assert s is None or s.pid > 0
    assert proc.tids(7) == [7]
    assert _uint_or_none(proc.thread_cpu_ns(7, 7))
    assert _uint_or_none(proc.io_wchar(7))
    tgid = proc.tgid_of(7)
    assert tgid is None or 0 < tgid < 1 << 31
    proc.thread_stat(7, 7)
    proc.thread_exec_start_ms(7, 7)
    proc.thread_syscall(7, 7)
    assert isinstance(proc.cmdline(7) or "", str)
    proc.environ(7)
    assert all(m.start <= m.end for m in proc.maps(7))
    assert all(0 <= s.port < 1 << 16 for s in proc.tcp_sockets(7))
    assert proc.socket_inodes(7) == {42}


def test_procfs_reads_a_comm_that_is_not_utf8(tmp_path: Path):
    """prctl(PR_SET_NAME) takes any bytes: such a process is read, not a crash."""
    stat = tmp_path / "9" / "stat"
    stat.parent.mkdir()
    stat.write_bytes(_REAL["stat"].replace("4242 (py (x) y)", "9 (\xff\xfe)").encode("latin-1"))
    s = ProcFS(str(tmp_path)).stat(9)
    assert s is not None and s.pid == 9 and s.state == "S"
