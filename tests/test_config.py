"""Config validation: every error names the key, nothing but UsageError ever escapes."""

from __future__ import annotations

import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.config import load, load_text, parse_listen, validate
from agent.errors import UsageError
from agent.settings import (
    CPU_FLOOR_RATIO,
    DURATION,
    INTERVAL,
    LONG_WAIT,
    PARK_THRESHOLD,
    TUNABLES,
    Settings,
)

GOOD = """
listen: "127.0.0.1:9900"
interval_seconds: 0.5
park_threshold_seconds: 30
targets:
  - name: sglang
    cmdline: "sglang\\\\.launch_server"
  - name: workers
    comm: "python3?"
  - name: any-gpu
    gpu: true
  - name: pinned
    pids: [1234, 5678]
"""


def test_a_full_config_loads():
    c = load_text(GOOD, "good.yaml")
    assert c.listen == ("127.0.0.1", 9900)
    assert (c.interval_seconds, c.park_threshold_seconds) == (0.5, 30.0)
    assert [t.name for t in c.targets] == ["sglang", "workers", "any-gpu", "pinned"]
    assert c.targets[0].cmdline is not None and c.targets[0].cmdline.search(
        "-m sglang.launch_server"
    )
    assert c.targets[3].pids == {1234, 5678}


def test_the_built_in_default_is_valid_and_matches_known_servers():
    c = load(None)
    assert c.listen == ("0.0.0.0", 9817)
    assert any(t.gpu for t in c.targets)
    lines = {
        "sglang": "python3 -m sglang.launch_server --model-path x --tp 8",
        "vllm": "/usr/bin/python3 -m vllm.entrypoints.openai.api_server --model m",
        "triton": "/opt/tritonserver/bin/tritonserver --model-repository=/models",
        "torchrun": "/usr/bin/python3 /usr/local/bin/torchrun --nproc-per-node 8 train.py",
        "text-generation-inference": "text-generation-launcher --model-id m",
        "tensorrt-llm": "trtllm-serve /models/llama",
    }
    for name, cmdline in lines.items():
        hits = [t.name for t in c.targets if t.cmdline is not None and t.cmdline.search(cmdline)]
        assert hits == [name], (name, hits)
    for t in c.targets:
        if t.cmdline is not None:
            assert not t.cmdline.search("python3 -m http.server 8000"), t.name


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("listen: ':9817'\nfoo: 1\ntargets: [{name: a, pids: [1]}]", "foo: unknown key"),
        ("targets: [{name: a, pids: [1], cmdlin: x}]", "targets[0].cmdlin: unknown key"),
        ("targets: [{name: a, cmdline: 'sglang('}]", "targets[0].cmdline: invalid regular"),
        ("targets: [{name: a, comm: ''}]", "targets[0].comm"),
        ("targets: [{name: a, pids: [-3]}]", "targets[0].pids"),
        ("targets: [{name: a, pids: 12}]", "targets[0].pids"),
        ("targets: [{name: a, gpu: 'yes'}]", "targets[0].gpu"),
        ("targets: [{name: a}]", "targets[0]: target 'a' selects nothing"),
        ("targets: [{name: 'a b', pids: [1]}]", "targets[0].name"),
        ("targets: [{name: a, pids: [1]}, {name: a, pids: [2]}]", "name 'a' is used twice"),
        ("targets: []", "targets: want a non-empty list"),
        ("interval_seconds: -1\ntargets: [{name: a, pids: [1]}]", "interval_seconds: -1"),
        (
            "interval_seconds: fast\ntargets: [{name: a, pids: [1]}]",
            "interval_seconds: want a number",
        ),
        ("park_threshold_seconds: 1e9\ntargets: [{name: a, pids: [1]}]", "park_threshold_seconds"),
        (
            "listen: 'localhost'\ntargets: [{name: a, pids: [1]}]",
            "listen: 'localhost' is not HOST:PORT",
        ),
        ("listen: ':99999'\ntargets: [{name: a, pids: [1]}]", "listen: port 99999 is out of range"),
        ("listen: 9817\ntargets: [{name: a, pids: [1]}]", "listen: want a string"),
        ("- just\n- a list", "(top level)"),
        ("targets: [{name: a, pids: [1]}\n", "not valid YAML"),
        # The closest known key is suggested for a typo.
        (
            "intervall_seconds: 1\ntargets: [{name: a, pids: [1]}]",
            "intervall_seconds: unknown key (did you mean 'interval_seconds'?)",
        ),
        ("targets: [{name: a, pid: [1]}]", "targets[0].pid: unknown key (did you mean 'pids'?)"),
        ("targets: [{name: a, pids: [1], 3: x}]", "targets[0].3: unknown key; known: name,"),
        # Absurd numbers, each named with the value given.
        ("interval_seconds: 0\ntargets: [{name: a, pids: [1]}]", "interval_seconds: 0 is out"),
        ("interval_seconds: 1e9\ntargets: [{name: a, pids: [1]}]", "interval_seconds: 1e9 is"),
        ("interval_seconds: .nan\ntargets: [{name: a, pids: [1]}]", "interval_seconds: nan is"),
        ("interval_seconds: .inf\ntargets: [{name: a, pids: [1]}]", "interval_seconds: inf is"),
        (
            "park_threshold_seconds: -5\ntargets: [{name: a, pids: [1]}]",
            "park_threshold_seconds: -5 is out of range",
        ),
        ("listen: ':70000'\ntargets: [{name: a, pids: [1]}]", "port 70000 is out of range"),
        ("listen: '[::1]'\ntargets: [{name: a, pids: [1]}]", "'[::1]' is not HOST:PORT"),
        ("targets: [{name: a, pids: [99999999]}]", "targets[0].pids: 99999999 is not a PID"),
        ("targets: [{name: a, pids: [true]}]", "targets[0].pids: True is not a PID"),
        # Regexes re.compile refuses with something other than re.error.
        (
            "targets: [{name: a, cmdline: 'a{99999999999}'}]",
            "targets[0].cmdline: invalid regular expression 'a{99999999999}'",
        ),
        (f"targets: [{{name: a, comm: '{'(' * 2000}{')' * 2000}'}}]", "targets[0].comm: regular"),
        (f"targets: [{{name: a, comm: '{'x' * 2000}'}}]", "at most 1024"),
        ("bpf_stats: 1\ntargets: [{name: a, pids: [1]}]", "bpf_stats: want true or false, got 1"),
        ("stacks: yes please\ntargets: [{name: a, pids: [1]}]", "stacks: want true or false"),
        ('"\\n": 1\ntargets: [{name: a, pids: [1]}]', "'\\n': unknown key"),  # found by fuzzing
        ("bpf_stat: true\ntargets: [{name: a, pids: [1]}]", "did you mean 'bpf_stats'"),
        ("[" * 5000, "not valid YAML: nested too deeply"),
        ("targets: !!python/object:os.system x", "not valid YAML"),
    ],
)
def test_bad_config_names_the_key(text, names):
    with pytest.raises(UsageError) as e:
        load_text(text, "bad.yaml")
    msg = str(e.value)
    assert msg.startswith("config bad.yaml: "), msg
    assert names in msg, msg
    assert "\n" not in msg
    assert e.value.exit_code == 2


def test_missing_file_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="cannot read it"):
        load(str(tmp_path / "nope.yaml"))


def test_unreadable_files_are_usage_errors(tmp_path):
    with pytest.raises(UsageError, match="cannot read it"):
        load(str(tmp_path))  # a directory
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"targets: \xff\xfe\n")
    with pytest.raises(UsageError, match="not UTF-8 text"):
        load(str(binary))
    huge = tmp_path / "huge.yaml"
    huge.write_text("#" * (2 << 20))
    with pytest.raises(UsageError, match="larger than"):
        load(str(huge))


def test_bad_values_are_shown_short():
    """A huge bad value is cut, not dumped: the error stays one short line."""
    with pytest.raises(UsageError) as e:
        validate({"targets": [{"name": "a", "pids": "x" * 10_000}]}, "big.yaml")
    assert len(str(e.value)) < 200, str(e.value)
    with pytest.raises(UsageError) as e:
        validate({"interval_seconds": 10**5000, "targets": [{"name": "a", "pids": [1]}]}, "b")
    assert "interval_seconds" in str(e.value) and len(str(e.value)) < 200


def test_yaml_exponent_without_a_dot_is_a_number():
    """YAML 1.1 reads 1e0 as a string; the config takes it as the number it looks like."""
    c = load_text("interval_seconds: 1e0\ntargets: [{name: a, pids: [1]}]", "x")
    assert c.interval_seconds == 1.0


@pytest.mark.parametrize(
    ("text", "want"),
    [
        (":9817", ("0.0.0.0", 9817)),
        ("127.0.0.1:1", ("127.0.0.1", 1)),
        ("[::1]:9817", ("::1", 9817)),
        ("node-3.local:80", ("node-3.local", 80)),
    ],
)
def test_parse_listen(text, want):
    assert parse_listen(text) == want


@pytest.mark.parametrize(
    "text", ["[::1:9817", "[zz]:1", "a b:1", "host:", "host:0", ":70000", "h_st:80", "a:80:1"]
)
def test_parse_listen_rejects(text):
    with pytest.raises(UsageError) as e:
        parse_listen(text)
    assert str(e.value).startswith("--listen: "), str(e.value)
    assert "\n" not in str(e.value)


_yamlish = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=12,
)
_keys = st.sampled_from(
    ["listen", "interval_seconds", "park_threshold_seconds", "max_services", "targets"]
)


@given(st.dictionaries(_keys, _yamlish, max_size=4) | _yamlish)
def test_validate_raises_only_usage_errors(raw):
    try:
        validate(raw, "fuzz")
    except UsageError as e:
        assert str(e).startswith("config fuzz: ")


_target_keys = st.sampled_from(
    ["name", "cmdline", "comm", "pids", "gpu", "uids", "cgroup", "units", "started_by", "other"]
)
_targets = st.lists(
    st.dictionaries(_target_keys, _yamlish | st.text(max_size=8), max_size=5), max_size=3
)


@given(_targets)
def test_validate_targets_raises_only_usage_errors(targets):
    try:
        c = validate({"targets": targets}, "fuzz")
    except UsageError as e:
        assert str(e).startswith("config fuzz: ")
    else:
        assert len(c.targets) == len(targets)


def test_bpf_stats_is_off_unless_asked_for():
    assert load(None).bpf_stats is False
    assert load_text("targets: [{name: a, pids: [1]}]", "x").bpf_stats is False
    assert load_text("bpf_stats: true\ntargets: [{name: a, pids: [1]}]", "x").bpf_stats is True


def test_front_doors_declared():
    from agent.model import FrontDoorConfig

    c = load_text(
        "targets:\n"
        "  - {name: api, cmdline: serve, front_door_ports: [8000, 8001, 8000]}\n"
        "  - {name: train, cmdline: torchrun, front_door: false}\n"
        "  - {name: other, cmdline: x}\n",
        "x",
    )
    api, train, other = c.targets
    assert api.front_doors == FrontDoorConfig(frozenset({8000, 8001}))
    assert train.front_doors == FrontDoorConfig(frozenset())
    assert other.front_doors is None  # found from its connections
    assert all(t.front_doors is None for t in load(None).targets)


@pytest.mark.parametrize(
    ("target", "names"),
    [
        ("front_door_ports: []", "targets[0].front_door_ports: want a non-empty list of ports"),
        ("front_door_ports: 8000", "targets[0].front_door_ports: want a non-empty list"),
        ("front_door_ports: [0]", "targets[0].front_door_ports: 0 is not a port (1-65535)"),
        ("front_door_ports: [65536]", "65536 is not a port"),
        ("front_door_ports: [true]", "True is not a port"),
        ("front_door_ports: ['8000']", "'8000' is not a port"),
        ("front_door_ports: [80.5]", "80.5 is not a port"),
        ("front_door: true", "targets[0].front_door: want false (it has no front door), got True"),
        ("front_door: 'no'", "targets[0].front_door: want false"),
        ("front_door: null", "targets[0].front_door: want false"),
        (
            "front_door: false, front_door_ports: [8000]",
            "targets[0]: give front_door_ports or front_door: false, not both",
        ),
        ("front_doors: [8000]", "targets[0].front_doors: unknown key (did you mean 'front_door"),
    ],
)
def test_bad_front_doors_name_the_key(target, names):
    with pytest.raises(UsageError) as e:
        load_text(f"targets: [{{name: a, pids: [1], {target}}}]", "bad.yaml")
    msg = str(e.value)
    assert msg.startswith("config bad.yaml: ") and names in msg, msg
    assert "\n" not in msg


_front_keys = st.sampled_from(["front_door_ports", "front_door"])


@given(st.dictionaries(_front_keys, _yamlish | st.lists(st.integers(), max_size=3), max_size=2))
def test_front_door_keys_raise_only_usage_errors(extra):
    try:
        c = validate({"targets": [{"name": "a", "pids": [1], **extra}]}, "fuzz")
    except UsageError as e:
        assert str(e).startswith("config fuzz: ") and "\n" not in str(e)
    else:
        fd = c.targets[0].front_doors
        assert (fd is None) == (not extra)
        assert fd is None or all(0 < p < 65536 for p in fd.ports)


def test_stacks_are_logged_unless_turned_off():
    assert load(None).stacks is True
    assert load_text("targets: [{name: a, pids: [1]}]", "x").stacks is True
    assert load_text("stacks: false\ntargets: [{name: a, pids: [1]}]", "x").stacks is False


def test_every_tunable_has_its_default_in_its_range_and_one_name():
    for t in TUNABLES:
        assert t.lo <= t.default <= t.hi, t
        t.check(t.default, t.key)
    assert len({t.key for t in TUNABLES}) == len(TUNABLES)
    # The probe reports every wait that could make a service stalled, at any threshold.
    assert LONG_WAIT.hi <= PARK_THRESHOLD.lo
    with pytest.raises(UsageError, match=r"--duration: 0\.1 is out of range 0\.5-86400 seconds"):
        DURATION.check(0.1, "--duration")
    with pytest.raises(UsageError, match=r"^cpu_floor_ratio: 2 is out of range 0-1$"):
        CPU_FLOOR_RATIO.check(2, "cpu_floor_ratio")


def test_the_config_fills_the_observers_settings():
    cfg = validate({"interval_seconds": 4, "targets": [{"name": "x", "pids": [1]}]}, "test")
    assert cfg.settings == Settings(PARK_THRESHOLD.default, 4.0, 8.0)
    assert validate({"targets": [{"name": "x", "pids": [1]}]}, "t").settings == Settings(
        PARK_THRESHOLD.default, INTERVAL.default, 5.0
    )


# --- a file that steers a root agent must be root's alone -----------------------------------

SMALL = "targets:\n  - name: x\n    pids: [1]\n"


def test_a_config_others_may_write_is_refused_and_named(tmp_path):
    cfg = tmp_path / "hangwatch.yaml"
    cfg.write_text(SMALL)
    cfg.chmod(0o666)
    with pytest.raises(UsageError) as e:
        load(str(cfg))
    assert str(cfg) in str(e.value) and "writable by others (mode 0666)" in str(e.value)
    assert "chmod go-w" in str(e.value)
    cfg.chmod(0o644)
    assert load(str(cfg)).targets[0].name == "x"


def test_a_directory_others_may_write_is_refused_unless_sticky(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    cfg = shared / "hangwatch.yaml"
    cfg.write_text(SMALL)
    shared.chmod(0o777)  # anyone could put another file in its place
    with pytest.raises(UsageError) as e:
        load(str(cfg))
    assert f"{shared} is writable by others (mode 0777)" in str(e.value)
    shared.chmod(0o1777)  # /tmp: others may not replace what they do not own
    assert load(str(cfg)).targets[0].name == "x"


def test_a_symlink_is_judged_where_it_lives_and_where_it_leads(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (real / "hangwatch.yaml").write_text(SMALL)
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "hangwatch.yaml").symlink_to(real / "hangwatch.yaml")
    shared.chmod(0o777)  # the link itself could be pointed elsewhere
    with pytest.raises(UsageError, match="shared is writable by others"):
        load(str(shared / "hangwatch.yaml"))
    shared.chmod(0o755)
    real.chmod(0o777)  # where it leads: the file could be replaced
    with pytest.raises(UsageError, match="real is writable by others"):
        load(str(shared / "hangwatch.yaml"))


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file away needs root")
def test_a_config_owned_by_another_user_is_refused(tmp_path):
    cfg = tmp_path / "hangwatch.yaml"
    cfg.write_text(SMALL)
    os.chown(cfg, 4242, 4242)
    with pytest.raises(UsageError, match="is owned by uid 4242, not by root"):
        load(str(cfg))


# --- origin selectors and caps -------------------------------------------------------------


def test_origin_selectors_load():
    c = load_text(
        "max_services: 10\n"
        "targets:\n"
        "  - {name: a, cmdline: vllm, uids: [0, root, 1000], max_services: 4}\n"
        "  - {name: b, units: ['sglang@*.service', vllm.service]}\n"
        "  - {name: c, cgroup: '/kubepods', started_by: [container]}\n"
        "  - {name: d, gpu: true, started_by: [system, container, operator]}\n",
        "x",
    )
    a, b, cg, d = c.targets
    assert c.max_services == 10
    assert (a.uids, a.max_services) == ({0, 1000}, 4)
    assert b.unit_matches("sglang@3.service") and not b.unit_matches("sglang.service")
    assert cg.cgroup is not None and cg.cgroup.match("/kubepods.slice/x")
    assert not cg.cgroup.match("/user.slice/kubepods")  # from the start of the path
    assert d.started_by == {"system", "container", "operator"}
    assert (b.max_services, load_text("targets: [{name: a, pids: [1]}]", "x").max_services) == (
        32,
        128,
    )


def test_the_default_config_wants_an_origin_no_tenant_can_choose():
    """Every target of the built-in default, and of the shipped host and cluster configs,
    says who must have started the process: a command line or GPU memory alone is anyone's."""
    from pathlib import Path

    deploy = Path(__file__).resolve().parent.parent / "deploy"
    for c in (
        load(None),
        load(str(deploy / "systemd" / "hangwatch.yaml")),
        load(str(deploy / "kubernetes" / "config" / "hangwatch.yaml")),
    ):
        for t in c.targets:
            assert t.started_by == {"system", "container", "operator"}, (c.source, t.name)
        assert c.max_services == 128


def test_the_commented_examples_of_the_host_config_load():
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "deploy/systemd/hangwatch.yaml").read_text()
    examples = "\n".join(
        "  " + line[4:] for line in text.splitlines() if line.startswith(("  # - ", "  #   "))
    )
    c = load_text("targets:\n" + examples, "examples")
    assert {t.name for t in c.targets} >= {"team-vllm", "sglang-units", "slurm-jobs"}


@pytest.mark.parametrize(
    ("target", "names"),
    [
        ("uids: []", "targets[0].uids: want a non-empty list of uids or user names"),
        ("uids: 0", "targets[0].uids: want a non-empty list"),
        ("uids: [-1]", "targets[0].uids: -1 is not a uid (0-4294967294)"),
        ("uids: [4294967295]", "targets[0].uids: 4294967295 is not a uid"),
        ("uids: [true]", "targets[0].uids: True is not a uid or a user name"),
        ("uids: [no-such-user-hw]", "targets[0].uids: no user 'no-such-user-hw' on this host"),
        ("uids: ['a b']", "targets[0].uids: 'a b' is not a uid or a user name"),
        ("cgroup: '('", "targets[0].cgroup: invalid regular expression"),
        ("cgroup: ''", "targets[0].cgroup: want a regular expression string"),
        ("units: [vllm]", "targets[0].units: 'vllm' is not a unit name ending in .service"),
        ("units: ['a/b.service']", "targets[0].units: 'a/b.service' is not a unit name"),
        ("units: vllm.service", "targets[0].units: want a non-empty list of systemd unit names"),
        ("started_by: [root]", "targets[0].started_by: 'root' is not one of system, container,"),
        ("started_by: system", "targets[0].started_by: want a non-empty list of origins"),
        ("max_services: 0", "targets[0].max_services: 0 is out of range 1-4096"),
        ("max_services: 1.5", "targets[0].max_services: want a whole number of services"),
        ("max_services: true", "targets[0].max_services: want a whole number"),
        (
            "started_bye: [system]",
            "targets[0].started_bye: unknown key (did you mean 'started_by'?)",
        ),
        ("uid: [0]", "targets[0].uid: unknown key (did you mean 'uids'?)"),
    ],
)
def test_bad_origin_selector_names_the_key(target, names):
    with pytest.raises(UsageError) as e:
        load_text(f"targets: [{{name: a, cmdline: x, {target}}}]", "bad.yaml")
    assert str(e.value).startswith("config bad.yaml: "), e.value
    assert names in str(e.value), e.value
    assert e.value.exit_code == 2


def test_bad_global_cap_names_the_key():
    with pytest.raises(UsageError, match=r"config bad.yaml: max_services: 99999 is out of range"):
        load_text("max_services: 99999\ntargets: [{name: a, pids: [1]}]", "bad.yaml")


def test_a_target_that_selects_nothing_lists_every_selector():
    with pytest.raises(UsageError) as e:
        load_text("targets: [{name: a, max_services: 3}]", "bad.yaml")
    assert str(e.value) == (
        "config bad.yaml: targets[0]: target 'a' selects nothing: give cmdline, comm, pids, "
        "gpu, uids, cgroup, units or started_by"
    )
