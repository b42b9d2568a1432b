#!/usr/bin/env bash
# hangwatch against a real GPU: a PyTorch process that holds a known amount of GPU memory and
# runs matmuls must appear in /metrics with that memory, a non-zero SM utilisation, and its
# service progressing. The fake NVML of tests/test_gpu.py cannot prove what the driver says.
#
# Needs an NVIDIA GPU and driver, PyTorch with CUDA, and root (the daemon loads BPF). Not run by
# `make test`. Exit 0 only on PASS.
#
#   sudo tests/gpu/check_real_gpu.sh
#
# Environment: ALLOC_GIB (default 2), PORT (default: a free one), TORCH_PYTHON (an interpreter
# with torch, when neither the repo's .venv nor python3 has it), DEADLINE_S (default 60).
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
here="$repo/tests/gpu"
alloc_gib=${ALLOC_GIB:-2}
deadline_s=${DEADLINE_S:-60}
service=gpucheck

py=python3
if [[ -x "$repo/.venv/bin/python" ]]; then
    py="$repo/.venv/bin/python"
fi

work=$(mktemp -d)
load_pid=""
agent_pid=""

# shellcheck disable=SC2317  # reached through the EXIT trap, which shellcheck does not follow
stop() { # pid: TERM, a few seconds' grace, then KILL
    local pid=$1
    kill -TERM "$pid" 2>/dev/null || return 0
    for _ in $(seq 50); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
}

# shellcheck disable=SC2317  # the EXIT trap runs it
cleanup() {
    if [[ -n $agent_pid ]]; then stop "$agent_pid"; fi
    if [[ -n $load_pid ]]; then stop "$load_pid"; fi
    rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM # the EXIT trap cleans up

fail() {
    echo "FAIL: $*"
    exit 1
}

if [[ $(id -u) -ne 0 ]]; then
    fail "run as root: the daemon loads BPF programs (sudo $0)"
fi

# The interpreter with CUDA-enabled torch: the repo's .venv rarely has it.
torch_py=${TORCH_PYTHON:-}
if [[ -z $torch_py ]]; then
    for cand in "$py" python3; do
        if "$cand" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
            torch_py=$cand
            break
        fi
    done
fi
if [[ -z $torch_py ]]; then
    fail "no python with CUDA-enabled torch (set TORCH_PYTHON)"
fi

port=${PORT:-$("$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}

# The load: exactly ALLOC_GIB GiB in one tensor, then small matmuls forever. Small, so that
# its own memory stays well inside the 1.5 GiB allowed for the CUDA context on top.
cat >"$work/load.py" <<'EOF'
import sys

import torch

gib = int(sys.argv[1])
dev = torch.device("cuda:0")
hold = torch.ones(gib << 30, dtype=torch.uint8, device=dev)  # touched: really resident
a = torch.randn(2048, 2048, device=dev)
b = torch.randn(2048, 2048, device=dev)
torch.cuda.synchronize()
print("ready", flush=True)
while True:
    for _ in range(20):
        c = a @ b
    torch.cuda.synchronize()
EOF
"$torch_py" "$work/load.py" "$alloc_gib" >"$work/load.log" 2>&1 &
load_pid=$!

for _ in $(seq $((deadline_s * 10))); do
    grep -q '^ready' "$work/load.log" && break
    kill -0 "$load_pid" 2>/dev/null || fail "the torch load exited: $(tail -5 "$work/load.log")"
    sleep 0.1
done
grep -q '^ready' "$work/load.log" || fail "the torch load was not ready in ${deadline_s} s"
echo "load: pid $load_pid holds ${alloc_gib} GiB on cuda:0 and runs matmuls ($torch_py)"

cat >"$work/config.yaml" <<EOF
listen: "127.0.0.1:$port"
interval_seconds: 1
park_threshold_seconds: 60
targets:
  - name: $service
    gpu: true
EOF

(cd "$repo" && exec "$py" -m agent run --config "$work/config.yaml") >"$work/agent.log" 2>&1 &
agent_pid=$!
echo "agent: pid $agent_pid, /metrics on 127.0.0.1:$port ($py)"

min_bytes=$((alloc_gib << 30))
max_bytes=$(((alloc_gib << 30) + (3 << 29))) # + 1.5 GiB for the CUDA context and the matrices
end=$((SECONDS + deadline_s))
verdict=""
while ((SECONDS < end)); do
    if ! kill -0 "$agent_pid" 2>/dev/null; then
        echo "agent log:"
        tail -20 "$work/agent.log"
        fail "the agent exited"
    fi
    if verdict=$("$py" "$here/check_metrics.py" "http://127.0.0.1:$port/metrics" \
        "$load_pid" "$service" "$min_bytes" "$max_bytes"); then
        echo "$verdict"
        echo "PASS"
        exit 0
    fi
    sleep 1
done

echo "${verdict:-FAIL: /metrics never answered}"
echo "agent log (last 20 lines):"
tail -20 "$work/agent.log"
echo "FAIL"
exit 1
