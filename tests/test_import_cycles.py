"""No import cycle among the analysis modules, read from the source with `ast`.

Every import counts, those under ``if TYPE_CHECKING:`` and inside functions too: a cycle
hidden from the interpreter still ties the modules into one, and says a type is in the wrong
module (the verdict's types live in agent.analysis.verdict so the ladder and the culprit both
import them).
"""

from __future__ import annotations

import ast
from pathlib import Path

AGENT = Path(__file__).resolve().parent.parent / "agent"


def _targets(node: ast.Import | ast.ImportFrom, package: str) -> set[str]:
    """The modules of the package (by their dotted names from it: "classify") that one
    import statement in it names: ``from .x import y``, ``from . import x``,
    ``from ..analysis.x import y``, ``from agent.analysis import x``, ``import agent.analysis.x``."""
    if isinstance(node, ast.Import):
        prefix = ["agent", package]
        return {".".join(p[2:]) for a in node.names if (p := a.name.split("."))[:2] == prefix} - {
            ""
        }
    parts = (node.module or "").split(".") if node.module else []
    if node.level == 1:
        rest = parts
    elif node.level == 2 and parts[:1] == [package]:
        rest = parts[1:]
    elif node.level == 0 and parts[:2] == ["agent", package]:
        rest = parts[2:]
    else:
        return set()
    if rest:
        return {rest[0]}
    return {a.name for a in node.names}  # from <the package> import x, y


def analysis_imports(package: Path) -> dict[str, set[str]]:
    """Per module of ``package`` (agent/analysis), the modules of the same package it imports
    (by their file names: "classify", "culprit"), however the import is spelt."""
    mine = {p.stem for p in package.glob("*.py")}
    graph: dict[str, set[str]] = {}
    for path in sorted(package.glob("*.py")):
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found |= {t.split(".")[0] for t in _targets(node, package.name)}
        graph[path.stem] = {m for m in found if m in mine and m != path.stem}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each module that lies on one (depth first), as module names."""
    found: list[list[str]] = []
    done: set[str] = set()

    def visit(m: str, path: list[str]) -> None:
        if m in path:
            found.append([*path[path.index(m) :], m])
            return
        if m in done:
            return
        for n in sorted(graph.get(m, ())):
            visit(n, [*path, m])
        done.add(m)

    for m in sorted(graph):
        visit(m, [])
    return found


def test_no_cycle_among_analysis_modules() -> None:
    graph = analysis_imports(AGENT / "analysis")
    assert {"classify", "culprit", "verdict"} <= graph.keys()
    assert "verdict" in graph["culprit"] and "culprit" in graph["classify"]
    assert cycles(graph) == []


def test_the_old_classify_culprit_pair_is_a_cycle(tmp_path: Path) -> None:
    """The pair as it was: the classifier imported the culprit, and the culprit the
    classifier's types under TYPE_CHECKING. The check finds it, however either is spelt."""
    pkg = tmp_path / "agent" / "analysis"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "evidence.py").write_text("")
    (pkg / "classify.py").write_text(
        "from . import evidence as ev\nfrom .culprit import find_culprit\n"
    )
    (pkg / "culprit.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "from . import evidence as ev\n"
        "if TYPE_CHECKING:\n"
        "    from .classify import ProcessFacts, ServiceVerdict\n"
    )
    assert cycles(analysis_imports(pkg)) == [["classify", "culprit", "classify"]]
    for spelt in (
        "from ..analysis.classify import ServiceVerdict\n",
        "from ..analysis import classify\n",
        "from agent.analysis.classify import ServiceVerdict\n",
        "import agent.analysis.classify\n",
        "from . import classify\n",
        "def f():\n    from .classify import ServiceVerdict\n",
    ):
        (pkg / "culprit.py").write_text(spelt)
        assert cycles(analysis_imports(pkg)) == [["classify", "culprit", "classify"]], spelt
    (pkg / "culprit.py").write_text("from . import evidence\n")
    assert cycles(analysis_imports(pkg)) == []
