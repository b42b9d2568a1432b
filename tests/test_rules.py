"""The shipped Prometheus rules: every alert has a runbook in docs/deploy.md, and every metric
and label they use is one the daemon exports (promtool runs them in tests/host/test_rules.py).

The exported names come from ``tests/golden/metrics.txt`` (the /metrics text that
tests/test_metrics.py checks byte for byte), so renaming a metric or a label without updating the
rules fails here.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from agent.export.metrics import label_name
from agent.observe import jobkey
from agent.observe.discovery import ENV_LABELS

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "deploy" / "prometheus" / "hangwatch-rules.yml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "tests" / "hangwatch-rules.test.yml"
DEPLOY_DOC = ROOT / "docs" / "deploy.md"
GOLDEN = ROOT / "tests" / "golden" / "metrics.txt"
RUNBOOK_BASE = "https://github.com/hangwatch/hangwatch/blob/main/docs/deploy.md#"

# Labels Prometheus adds to every scraped series.
TARGET_LABELS = {"instance", "job"}
# Metrics that are not the daemon's but that the rules may use.
FOREIGN_METRICS = {"up": TARGET_LABELS}

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_IDENTIFIER = re.compile(r"(?<![\w:])[a-zA-Z_:][\w:]*")
_SELECTOR = re.compile(r"(?<![\w:])([a-zA-Z_:][\w:]*)\s*\{([^}]*)\}")
_MATCHER_LABEL = re.compile(r"(\w+)\s*(?:=~|!~|!=|=)")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_LABEL_REPLACE_TARGET = re.compile(r',\s*"(\w+)",\s*"[^"]*",\s*"\w*",\s*"[^"]*"\s*\)')


def _load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def _rules() -> list[dict[str, Any]]:
    return [rule for group in _load(RULES)["groups"] for rule in group["rules"]]


def _alerts() -> list[dict[str, Any]]:
    return [rule for rule in _rules() if "alert" in rule]


def test_every_alert_is_tested_firing_and_silent() -> None:
    firing: set[str] = set()
    silent: set[str] = set()
    tested_exprs = []
    for case in _load(RULE_TESTS)["tests"]:
        for check in case.get("alert_rule_test", []):
            (firing if check.get("exp_alerts") else silent).add(check["alertname"])
        tested_exprs += [check["expr"] for check in case.get("promql_expr_test", [])]
    for alert in _alerts():
        name = alert["alert"]
        assert name in firing, f"{name}: no promtool test where it fires"
        assert name in silent, f"{name}: no promtool test where it stays silent"
    for rule in _rules():
        if "record" in rule:
            assert any(rule["record"] in expr for expr in tested_exprs), (
                f"{rule['record']}: no promql_expr_test reads it"
            )


def _slug(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _doc_anchors() -> set[str]:
    text = DEPLOY_DOC.read_text()
    text = re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)  # not # comments
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, re.M)}


@pytest.mark.parametrize("alert", _alerts(), ids=lambda a: a["alert"])
def test_alert_has_annotations_and_a_runbook(alert: dict[str, Any]) -> None:
    name = alert["alert"]
    annotations = alert.get("annotations", {})
    for key in ("summary", "description", "runbook_url"):
        assert str(annotations.get(key, "")).strip(), f"{name}: no {key} annotation"
    assert alert.get("labels", {}).get("severity") in {"critical", "warning"}, name
    url = annotations["runbook_url"]
    assert url.startswith(RUNBOOK_BASE), f"{name}: runbook_url {url} is not under {RUNBOOK_BASE}"
    anchor = url[len(RUNBOOK_BASE) :]
    assert anchor == _slug(name), f"{name}: runbook_url should point at its own heading ({anchor})"
    assert anchor in _doc_anchors(), f"{name}: docs/deploy.md has no heading for #{anchor}"


def _exported() -> dict[str, set[str]]:
    """Each name a query can use for the daemon's metrics, with the labels its series carry."""
    families = text_string_to_metric_families(GOLDEN.read_text())
    # the allow-listed env labels, and the job key the agent makes of the environment
    env = {label_name(key) for key in ENV_LABELS} | {jobkey.LABEL}
    names: dict[str, set[str]] = {}
    for family in families:
        labels = {label for sample in family.samples for label in sample.labels}
        if "service_pid" in labels:  # a process metric: these labels may appear
            labels |= env
        # the parser strips a counter's _total and a histogram's suffixes from the family name
        suffixes = {
            "counter": ["_total"],
            "histogram": ["_bucket", "_sum", "_count"],
        }.get(family.type, [""])
        for suffix in suffixes:
            names[family.name + suffix] = labels | TARGET_LABELS
    return names


def test_rules_use_only_exported_metrics_and_labels() -> None:
    exported = {**_exported(), **FOREIGN_METRICS}
    recorded = {rule["record"] for rule in _rules() if "record" in rule}
    created = set()  # labels that the rules make with label_replace
    for rule in _rules():
        created |= set(_LABEL_REPLACE_TARGET.findall(rule["expr"]))
    every_label = set().union(*exported.values()) | created
    problems = []
    for rule in _rules():
        name = rule.get("alert") or rule["record"]
        expr = rule["expr"]
        for ident in _IDENTIFIER.findall(_STRING.sub('""', expr)):
            if ident.startswith("hangwatch:") and ident not in recorded:
                problems.append(f"{name}: {ident} is not recorded by any rule")
            elif (ident.startswith("hangwatch_") or ident in FOREIGN_METRICS) and (
                ident not in exported
            ):
                problems.append(f"{name}: {ident} is not exported (tests/golden/metrics.txt)")
        for metric, body in _SELECTOR.findall(expr):
            for label in _MATCHER_LABEL.findall(body):
                if metric in exported and label not in exported[metric]:
                    problems.append(f"{name}: {metric} has no label {label}")
        for group in _GROUPING.findall(expr):
            for label in filter(None, (part.strip() for part in group.split(","))):
                if label not in every_label:
                    problems.append(f"{name}: no metric has a label {label}")
    assert not problems, "\n".join(problems)


def test_metric_name_check_catches_a_wrong_name() -> None:
    # The check above must see names inside selectors and functions, and not inside strings.
    expr = 'rate(hangwatch_nope_total[5m]) > 0 and label_replace(up, "x", "hangwatch_ok", "", "")'
    found = _IDENTIFIER.findall(_STRING.sub('""', expr))
    assert [i for i in found if i.startswith("hangwatch_") or i == "up"] == [
        "hangwatch_nope_total",
        "up",
    ]
    assert "hangwatch_nope_total" not in _exported()


# ---- what the hang alerts and their runbooks tell people to run ----------------------------
#
# The first step for a hang is `hangwatch diagnose` (stacks of every parked thread, without
# stopping the process) and the daemon's log line for the state change. A py-spy dump without
# --nonblocking, or gdb, ptrace-stops every thread of a serving process: the texts must never
# send anyone there first, and every py-spy dump they show must carry --nonblocking.

HANG_ALERTS = {
    "HangwatchDeadlock",
    "HangwatchNoWaker",
    "HangwatchAllThreadsParked",
    "HangwatchGpuSpin",
    "HangwatchJobStraggler",
}
HANG_RUNBOOKS = HANG_ALERTS | {"First, for every hang alert"}
# $p.Labels: a pid that the alert's template looks up (HangwatchJobStraggler's rank's process)
_DIAGNOSE_FIRST = re.compile(r"hangwatch diagnose --pid {{ \$(?:labels|p\.Labels)\.\w+ }}")
_STOPPERS = re.compile(r"py-spy|gdb", re.IGNORECASE)
_CODE_SPAN = re.compile(r"`([^`]*)`")
_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z`*(\[])|\n\s*\n")


def _hang_alerts() -> list[dict[str, Any]]:
    return [alert for alert in _alerts() if alert["alert"] in HANG_ALERTS]


def test_hang_alerts_are_the_workload_alerts() -> None:
    # A new critical workload alert must join HANG_ALERTS, and so the checks below.
    workload = {
        alert["alert"]
        for alert in _alerts()
        if alert.get("labels", {}).get("severity") == "critical"
        and "component" not in alert.get("labels", {})
    }
    assert workload == HANG_ALERTS


@pytest.mark.parametrize("alert", _hang_alerts(), ids=lambda a: a["alert"])
def test_hang_alert_says_hangwatch_diagnose_before_any_stack_dumper(alert: dict[str, Any]) -> None:
    text = " ".join(alert["annotations"]["description"].split())
    first = _DIAGNOSE_FIRST.search(text)
    assert first, f"{alert['alert']}: no `hangwatch diagnose --pid {{{{ $labels.… }}}}`"
    dumper = _STOPPERS.search(text)
    assert dumper is None or first.start() < dumper.start(), (
        f"{alert['alert']}: {dumper and dumper.group()} comes before hangwatch diagnose"
    )
    # The flight record, and the warning.
    assert "journalctl -u hangwatch" in text, alert["alert"]
    assert "--nonblocking" in text and "stop every thread" in text, alert["alert"]


def _py_spy_dumps_without_nonblocking(text: str) -> list[str]:
    """Each command (a code span or a fenced line) and each sentence that mentions a py-spy
    dump but not --nonblocking."""
    problems = []
    for fence in _FENCE.findall(text):
        problems += [ln for ln in fence.splitlines() if "py-spy dump" in ln]
    prose = _FENCE.sub("", text)
    problems += [s for s in _CODE_SPAN.findall(prose) if "py-spy dump" in s]
    for sentence in _SENTENCE_END.split(prose):
        if "py-spy dump" in sentence:
            problems.append(" ".join(sentence.split()))
    return [p for p in problems if "--nonblocking" not in p]


def test_every_py_spy_dump_in_the_rules_is_nonblocking() -> None:
    problems = []
    for alert in _alerts():
        for key, value in alert.get("annotations", {}).items():
            text = " ".join(str(value).split())
            problems += [
                f"{alert['alert']} {key}: {p}" for p in _py_spy_dumps_without_nonblocking(text)
            ]
    assert not problems, "\n".join(problems)


def test_every_py_spy_dump_in_the_runbooks_is_nonblocking() -> None:
    problems = _py_spy_dumps_without_nonblocking(DEPLOY_DOC.read_text())
    assert not problems, "\n".join(problems)


def test_nonblocking_check_catches_a_blocking_dump() -> None:
    assert _py_spy_dumps_without_nonblocking("Run `py-spy dump --pid 1`.") != []
    assert _py_spy_dumps_without_nonblocking("Then take stacks with py-spy dump or gdb.") != []
    assert _py_spy_dumps_without_nonblocking("```sh\npy-spy dump --native --pid 1\n```\n") != []
    assert _py_spy_dumps_without_nonblocking("Use `py-spy dump --nonblocking --pid 1`.") == []
    # Saying what a blocking dump does is fine, as long as it says how not to.
    fine = "A py-spy dump without `--nonblocking` stops every thread. Use gdb later."
    assert _py_spy_dumps_without_nonblocking(fine) == []


def _runbook_sections() -> dict[str, str]:
    text = _FENCE.sub(lambda m: m.group(0).replace("#", ""), DEPLOY_DOC.read_text())
    parts = re.split(r"^### (.+)$", text, flags=re.MULTILINE)
    return {parts[i].strip(): parts[i + 1].split("\n## ")[0] for i in range(1, len(parts), 2)}


@pytest.mark.parametrize("heading", sorted(HANG_RUNBOOKS))
def test_hang_runbook_says_hangwatch_diagnose_before_any_stack_dumper(heading: str) -> None:
    sections = _runbook_sections()
    assert heading in sections, f"docs/deploy.md has no ### {heading}"
    text = sections[heading]
    first = text.find("hangwatch diagnose")
    assert first >= 0, f"{heading}: no hangwatch diagnose"
    dumper = _STOPPERS.search(text)
    assert dumper is None or first < dumper.start(), (
        f"{heading}: {dumper and dumper.group()} comes before hangwatch diagnose"
    )
