"""The package's data flow, as a rule on imports: sources -> observe -> analysis -> report/export.

Read from the source with `ast`, so a violation fails here before any behaviour shows it:

* sources/ read the host and return plain data: they never import observe/, analysis/, report/
  or export/ (a reader that knows a verdict is an analysis hiding in I/O);
* analysis/ is pure: it imports no source, no observer, no report, and from the standard library
  only modules that do no I/O;
* report/ renders what it is given: it reads no source and observes nothing;
* nothing below report/ builds sentences: only report/ (and the commands above it) import it;
* export/ publishes the exposition: it reads no source and observes nothing;
* jobs/ is the ``hangwatch job`` command's package: it reads Prometheus, not the host, so it
  imports no source and observes nothing, and nothing but a command imports it.

Every top-level module is declared one of two kinds, and one that is neither fails:

* BASE (data, constants, errors, settings, the bounded worker): imported from every layer, so
  it imports no layer and no command itself;
* COMMANDS (the CLI's commands and the glue they share): they may import anything, and
  nothing but another command imports them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

AGENT = Path(__file__).resolve().parent.parent / "agent"

LAYERS = ("sources", "observe", "analysis", "report", "export", "jobs")

# What each layer may not import (agent sub-packages).
FORBIDDEN = {
    "sources": {"observe", "analysis", "report", "export", "jobs"},
    "observe": {"report", "export", "jobs"},
    "analysis": {"sources", "observe", "report", "export", "jobs"},
    "report": {"sources", "observe", "export", "jobs"},
    "export": {"sources", "observe", "report", "jobs"},
    "jobs": {"sources", "observe"},
}
# Inside observe/, only the Observer hands snapshots to the analysis; the modules that build a
# snapshot (discovery, the sampler and its caches, the report-time reads, and the parsers they
# call) know nothing of what it will mean.
SNAPSHOT_ONLY = {
    "discovery",
    "sampler",
    "threads",
    "socketcache",
    "fdwaits",
    "enrich",
    "jobkey",
    "launchers",
}

# Top-level modules every layer may import: they import no layer and no command.
# _build is the commit stamp a package build writes (agent/buildinfo.py); never in the checkout.
BASE = {
    "__init__",
    "_build",
    "abi",
    "buildinfo",
    "config",
    "errors",
    "model",
    "settings",
    "syscalls",
    "worker",
}
# Top-level modules that are commands or glue: they may import anything, and only a command
# imports them.
COMMANDS = {
    "__main__",
    "cli",
    "daemon",
    "diagnose",
    "explain",
    "preflight",
    "session",
    "status",
}

# The standard library analysis/ may use: computation only, no files, processes, sockets or clocks.
PURE_STDLIB = {
    "__future__",
    "bisect",
    "collections",
    "dataclasses",
    "enum",
    "functools",
    "heapq",
    "itertools",
    "math",
    "operator",
    "re",
    "statistics",
    "typing",
}


def _module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, root: Path) -> set[str]:
    """Every module `path` imports, absolute ("agent.analysis.classify", "os"), relative resolved."""
    name = _module_name(path, root)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                mod = ".".join([*base, node.module] if node.module else base)
            else:
                mod = node.module or ""
            if node.module:
                found.add(mod)
            else:  # `from . import x` imports the module x itself
                found.update(f"{mod}.{a.name}" for a in node.names)
    return found


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    if len(parts) >= 2 and parts[0] == "agent" and parts[1] in LAYERS:
        return parts[1]
    return None


def top_level_of(path: Path, root: Path) -> str | None:
    """The name of a top-level module ("model", "__init__" for the package), None below it."""
    rel = path.relative_to(root)
    return rel.stem if len(rel.parts) == 1 else None


def undeclared(root: Path) -> set[str]:
    """The top-level modules under `root` that are neither BASE nor COMMANDS."""
    found = {top_level_of(p, root) for p in root.glob("*.py")}
    return {name for name in found if name is not None and name not in BASE | COMMANDS}


def _is_command(parts: list[str]) -> bool:
    return parts[0] == "agent" and len(parts) >= 2 and parts[1] in COMMANDS


def violations(root: Path) -> set[tuple[str, str]]:
    """(importer, imported) for every import that goes against the data flow under `root`."""
    bad: set[tuple[str, str]] = set()
    top = root.name
    for path in sorted(root.rglob("*.py")):
        name = _module_name(path, root)
        module = top_level_of(path, root)
        layer = layer_of(name.replace(top, "agent", 1))
        if module is not None and module not in COMMANDS:
            # A base module (or an undeclared one, held to the same rule): no layer, no command.
            for imp in imports_of(path, root):
                imp_agent = imp.replace(top, "agent", 1) if imp.split(".")[0] == top else imp
                if layer_of(imp_agent) is not None or _is_command(imp_agent.split(".")):
                    bad.add((name, imp))
            continue
        if layer is None:
            continue
        for imp in imports_of(path, root):
            imp_agent = imp.replace(top, "agent", 1) if imp.split(".")[0] == top else imp
            target = layer_of(imp_agent)
            parts = imp_agent.split(".")
            if (
                (target is not None and target != layer and target in FORBIDDEN[layer])
                or (
                    layer == "observe"
                    and name.split(".")[-1] in SNAPSHOT_ONLY
                    and target == "analysis"
                )
                or _is_command(parts)
                or (layer == "analysis" and parts[0] != "agent" and parts[0] not in PURE_STDLIB)
            ):
                bad.add((name, imp))
    return bad


def test_the_package_follows_its_data_flow() -> None:
    assert not sorted(violations(AGENT)), "\n".join(
        f"{a} imports {b}" for a, b in sorted(violations(AGENT))
    )


def test_every_top_level_module_is_declared() -> None:
    assert not sorted(undeclared(AGENT)), (
        f"top-level modules neither in BASE nor in COMMANDS: {sorted(undeclared(AGENT))}"
    )


def test_every_layer_exists() -> None:
    for layer in LAYERS:
        assert (AGENT / layer / "__init__.py").is_file(), layer


def _plant(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "agent"
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    for layer in LAYERS:
        (root / layer).mkdir(parents=True, exist_ok=True)
        (root / layer / "__init__.py").touch()
    return root


@pytest.mark.parametrize(
    ("rel", "text", "expect"),
    [
        ("sources/procfs.py", "from ..analysis import classify\n", "agent.analysis.classify"),
        (
            "sources/procfs.py",
            "from ..analysis.frontdoor import endpoint\n",
            "agent.analysis.frontdoor",
        ),
        ("analysis/classify.py", "from ..sources.procfs import ProcFS\n", "agent.sources.procfs"),
        ("analysis/classify.py", "from ..report import sentences\n", "agent.report.sentences"),
        ("analysis/dating.py", "import os\n", "os"),
        ("analysis/dating.py", "from subprocess import run\n", "subprocess"),
        (
            "observe/sampler.py",
            "from ..report.sentences import reasons\n",
            "agent.report.sentences",
        ),
        (
            "report/text.py",
            "from ..sources.symbols import native_caller\n",
            "agent.sources.symbols",
        ),
        ("report/text.py", "from agent.observe import enrich\n", "agent.observe.enrich"),
        ("export/metrics.py", "from ..sources import procfs\n", "agent.sources.procfs"),
        ("sources/probe.py", "from .. import daemon\n", "agent.daemon"),
        ("observe/sampler.py", "from ..analysis.waitgraph import x\n", "agent.analysis.waitgraph"),
        ("sources/procfs.py", "from .. import session\n", "agent.session"),
        ("analysis/classify.py", "from ..jobs import ranks\n", "agent.jobs.ranks"),
        ("jobs/ranks.py", "from ..observe import jobkey\n", "agent.observe.jobkey"),
        ("jobs/prom.py", "from ..sources.procfs import ProcFS\n", "agent.sources.procfs"),
        ("jobs/command.py", "from .. import daemon\n", "agent.daemon"),
        # Top level: a base module imports no layer and no command.
        ("model.py", "from .sources.procfs import ProcFS\n", "agent.sources.procfs"),
        ("config.py", "from .analysis.frontdoor import X\n", "agent.analysis.frontdoor"),
        ("settings.py", "import agent.observe.enrich\n", "agent.observe.enrich"),
        ("errors.py", "from .report import text\n", "agent.report.text"),
        ("syscalls.py", "from .export.metrics import registry_for\n", "agent.export.metrics"),
        ("abi.py", "from .jobs.prom import Prometheus\n", "agent.jobs.prom"),
        ("config.py", "from . import daemon\n", "agent.daemon"),
        ("model.py", "from .cli import main\n", "agent.cli"),
        ("__init__.py", "from .session import Session\n", "agent.session"),
        # An undeclared top-level module is held to the base rule too.
        ("glue.py", "from .observe.enrich import native_frame\n", "agent.observe.enrich"),
    ],
)
def test_a_planted_violation_fails(tmp_path: Path, rel: str, text: str, expect: str) -> None:
    root = _plant(tmp_path, {rel: text})
    found = {imp for _, imp in violations(root)}
    assert any(expect == imp or expect.startswith(imp + ".") for imp in found), found


def test_allowed_directions_pass(tmp_path: Path) -> None:
    root = _plant(
        tmp_path,
        {
            "model.py": "import os\n",
            "sources/procfs.py": "import os\nfrom ..model import TcpInfo\n",
            "observe/sampler.py": "from ..sources.procfs import ProcFS\n",
            "observe/observer.py": "from .sampler import Sampler\nfrom ..analysis import waitgraph\n",
            "analysis/classify.py": "import re\nfrom ..model import ProcessSample\nfrom . import evidence\n",
            "report/sentences.py": "import time\nfrom ..analysis import evidence as ev\n",
            "export/metrics.py": "from ..analysis.classify import STATES\n",
        },
    )
    assert violations(root) == set()


def test_commands_may_import_anything_and_each_other(tmp_path: Path) -> None:
    root = _plant(
        tmp_path,
        {
            "__main__.py": "from .cli import main\n",
            "cli.py": "from .daemon import run\nfrom .jobs.command import run\nfrom . import config\n",
            "daemon.py": "from . import session\nfrom .sources.procfs import ProcFS\n",
            "diagnose.py": "from .report import text\nfrom .observe.observer import Observer\n",
            "session.py": "from .observe.observer import Observer\nfrom . import preflight\n",
            "preflight.py": "from .errors import KernelFeatureError\n",
            "jobs/command.py": "from ..report import text\nfrom ..analysis import classify\n",
        },
    )
    assert violations(root) == set()
    assert undeclared(root) == set()


def test_an_undeclared_top_level_module_fails(tmp_path: Path) -> None:
    root = _plant(tmp_path, {"waiting.py": "import threading\n", "model.py": "import re\n"})
    assert undeclared(root) == {"waiting"}
