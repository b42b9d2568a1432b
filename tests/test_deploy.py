"""The deployment files in deploy/: they parse, they run the daemon, and they agree with it.

Pure tests, no root: the Kubernetes manifests and their kustomization, the Dockerfile and its
.dockerignore, the systemd unit and its example config, and the Grafana dashboard, whose every
query must select only metrics that tests/golden/metrics.txt documents, or a record of
deploy/prometheus/hangwatch-rules.yml (the running daemon, with those rules in a real
Prometheus, is checked against the same queries by tests/privileged/test_dashboard.py).
tests/host/test_deploy.py runs `kubectl kustomize`, `systemd-analyze` and promtool on them
where they are installed.
"""

from __future__ import annotations

import configparser
import fnmatch
import json
import re
import shlex
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent import config as config_mod

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "kubernetes"
UNIT = DEPLOY / "systemd" / "hangwatch.service"
HOST_CONFIG = DEPLOY / "systemd" / "hangwatch.yaml"
DOCKERFILE = DEPLOY / "Dockerfile"
DASHBOARD = DEPLOY / "grafana" / "hangwatch.json"
GOLDEN = REPO / "tests" / "golden" / "metrics.txt"
RULES = DEPLOY / "prometheus" / "hangwatch-rules.yml"

INSTALL_DIR = "/opt/hangwatch"
BINARY = f"{INSTALL_DIR}/.venv/bin/hangwatch"
PORT = 9817

# In the folder but deliberately not in kustomization.yaml: deploying both monitors would
# scrape every agent twice into the same series. kustomization.yaml must say so.
K8S_ALTERNATIVES = {"servicemonitor.yaml"}

# The DaemonSet must mount these host paths at the same place (name -> read only?).
HOST_MOUNTS = {
    "/sys/kernel/debug": False,
    "/sys/kernel/tracing": False,
    "/sys/kernel/btf": True,
    "/lib/modules": True,
    "/usr/src": True,
    "/sys/fs/bpf": False,
}


# --- the golden exposition: metric names and their labels ---------------------------------


@cache
def golden() -> dict[str, set[str]]:
    """Every sample name /metrics can carry (histograms: _bucket, _count, _sum), with the label
    names its family has in the golden text."""
    kinds: dict[str, str] = {}
    labels: dict[str, set[str]] = {}
    for line in GOLDEN.read_text().splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            kinds[name] = kind
            labels.setdefault(name, set())
        elif line and not line.startswith("#"):
            m = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s", line)
            assert m, line
            names = set(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="', m.group(2) or ""))
            family = next(f for f in kinds if m.group(1) == f or m.group(1).startswith(f + "_"))
            labels[family] |= names - {"le"}
    out: dict[str, set[str]] = {}
    for name, kind in kinds.items():
        if kind == "histogram":
            for suffix in ("_bucket", "_count", "_sum"):
                out[name + suffix] = labels[name] | ({"le"} if suffix == "_bucket" else set())
        else:
            out[name] = labels[name]
    return out


_BY = re.compile(r"\bby\s*\(([^)]*)\)")
# label_replace(v, "dst", "replacement", "src", "regex"): dst, from the last four arguments.
_LABEL_REPLACE_TARGET = re.compile(r',\s*"(\w+)",\s*"[^"]*",\s*"\w*",\s*"[^"]*"\s*\)')
_RECORD_NAME = re.compile(r"(?<![\w:])hangwatch:[\w:]+")


@cache
def recorded() -> dict[str, set[str]]:
    """Every record of the shipped rules, with the labels its series can carry: those its
    aggregations group by and its label_replace calls add, or, for a record without either
    (a join, a function of one record), those of the records it reads."""
    out: dict[str, set[str]] = {}
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            if "record" not in rule:
                continue
            expr = rule["expr"]
            labels = {x.strip() for c in _BY.findall(expr) for x in c.split(",") if x.strip()}
            if not labels:
                for name in _RECORD_NAME.findall(expr):
                    labels |= out.get(name, set())
            out[rule["record"]] = labels | set(_LABEL_REPLACE_TARGET.findall(expr))
    return out


def test_recorded_labels_are_read_as_expected() -> None:
    r = recorded()
    job = {"service", "job_key", "instance", "service_pid"}
    assert r["hangwatch:job_ranks:count"] == job
    assert r["hangwatch:job_ranks_missing:count"] == job
    assert r["hangwatch:job_rank_instance:timestamp"] == job | {"rank", "rank_instance"}
    assert r["hangwatch:job_rank_straggler"] == job | {"rank", "rank_instance", "site", "reason"}


def test_golden_file_is_read_as_expected() -> None:
    g = golden()
    assert "hangwatch_futex_wait_seconds_bucket" in g and "hangwatch_futex_wait_seconds" not in g
    assert "hangwatch_process_write_bytes_total" in g
    assert {"service", "pid", "state"} <= g["hangwatch_service_state"]
    assert "service" not in g["hangwatch_collector_success"]


# --- Kubernetes ------------------------------------------------------------------------------


def manifest_files() -> list[Path]:
    return sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def load_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


@cache
def objects() -> dict[str, dict[str, Any]]:
    """Every object of every manifest, by kind (one of each kind here)."""
    out: dict[str, dict[str, Any]] = {}
    for path in manifest_files():
        for doc in load_docs(path):
            assert doc["kind"] not in out, f"two {doc['kind']} objects"
            out[doc["kind"]] = doc
    return out


def kustomization() -> dict[str, Any]:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text())


@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: p.name)
def test_manifest_parses_and_names_itself(path: Path) -> None:
    docs = load_docs(path)
    assert docs, f"{path.name} holds no object"
    for doc in docs:
        assert isinstance(doc, dict), path.name
        assert isinstance(doc.get("apiVersion"), str) and doc["apiVersion"], path.name
        assert isinstance(doc.get("kind"), str) and doc["kind"], path.name
        name = doc.get("metadata", {}).get("name")
        assert isinstance(name, str) and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name)


def test_kustomization_lists_every_manifest_and_only_existing_files() -> None:
    k = kustomization()
    assert k["apiVersion"].startswith("kustomize.config.k8s.io/") and k["kind"] == "Kustomization"
    listed = k["resources"]
    assert len(listed) == len(set(listed)), listed
    for name in listed:
        assert (K8S / name).is_file(), f"kustomization.yaml lists a missing file {name}"
    present = {p.name for p in manifest_files()}
    assert set(listed) == present - K8S_ALTERNATIVES, (listed, present)
    text = (K8S / "kustomization.yaml").read_text()
    for alt in K8S_ALTERNATIVES:
        assert alt in text, f"kustomization.yaml must say why {alt} is not listed"
    for gen in k.get("configMapGenerator", []):
        for entry in gen["files"]:
            assert (K8S / entry.split("=", 1)[-1]).is_file(), entry
    namespace = objects()["Namespace"]["metadata"]["name"]
    assert k["namespace"] == namespace


def daemonset_pod() -> dict[str, Any]:
    return objects()["DaemonSet"]["spec"]["template"]["spec"]


def agent_container() -> dict[str, Any]:
    containers = daemonset_pod()["containers"]
    assert len(containers) == 1, "one container: the agent"
    return containers[0]


def test_daemonset_runs_the_daemon_with_the_configmap_config() -> None:
    ds = objects()["DaemonSet"]
    assert ds["apiVersion"] == "apps/v1"
    c = agent_container()
    argv = [*c.get("command", []), *c.get("args", [])]
    assert argv[:2] == [BINARY, "run"], argv
    assert argv[2:] == ["--config", "/etc/hangwatch/hangwatch.yaml"], argv
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in daemonset_pod()["volumes"]}
    config_volume = next(n for n, v in volumes.items() if "configMap" in v)
    assert volumes[config_volume]["configMap"]["name"] == "hangwatch-config"
    assert mounts[config_volume]["mountPath"] == "/etc/hangwatch"
    gen = {g["name"]: g for g in kustomization()["configMapGenerator"]}["hangwatch-config"]
    assert any(f.startswith("hangwatch.yaml=") for f in gen["files"]), gen
    # The image's entrypoint is the same program: `command` only makes it explicit.
    assert dockerfile_entrypoint()[0] == BINARY


def test_daemonset_shares_the_hosts_pid_namespace_with_bpf_privileges() -> None:
    pod = daemonset_pod()
    assert pod["hostPID"] is True
    sc = agent_container()["securityContext"]
    if not sc.get("privileged"):
        caps = set(sc.get("capabilities", {}).get("add", []))
        assert {"BPF", "PERFMON", "SYS_PTRACE", "DAC_READ_SEARCH"} <= caps, caps
    assert pod["priorityClassName"] == "system-node-critical"
    # The agent talks to no API server: no token in a privileged pod.
    assert pod.get("automountServiceAccountToken") is False


@pytest.mark.parametrize("host_path", sorted(HOST_MOUNTS))
def test_daemonset_mounts_the_host_path_at_the_same_place(host_path: str) -> None:
    volumes = [v for v in daemonset_pod()["volumes"] if v.get("hostPath", {}).get("path")]
    named = [v["name"] for v in volumes if v["hostPath"]["path"] == host_path]
    assert len(named) == 1, f"no single hostPath volume for {host_path}: {volumes}"
    mounts = [m for m in agent_container()["volumeMounts"] if m["name"] == named[0]]
    assert len(mounts) == 1, f"volume {named[0]} ({host_path}) is not mounted"
    assert mounts[0]["mountPath"] == host_path, mounts[0]
    if HOST_MOUNTS[host_path]:
        assert mounts[0].get("readOnly") is True, f"{host_path} must be read only"


def test_every_volume_is_mounted_and_every_mount_has_a_volume() -> None:
    volumes = {v["name"] for v in daemonset_pod()["volumes"]}
    mounts = [m["name"] for m in agent_container()["volumeMounts"]]
    assert len(mounts) == len(set(mounts)), mounts
    assert set(mounts) == volumes


def test_daemonset_runs_on_gpu_nodes_only() -> None:
    pod = daemonset_pod()
    assert pod["nodeSelector"].get("nvidia.com/gpu.present") == "true"
    gpu = [t for t in pod["tolerations"] if t.get("key") == "nvidia.com/gpu"]
    assert gpu and gpu[0]["operator"] == "Exists"
    # It must not take a GPU from the workloads it watches.
    for section in ("requests", "limits"):
        assert "nvidia.com/gpu" not in agent_container()["resources"].get(section, {})


def _quantity(q: str | int) -> float:
    units = {"m": 1e-3, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "k": 1e3, "M": 1e6, "G": 1e9}
    m = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(q))
    assert m, q
    return float(m.group(1)) * units.get(m.group(2), 1)


def test_daemonset_resources_are_requested_and_limited() -> None:
    res = agent_container()["resources"]
    for what in ("cpu", "memory"):
        assert _quantity(res["requests"][what]) <= _quantity(res["limits"][what]), what
    # bcc's compile at start peaks at ~150 MB resident: leave room.
    assert _quantity(res["limits"]["memory"]) >= 384 * 2**20


def test_daemonset_probes_and_port_are_the_metrics_port() -> None:
    c = agent_container()
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"metrics": PORT}
    for probe in ("livenessProbe", "readinessProbe"):
        get = c[probe]["httpGet"]
        assert get["path"] == "/metrics", probe
        assert ports.get(get["port"], get["port"]) == PORT, probe


def test_daemonset_passes_the_node_name() -> None:
    env = {e["name"]: e for e in agent_container()["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"


def test_selectors_match_the_agent_pods() -> None:
    ds = objects()["DaemonSet"]
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    selector = ds["spec"]["selector"]["matchLabels"]
    assert selector.items() <= pod_labels.items()
    svc = objects()["Service"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert svc["spec"]["clusterIP"] == "None"
    assert [(p["name"], p["port"]) for p in svc["spec"]["ports"]] == [("metrics", PORT)]
    pm = objects()["PodMonitor"]
    assert pm["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    sm = objects()["ServiceMonitor"]
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()


def _endpoints(monitor: dict[str, Any]) -> list[dict[str, Any]]:
    spec = monitor["spec"]
    return spec.get("podMetricsEndpoints") or spec["endpoints"]


@pytest.mark.parametrize("kind", ["PodMonitor", "ServiceMonitor"])
def test_monitors_label_targets_as_the_dashboard_expects(kind: str) -> None:
    mon = objects()[kind]
    assert mon["apiVersion"] == "monitoring.coreos.com/v1"
    (ep,) = _endpoints(mon)
    assert ep["port"] == "metrics" and ep.get("path", "/metrics") == "/metrics"
    relabel = ep["relabelings"]
    # instance = the node, job = hangwatch: the dashboard's variables and up{job="hangwatch"}.
    assert any(
        r.get("targetLabel") == "instance"
        and r.get("sourceLabels") == ["__meta_kubernetes_pod_node_name"]
        for r in relabel
    ), relabel
    assert any(
        r.get("targetLabel") == "job" and r.get("replacement") == "hangwatch" for r in relabel
    )
    if kind == "ServiceMonitor":
        # Its `service` target label would shadow hangwatch's own `service` label.
        assert any(
            r.get("action", "").lower() == "labeldrop" and re.fullmatch(r["regex"], "service")
            for r in relabel
        ), relabel


def test_namespace_admits_privileged_pods() -> None:
    labels = objects()["Namespace"]["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "privileged"


# --- the configs -----------------------------------------------------------------------------


def _targets(cfg: config_mod.Config) -> list[tuple[Any, ...]]:
    return [
        (
            t.name,
            t.cmdline.pattern if t.cmdline else None,
            t.comm.pattern if t.comm else None,
            t.pids,
            t.gpu,
        )
        for t in cfg.targets
    ]


def test_example_configs_are_valid_and_agree() -> None:
    host = config_mod.load(str(HOST_CONFIG))
    gen = {g["name"]: g for g in kustomization()["configMapGenerator"]}["hangwatch-config"]
    (entry,) = [f for f in gen["files"] if f.startswith("hangwatch.yaml=")]
    cluster = config_mod.load(str(K8S / entry.split("=", 1)[1]))
    for cfg in (host, cluster):
        assert cfg.listen == ("0.0.0.0", PORT)
        names = [t.name for t in cfg.targets]
        # First match names a process: the GPU catch-all must not shadow the named servers.
        assert [t.gpu for t in cfg.targets].index(True) == len(names) - 1, names
    assert _targets(host) == _targets(cluster)
    assert (host.interval_seconds, host.park_threshold_seconds) == (
        cluster.interval_seconds,
        cluster.park_threshold_seconds,
    )


# --- Dockerfile ------------------------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        word, _, rest = full.partition(" ")
        out.append((word.upper(), rest.strip()))
    assert not pending, "Dockerfile ends inside a continued line"
    return out


def dockerfile_entrypoint() -> list[str]:
    (ep,) = [args for word, args in dockerfile_instructions() if word == "ENTRYPOINT"]
    argv = json.loads(ep)  # exec form: SIGTERM reaches the daemon, not a shell
    assert isinstance(argv, list), ep
    return argv


def test_dockerfile_builds_a_venv_with_debians_bcc_and_runs_the_daemon() -> None:
    ins = dockerfile_instructions()
    assert ins[0] == ("FROM", "debian:12-slim")
    runs = " ".join(args for word, args in ins if word == "RUN")
    for package in ("bpfcc-tools", "python3-bpfcc", "python3-venv", "python3-pip"):
        assert re.search(rf"\b{package}\b", runs), package
    assert "--system-site-packages" in runs
    assert re.search(r"pip install\b[^&]*\s\.(\s|$)", runs), "pip install . (the checkout)"
    assert not re.search(r"pip install[^&]*\bbcc\b", runs), "PyPI's bcc is an unrelated project"
    copies = [args.split() for word, args in ins if word == "COPY"]
    assert [".", INSTALL_DIR] in copies, copies
    assert dockerfile_entrypoint() == [BINARY, "run"]
    exposed = [p for word, args in ins if word == "EXPOSE" for p in args.split()]
    assert f"{PORT}" in exposed or f"{PORT}/tcp" in exposed
    # A regular install leaves bpf/ behind in the checkout: the agent must be told where.
    env = " ".join(args for word, args in ins if word == "ENV")
    assert f"HANGWATCH_BPF_DIR={INSTALL_DIR}/bpf" in env
    assert (REPO / "bpf" / "hangwatch.h").is_file()


def dockerignore_patterns() -> list[str]:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]


def _ignored(path: str, patterns: list[str]) -> bool:
    ignored = False
    for pat in patterns:
        negate = pat.startswith("!")
        pat = pat.lstrip("!").strip("/")
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        hit = any(
            fnmatch.fnmatch(p, pat) or (pat.startswith("**/") and fnmatch.fnmatch(p, pat[3:]))
            for p in prefixes
        )
        if hit:
            ignored = not negate
    return ignored


def test_dockerignore_leaves_out_local_builds_but_not_what_the_image_needs() -> None:
    pats = dockerignore_patterns()
    for gone in (".venv", ".git", "tests/fixtures/build", ".pytest_cache", "agent/__pycache__"):
        assert _ignored(gone, pats), gone
    # pip install . reads pyproject.toml and README.md (the readme); the agent needs bpf/.
    for kept in (
        "pyproject.toml",
        "README.md",
        "agent/cli.py",
        "agent/default-config.yaml",
        "bpf/hangwatch.h",
        "bpf/futex.bpf.c",
    ):
        assert not _ignored(kept, pats), kept
        assert (REPO / kept).is_file(), kept


# --- systemd ---------------------------------------------------------------------------------

TRUE = {"yes", "true", "1", "on"}


def unit() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # keys are case-sensitive
    parser.read_string(UNIT.read_text())
    return parser


def test_unit_runs_the_daemon_and_restarts_on_failure() -> None:
    svc = unit()["Service"]
    argv = shlex.split(svc["ExecStart"])
    assert argv[:2] == [BINARY, "run"], argv
    assert argv[2:] == ["--config", "/etc/hangwatch/hangwatch.yaml"]
    assert svc["ExecReload"] == "/bin/kill -HUP $MAINPID"
    assert svc["Restart"] == "on-failure"
    assert svc["RestartSec"]
    # Bad config (2) and missing privilege or kernel feature (3) do not heal by restarting.
    assert set(svc["RestartPreventExitStatus"].split()) == {"2", "3"}
    assert unit()["Install"]["WantedBy"] == "multi-user.target"


def test_unit_gives_exactly_the_capabilities_the_agent_needs() -> None:
    svc = unit()["Service"]
    need = {"CAP_BPF", "CAP_PERFMON", "CAP_SYS_PTRACE", "CAP_DAC_READ_SEARCH"}
    need |= {"CAP_SETUID", "CAP_SETGID"}  # source lines read with the target's rights
    assert set(svc["CapabilityBoundingSet"].split()) == need
    assert set(svc["AmbientCapabilities"].split()) == need
    assert svc["User"] == "root"
    assert svc["NoNewPrivileges"] in TRUE
    assert svc["LimitMEMLOCK"] == "infinity"


def test_unit_is_hardened() -> None:
    svc = unit()["Service"]
    assert svc["ProtectSystem"] == "strict"
    assert svc["ProtectHome"] == "read-only"
    for key in ("PrivateTmp", "ProtectKernelTunables", "ProtectControlGroups"):
        assert svc[key] in TRUE, key
    assert svc["SystemCallArchitectures"] == "native"
    assert set(svc["RestrictAddressFamilies"].split()) == {
        "AF_UNIX",
        "AF_INET",
        "AF_INET6",
        "AF_NETLINK",
    }
    assert svc["MemoryMax"] and svc["CPUQuota"]
    assert "ReadWritePaths" not in svc, "the agent writes no file"
    # but its status socket, in the runtime directory systemd makes and removes
    assert (svc["RuntimeDirectory"], svc["RuntimeDirectoryMode"]) == ("hangwatch", "0755")


# Each would break BPF, the kernel headers, NVML or the view of other processes.
FORBIDDEN = {
    "ProtectProc": lambda v: v != "default",
    "ProcSubset": lambda v: v == "pid",  # hides /proc/driver/nvidia from NVML
    "PrivateDevices": lambda v: v in TRUE,
    "ProtectKernelModules": lambda v: v in TRUE,  # hides /lib/modules: no kernel headers
    "ProtectClock": lambda v: v in TRUE,  # implies DeviceAllow=: no /dev/nvidia*
    "DevicePolicy": lambda v: v in ("closed", "strict"),
    "DeviceAllow": lambda v: bool(v),
    "PrivateUsers": lambda v: v in TRUE,
    "PrivateNetwork": lambda v: v in TRUE,
}


@pytest.mark.parametrize("key", sorted(FORBIDDEN))
def test_unit_sets_nothing_that_breaks_the_agent(key: str) -> None:
    svc = unit()["Service"]
    if key in svc:
        assert not FORBIDDEN[key](svc[key]), f"{key}={svc[key]}"


# --- the Grafana dashboard -------------------------------------------------------------------


@cache
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panels() -> list[dict[str, Any]]:
    out = []
    for p in dashboard()["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))  # collapsed rows keep theirs inside
    return out


def query_panels() -> list[dict[str, Any]]:
    return [p for p in panels() if p["type"] != "row"]


def exprs() -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in query_panels() for t in p["targets"]]


def variables() -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in dashboard()["templating"]["list"]}


def variable_queries() -> list[tuple[str, str]]:
    """The series selector of each query variable: X of `label_values(X, label)`."""
    out = []
    for name, v in variables().items():
        if v["type"] == "query":
            m = re.fullmatch(r"label_values\((.*),\s*\w+\)", v["definition"])
            assert m, v["definition"]
            out.append((f"${name}", m.group(1)))
    return out


PROMQL_WORDS = {
    "sum", "max", "min", "avg", "count", "by", "without", "on", "ignoring", "group_left",
    "group_right", "or", "and", "unless", "rate", "increase", "irate", "histogram_quantile",
    "vector", "bool", "offset",
}  # fmt: skip


def metric_selectors(expr: str) -> list[tuple[str, str]]:
    """(metric name, label matchers) of every series selector in ``expr``."""
    text = re.sub(r"\[[^\]]*\]", "", expr)  # range durations ([$__rate_interval])
    # Strings outside matchers (label_replace's) hold no selector: empty them, matchers kept.
    kept: list[str] = []
    text = re.sub(r"\{[^}]*\}", lambda m: kept.append(m.group(0)) or f"\0{len(kept) - 1}\0", text)
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)
    text = re.sub(r"\0(\d+)\0", lambda m: kept[int(m.group(1))], text)
    # Label lists: `sum by (instance, service)`, `on (gpu) group_left (name)`.
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", r"\1", text)
    out = []
    for m in re.finditer(r"(?<![\w$.])([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\{[^}]*\})?", text):
        name, matchers = m.group(1), m.group(2) or ""
        if name in PROMQL_WORDS:
            continue
        if not matchers and text[m.end() : m.end() + 1] == "(":
            continue  # a function we do not list
        out.append((name, matchers))
    return out


def test_metric_selectors_finds_the_selectors() -> None:
    expr = (
        'sum by (instance, le) (rate(hangwatch_a_bucket{instance=~"$instance"}'
        "[$__rate_interval])) * on (gpu) group_left (name) hangwatch_b or vector(0)"
    )
    assert metric_selectors(expr) == [
        ("hangwatch_a_bucket", '{instance=~"$instance"}'),
        ("hangwatch_b", ""),
    ]
    # label_replace's strings are no selectors; matchers keep their strings.
    expr = 'label_replace(hangwatch:a{service=~"$service"} > 0, "state", "parked", "", "")'
    assert metric_selectors(expr) == [("hangwatch:a", '{service=~"$service"}')]


def test_dashboard_is_importable_json() -> None:
    d = dashboard()
    assert d["uid"] == "hangwatch" and d["title"]
    assert d["schemaVersion"] >= 36
    assert d.get("id") is None, "exported for import: no database id"
    ids = [p["id"] for p in panels()]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in panels():
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]


def test_dashboard_variables() -> None:
    v = variables()
    assert v["datasource"]["type"] == "datasource" and v["datasource"]["query"] == "prometheus"
    assert v["instance"]["definition"] == "label_values(hangwatch_build_info, instance)"
    assert v["service"]["definition"] == (
        'label_values(hangwatch_service_state{instance=~"$instance"}, service)'
    )
    for name in ("instance", "service"):
        assert v[name]["type"] == "query"
        assert v[name]["multi"] and v[name]["includeAll"], name
        assert v[name]["datasource"]["uid"] == "${datasource}", name


def test_every_panel_queries_the_chosen_datasource_and_says_what_to_look_at() -> None:
    assert query_panels()
    for p in query_panels():
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], p["title"]
        assert len(p.get("description", "")) > 40, f"{p['title']}: say what to look at"
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}", p["title"]
            assert t["expr"].strip(), p["title"]


def test_every_selector_filters_by_instance_and_service_where_it_has_one() -> None:
    g = golden()
    for title, expr in exprs() + variable_queries():
        selectors = metric_selectors(expr)
        assert selectors, (title, expr)
        for name, matchers in selectors:
            if title == "$instance":
                continue  # the variable that lists the instances
            if name in recorded():
                # A job's records: the job whole, over every host, of the chosen services.
                assert 'service=~"$service"' in matchers, f"{title}: {name}{matchers}"
                assert "instance" not in matchers, f"{title}: {name}{matchers} hides ranks"
                continue
            assert 'instance=~"$instance"' in matchers, f"{title}: {name}{matchers}"
            if name == "up":
                assert 'job="hangwatch"' in matchers, f"{title}: {name}{matchers}"
            elif "service" in g.get(name, set()) and title != "$service":
                assert 'service=~"$service"' in matchers, f"{title}: {name}{matchers}"


def dashboard_selected_names() -> set[str]:
    return {name for _, e in exprs() + variable_queries() for name, _ in metric_selectors(e)}


def dashboard_metric_names() -> set[str]:
    """What the dashboard reads from the scrape: all it selects but the rules' records."""
    return {n for n in dashboard_selected_names() if not n.startswith("hangwatch:")}


def dashboard_record_names() -> set[str]:
    return {n for n in dashboard_selected_names() if n.startswith("hangwatch:")}


def test_every_record_the_dashboard_queries_is_recorded_by_the_rules() -> None:
    names = dashboard_record_names()
    assert names, "the dashboard reads no job record?"
    unknown = names - set(recorded())
    assert not unknown, f"not recorded in {RULES.name}: {sorted(unknown)}"


def test_every_metric_the_dashboard_queries_is_in_the_golden_exposition() -> None:
    names = dashboard_metric_names()
    assert all(n.startswith("hangwatch_") or n == "up" for n in names), names
    # `up` is Prometheus's own, for the scrape; everything else comes from the agent.
    unknown = names - set(golden()) - {"up"}
    assert not unknown, f"not in {GOLDEN.name}: {sorted(unknown)}"


def test_every_label_the_dashboard_groups_by_exists() -> None:
    known = set().union(*golden().values(), *recorded().values()) | {"instance", "job", "le"}
    for title, expr in exprs():
        for clause in re.findall(r"\b(?:by|on|group_left|group_right)\s*\(([^)]*)\)", expr):
            for label in filter(None, (x.strip() for x in clause.split(","))):
                assert label in known, f"{title}: no label {label!r} in {expr}"
        for t in [t for p in query_panels() if p["title"] == title for t in p["targets"]]:
            for label in re.findall(r"\{\{\s*(\w+)\s*\}\}", t.get("legendFormat", "")):
                assert label in known, f"{title}: legend uses unknown label {label!r}"


def test_dashboard_covers_the_evidence() -> None:
    used = dashboard_metric_names()
    want = {
        "hangwatch_service_state",
        "hangwatch_process_state",
        "hangwatch_process_threads",
        "hangwatch_process_parked_threads",
        "hangwatch_process_parked_seconds",
        "hangwatch_process_lock_cycles",
        "hangwatch_futex_wait_seconds_bucket",
        "hangwatch_process_write_bytes_total",
        "hangwatch_process_last_write_age_seconds",
        "hangwatch_process_accepts_total",
        "hangwatch_process_listening_ports",
        "hangwatch_process_gpu_memory_bytes",
        "hangwatch_gpu_utilization_ratio",
        "hangwatch_service_gpu_spin",
        "up",
        "hangwatch_collector_success",
        "hangwatch_bpf_events_dropped_total",
        "hangwatch_bpf_map_full_total",
        "hangwatch_bpf_program_run_seconds_total",
        "hangwatch_build_info",
    }
    assert not want - used, sorted(want - used)
    all_exprs = " ".join(e for _, e in exprs())
    assert "rate(hangwatch_process_write_bytes_total{" in all_exprs
    assert "rate(hangwatch_process_accepts_total{" in all_exprs


def rows() -> dict[str, list[dict[str, Any]]]:
    """Each row's panels: those inside a collapsed row, or those after an open row up to the
    next row."""
    out: dict[str, list[dict[str, Any]]] = {}
    current: list[dict[str, Any]] | None = None
    for p in dashboard()["panels"]:
        if p["type"] == "row":
            current = out.setdefault(p["title"], list(p.get("panels", [])))
        elif current is not None:
            current.append(p)
    return out


JOB_KEY = ("service", "job_key", "instance", "service_pid")


def test_jobs_row_shows_ranks_by_state_and_site_the_stragglers_and_missing_ranks() -> None:
    (title,) = [t for t in rows() if t.startswith("Jobs across hosts")]
    row = rows()[title]
    by_type: dict[str, list[dict[str, Any]]] = {}
    for p in row:
        by_type.setdefault(p["type"], []).append(p)
    records = {n for p in row for t in p["targets"] for n, _ in metric_selectors(t["expr"])}
    assert records <= set(recorded()), sorted(records - set(recorded()))

    def reading(panels: list[dict[str, Any]], record: str) -> dict[str, Any]:
        (p,) = [p for p in panels if any(record in t["expr"] for t in p["targets"])]
        (t,) = p["targets"]
        return t

    # Ranks by state over time, per job: one series per job and state.
    t = reading(by_type["timeseries"], "hangwatch:job_rank_stalled")
    assert re.search(rf"count by \({', '.join(JOB_KEY)}, state\)", t["expr"]), t["expr"]
    for state in ("stalled", "parked", "working"):
        assert f'"state", "{state}"' in t["expr"] and t["legendFormat"].endswith("{{state}}")
    # Ranks by site over time: how many ranks of each job wait at each site.
    t = reading(by_type["timeseries"], "hangwatch:job_rank_site")
    assert t["expr"].startswith(f"count by ({', '.join(JOB_KEY)}, site) ("), t["expr"]
    assert "{{site}}" in t["legendFormat"]
    # The stragglers, now, with who and why.
    (table,) = by_type["table"]
    (t,) = table["targets"]
    assert t["expr"].startswith("hangwatch:job_rank_straggler{"), t["expr"]
    assert t["instant"] and t["format"] == "table" and not t["range"]
    (organize,) = [x for x in table["transformations"] if x["id"] == "organize"]
    columns = set(organize["options"]["indexByName"])
    assert {*JOB_KEY, "rank", "rank_instance", "site", "reason", "Value"} <= columns, columns
    assert not organize["options"]["excludeByName"].get("Value"), "how long is the value"
    # Missing ranks, per job; 0 rather than no data.
    t = reading(by_type["stat"], "hangwatch:job_ranks_missing:count")
    assert t["instant"] and t["expr"].endswith("or on () vector(0)"), t["expr"]


def test_futex_heatmap_reads_the_buckets_as_a_heatmap() -> None:
    (heat,) = [p for p in query_panels() if p["type"] == "heatmap"]
    (t,) = heat["targets"]
    assert t["format"] == "heatmap" and t["legendFormat"] == "{{le}}"
    assert re.fullmatch(
        r"sum by \(le\) \(rate\(hangwatch_futex_wait_seconds_bucket\{[^}]*\}"
        r"\[\$__rate_interval\]\)\)",
        t["expr"],
    ), t["expr"]
    assert heat["options"]["calculate"] is False  # the buckets are the kernel's, not Grafana's


STATE_COLORS = {"deadlocked": "red", "stalled": "orange", "idle": "blue", "progressing": "green"}


def test_state_timeline_maps_each_state_code_to_its_name_and_colour() -> None:
    timelines = [
        p
        for p in query_panels()
        if p["type"] == "state-timeline"
        and any("hangwatch_service_state" in t["expr"] for t in p["targets"])
    ]
    assert timelines, "no state timeline of hangwatch_service_state"
    for p in timelines:
        (t,) = p["targets"]
        (m,) = p["fieldConfig"]["defaults"]["mappings"]
        got = {opt["text"]: (code, opt["color"]) for code, opt in m["options"].items()}
        assert {text: color for text, (_, color) in got.items()} == STATE_COLORS
        for text, (code, _) in got.items():
            # The query turns `state="<text>"} == 1` into the value the mapping names.
            assert re.search(rf'state="{text}"\}} == 1\) \* {code}\b', t["expr"]), (text, code)
