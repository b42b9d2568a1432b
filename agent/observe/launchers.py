"""What a process's command line and environment say about a distributed job's plumbing.

torch's launcher and its ranks name the ports the job talks over: ``MASTER_PORT`` in a rank's
environment, torchrun's ``--master-port`` and ``--rdzv-endpoint`` on its command line (with
their defaults when absent), and any port a command line asks for by number (``--port 8000``).
agent.analysis.frontdoor tells plumbing from front doors by them.

Pure: the raw argv and environment block that agent.sources.procfs reads go in, a
model.Plumbing comes out; no I/O, total on any input. In observe/, not analysis/, because the
sampler calls it once per process while it builds the snapshot, and a snapshot builder imports
no analysis (tests/test_layering.py).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from ..model import Plumbing

# torchrun's own default (torch/distributed/run.py): the static rendezvous's store port when
# no --master-port is given.
TORCHRUN_DEFAULT_MASTER_PORT = 29500


_PORT = re.compile(r"[0-9]{1,5}")


def _port(text: str) -> int | None:
    """A TCP port 1-65535 written as plain digits (0, 'auto', '29_500': None)."""
    value = int(text) if _PORT.fullmatch(text) else 0
    return value if 0 < value < 1 << 16 else None


def parse_master_port(environ: bytes) -> int | None:
    """MASTER_PORT of a NUL-separated environment block; the last one wins, as in os.environ."""
    port = None
    for item in environ.split(b"\0"):
        if item.startswith(b"MASTER_PORT="):
            port = _port(item[len(b"MASTER_PORT=") :].decode("ascii", "replace").strip())
    return port


def parse_rdzv_port(endpoint: str) -> int | None:
    """The port of torchrun's --rdzv-endpoint HOST[:PORT] ('[v6]', '[v6]:PORT'); without a port,
    the c10d backend's default 29400 (torch.distributed.elastic.rendezvous.utils)."""
    endpoint = endpoint.strip()
    if not endpoint:
        return None
    if endpoint.startswith("[") and endpoint.endswith("]"):
        return RDZV_DEFAULT_PORT
    host, sep, port = endpoint.rpartition(":")
    if not sep:
        return RDZV_DEFAULT_PORT
    return _port(port) if host else None


RDZV_DEFAULT_PORT = 29400
LAUNCHER_MODULES = ("torch.distributed.run", "torch.distributed.launch")
_PORT_FLAGS = {
    "--master_port": "--master-port",
    "--master-port": "--master-port",
    "--rdzv_endpoint": "--rdzv-endpoint",
    "--rdzv-endpoint": "--rdzv-endpoint",
}


def _basename(path: str) -> str:
    return path.rpartition("/")[2]  # os.path.basename's answer, without os


def _launcher(argv: Sequence[str]) -> str | None:
    """'torchrun' when the command line runs torch's launcher: ``torchrun ...``,
    ``python [opts] .../torchrun ...`` or ``python [opts] -m torch.distributed.run ...``."""
    if not argv:
        return None
    if _basename(argv[0]) == "torchrun":
        return "torchrun"
    i = 1
    while i < len(argv) and argv[i].startswith("-"):  # the interpreter's options
        if argv[i] == "-m":
            module = argv[i + 1] if i + 1 < len(argv) else ""
            return "torchrun" if module in LAUNCHER_MODULES else None
        i += 1
    return "torchrun" if i < len(argv) and _basename(argv[i]) == "torchrun" else None


def parse_plumbing(environ: bytes | None, argv: Sequence[str]) -> Plumbing:
    """A process's plumbing hints: MASTER_PORT from its environment; from its command line,
    whether it is torchrun and the ports of ``--master-port N``, ``--master_port=N``,
    ``--rdzv-endpoint HOST:PORT`` (both spellings, both forms). A torchrun given neither
    flag nor ``--standalone`` keeps its default master port, 29500."""
    flags: list[tuple[str, int]] = []
    standalone = False
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        standalone = standalone or arg == "--standalone"
        flag = _PORT_FLAGS.get(name)
        if flag is None:
            continue
        if not eq:
            if i + 1 >= len(argv):
                continue
            value = argv[i + 1]
        port = parse_rdzv_port(value) if flag == "--rdzv-endpoint" else _port(value.strip())
        if port is not None and (flag, port) not in flags:
            flags.append((flag, port))
    launcher = _launcher(argv)
    named = _named_ports(argv)
    if launcher is not None and not flags and not standalone:
        flags.append(("torchrun's default --master-port", TORCHRUN_DEFAULT_MASTER_PORT))
    master = parse_master_port(environ) if environ else None
    return Plumbing(
        master_port=master, launcher=launcher, flag_ports=tuple(flags), named_ports=named
    )


_HOST_PORT = re.compile(r"(?:[\w.\-]*|\[[0-9a-fA-F:.]*\]):(\d{1,5})")


def _named_ports(argv: Sequence[str]) -> tuple[int, ...]:
    """Ports a command line names: the value of a flag whose name has "port" in it
    (``--port 8000``, ``--port=8000``), any ``HOST:PORT`` or ``:PORT`` word, and a bare
    number of 1024 or more (``python -m http.server 8000``)."""
    out: list[int] = []
    for i, arg in enumerate(argv[1:], 1):
        name, eq, value = arg.partition("=")
        if name.startswith("-") and "port" in name.lower():
            got = _port(value) if eq else (_port(argv[i + 1]) if i + 1 < len(argv) else None)
        elif m := _HOST_PORT.fullmatch(value if eq else arg):
            got = _port(m.group(1))
        elif not arg.startswith("-") and (n := _port(arg)) is not None and n >= 1024:
            got = n
        else:
            got = None
        if got is not None and got not in out:
            out.append(got)
    return tuple(out)
