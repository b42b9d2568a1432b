"""Judge one /metrics scrape for tests/gpu/check_real_gpu.sh.

Usage: check_metrics.py URL PID SERVICE MIN_BYTES MAX_BYTES

Prints one line per condition, "PASS: ..." or "FAIL: ...", with the values seen, and exits 0
only when all three hold: the process's GPU memory (summed over its GPUs) is within
[MIN_BYTES, MAX_BYTES], its SM utilisation on some GPU is above 0, and its service is
progressing. Exit 1 otherwise, 2 when /metrics cannot be read.
"""

from __future__ import annotations

import sys
import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def main(argv: list[str]) -> int:
    url, pid, service = argv[1], argv[2], argv[3]
    lo, hi = int(argv[4]), int(argv[5])
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            text = resp.read().decode()
    except OSError as e:
        print(f"FAIL: cannot read {url}: {e}")
        return 2
    memory: dict[str, float] = {}
    util: dict[str, float] = {}
    states: dict[tuple[str, str, str], float] = {}
    roots: set[str] = set()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            lab = s.labels
            if s.name == "hangwatch_service_state":
                states[(lab.get("service", ""), lab.get("pid", ""), lab.get("state", ""))] = s.value
            if lab.get("pid") != pid or lab.get("service") != service:
                continue
            if s.name == "hangwatch_process_gpu_memory_bytes":
                memory[lab.get("gpu", "?")] = s.value
                roots.add(lab.get("service_pid", ""))
            elif s.name == "hangwatch_process_gpu_utilization_ratio":
                util[lab.get("gpu", "?")] = s.value
                roots.add(lab.get("service_pid", ""))
    # The process is its service's root unless an ancestor matched too: ask its labels.
    root = next(iter(roots)) if len(roots) == 1 else pid

    ok = True
    sel = f'service="{service}",pid="{pid}"'
    total = sum(memory.values()) if memory else None
    good = total is not None and lo <= total <= hi
    ok &= good
    print(
        f"{'PASS' if good else 'FAIL'}: hangwatch_process_gpu_memory_bytes{{{sel}}} = "
        f"{'absent' if total is None else int(total)} by GPU {memory or '{}'} "
        f"(want {lo}..{hi})"
    )
    best = max(util.values()) if util else None
    good = best is not None and best > 0
    ok &= good
    print(
        f"{'PASS' if good else 'FAIL'}: hangwatch_process_gpu_utilization_ratio{{{sel}}} = "
        f"{'absent' if best is None else best} by GPU {util or '{}'} (want > 0)"
    )
    state = states.get((service, root, "progressing"))
    good = state == 1
    ok &= good
    seen = {k[2]: v for k, v in states.items() if k[:2] == (service, root)}
    print(
        f'{"PASS" if good else "FAIL"}: hangwatch_service_state{{service="{service}",'
        f'pid="{root}",state="progressing"}} = {"absent" if state is None else state} '
        f"(all states {seen or '{}'}; want 1)"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
