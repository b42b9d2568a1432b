"""The explain step, shared by `diagnose` and the daemon's flight record: read what the words
need beyond the snapshot (stacks first, then what the report asks given them), and name the
verdicts' lock words from it. Everything after this renders; nothing after it reads."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from .analysis.lockwords import named_verdicts
from .analysis.verdict import ServiceVerdict
from .model import Enrichment, Snapshot, StackRead, Wanted
from .observe import enrich
from .settings import STACKS_BUDGET_S
from .sources.procfs import ProcFS
from .sources.pystacks import SourceLines


@dataclass(frozen=True)
class Explained:
    verdicts: list[ServiceVerdict]  # with their lock words named
    inputs: Enrichment  # what the renderer shows beyond the snapshot


def explain(
    proc: ProcFS,
    snap: Snapshot,
    verdicts: Sequence[ServiceVerdict],
    stacks_of: Sequence[int],
    wanted: Callable[[Mapping[int, StackRead]], Wanted],
    budget_s: float = STACKS_BUDGET_S,
    source: SourceLines | None = None,
) -> Explained:
    """Read the stacks of ``stacks_of`` within ``budget_s``, then what ``wanted`` asks given
    them; return the verdicts named and the reads."""
    stacks = enrich.read_stacks(proc, snap.processes, stacks_of, budget_s, source)
    inputs = enrich.read_asked(proc, snap.processes, stacks, wanted(stacks))
    return Explained(named_verdicts(list(verdicts), snap, inputs.words), inputs)
