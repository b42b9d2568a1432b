"""The deployment files in deploy/, checked by the tools that read them where they are
installed: `kubectl kustomize`, `systemd-analyze verify` and `security`, promtool on every
query of the dashboard, and the unit's syscall filter against what the agent calls. The
parsing and agreement checks that need no process are in tests/test_deploy.py."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from agent import config as config_mod
from tests.conftest import run_promtool
from tests.test_deploy import (
    BINARY,
    K8S,
    UNIT,
    exprs,
    unit,
    variable_queries,
)


def _optional_tool(name: str) -> str:
    """A tool nothing installs for us: the check is a bonus where it is present."""
    found = shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed here")
    return found


# --- Kubernetes ------------------------------------------------------------------------------


def test_kustomize_renders_the_config_into_the_daemonset() -> None:
    kubectl = _optional_tool("kubectl")
    r = subprocess.run(
        [kubectl, "kustomize", str(K8S)], capture_output=True, text=True, check=False, timeout=60
    )
    assert r.returncode == 0, r.stderr
    rendered = {d["kind"]: d for d in yaml.safe_load_all(r.stdout) if d}
    cm = rendered["ConfigMap"]
    ds = rendered["DaemonSet"]
    volumes = {v["name"]: v for v in ds["spec"]["template"]["spec"]["volumes"]}
    assert volumes["config"]["configMap"]["name"] == cm["metadata"]["name"]
    assert cm["metadata"]["name"].startswith("hangwatch-config-")  # named after its content
    config_mod.load_text(cm["data"]["hangwatch.yaml"], "rendered ConfigMap")
    assert all(
        d["metadata"].get("namespace") == "hangwatch"
        for k, d in rendered.items()
        if k != "Namespace"
    )


# --- systemd ---------------------------------------------------------------------------------


# Syscalls the agent cannot run without: BPF, perf events, /proc reads, its HTTP server, and
# the one py-spy (its child, under the same filter) reads Python stacks with.
ESSENTIAL_SYSCALLS = {
    "bpf",
    "perf_event_open",
    "ioctl",
    "openat",
    "pread64",
    "mmap",
    "epoll_wait",
    "ppoll",
    "socket",
    "bind",
    "listen",
    "accept4",
    "clone3",
    "futex",
    "mount",
    "process_vm_readv",
}


def test_unit_syscall_filter_is_a_deny_list_that_spares_what_the_agent_uses() -> None:
    svc = unit()["Service"]
    spec = svc.get("SystemCallFilter", "")
    if not spec:
        return
    assert spec.startswith("~"), "an allow-list would have to know every syscall bcc makes"
    denied = set(spec[1:].split())
    assert not denied & ESSENTIAL_SYSCALLS
    # @ipc holds process_vm_readv (py-spy --nonblocking); @debug holds ptrace and perf_event_open.
    assert not denied & {"@debug", "@ipc", "@privileged", "@system-service", "@default", "@mount"}
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        return
    for group in (d for d in denied if d.startswith("@")):
        r = subprocess.run(
            [analyze, "syscall-filter", group], capture_output=True, text=True, check=False
        )
        assert r.returncode == 0, r.stderr
        calls = {w for w in r.stdout.split() if not w.startswith(("#", "@"))}
        assert calls, group
        assert not calls & ESSENTIAL_SYSCALLS, (group, calls & ESSENTIAL_SYSCALLS)


def test_systemd_analyze_verify_accepts_the_unit() -> None:
    analyze = _optional_tool("systemd-analyze")
    r = subprocess.run(
        [analyze, "verify", str(UNIT)], capture_output=True, text=True, check=False, timeout=60
    )
    said = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    # On a machine without the install, the one complaint is the missing program.
    missing = f"Command {BINARY} is not executable"
    problems = [ln for ln in said if missing not in ln]
    assert not problems, "\n".join(said)
    if Path(BINARY).exists():
        assert r.returncode == 0, "\n".join(said)


def test_systemd_analyze_security_rates_the_unit_ok() -> None:
    analyze = _optional_tool("systemd-analyze")
    r = subprocess.run(
        [analyze, "security", "--offline=yes", "--no-pager", str(UNIT)],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", r.stdout + r.stderr)
    assert m, r.stdout + r.stderr
    # 3.9 when written; 0 is a unit that can do nothing, 10 one that can do anything.
    assert float(m.group(1)) <= 5.0, r.stdout


# --- the Grafana dashboard -------------------------------------------------------------------


def test_promql_of_every_query_parses(tmp_path: Path, promtool: str) -> None:
    # Grafana's substitutions, as Grafana would make them for one chosen value.
    subs = {
        "$__rate_interval": "1m",
        "$instance": r"node\\.example:9817",
        "$service": "sglang|vllm",
    }
    rules = []
    for i, (title, expr) in enumerate(exprs() + variable_queries()):
        for k, v in subs.items():
            expr = expr.replace(k, v)
        assert "$" not in expr, (title, expr)
        rules.append({"record": f"dashboard:query_{i}", "expr": expr})
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}))
    run_promtool(promtool, "check", "rules", str(path), timeout=60)
