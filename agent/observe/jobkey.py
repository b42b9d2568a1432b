"""Which distributed job a process belongs to: its ``job_key`` label, from its environment.

A job is the set of ranks that wait for each other. Its key must be something every one of
its ranks carries and no other job's rank does, on any host, without the user doing anything
for hangwatch. The launchers our users run already hand each rank such a thing; in order of
trust:

1. an explicit id the launcher makes or the user gives: torchrun's ``TORCHELASTIC_RUN_ID``
   (its ``--rdzv_id``; not ``none``, torchrun's default, the same for every job), else Slurm's
   ``SLURM_JOB_ID`` with ``SLURM_STEP_ID`` (one ``srun`` step of an allocation);
2. the rendezvous endpoint every rank of a torch job is told (``MASTER_ADDR`` and
   ``MASTER_PORT``, which torchrun sets for static and dynamic rendezvous alike), with
   ``WORLD_SIZE``: two jobs running at once cannot listen on one address and port, and a rank
   cannot reach its peers without it;
3. the MPI launcher's job: PMIx's ``PMIX_NAMESPACE`` (Open MPI 5, PRRTE, ``srun --mpi=pmix``),
   else Open MPI 4's ``OMPI_MCA_ess_base_jobid``.

A loopback endpoint (``127.0.0.1``, ``localhost``, ``::1``, ``0.0.0.0``) names a job only on
its own host, and inside its own network namespace: two hosts' single-host jobs on
``127.0.0.1:29500``, or two containers' on one host, are different jobs. Such a key carries the
host (the agent's host name) and, for a process in another network namespace than the
agent's, that namespace's inode. A host name that resolves to loopback (Debian maps its own to
127.0.1.1) needs nothing: it differs between hosts. Names are never resolved (DNS is slow and
the target chooses the name).

Every part is a value the target controls: each must look like an identifier or an address
(``_PART``), and a variable that does not is ignored as if absent, so a key is one bounded
value per job (Prometheus cardinality) and never carries raw environment.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Mapping

from ..model import JOB_KEY_LABEL

LABEL = JOB_KEY_LABEL

# The variables read here; nothing else from the environment.
VARIABLES = (
    "TORCHELASTIC_RUN_ID",
    "SLURM_JOB_ID",
    "SLURM_STEP_ID",
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "PMIX_NAMESPACE",
    "OMPI_MCA_ess_base_jobid",
    "OMPI_COMM_WORLD_RANK",
    "PMIX_RANK",
    "OMPI_COMM_WORLD_SIZE",
)
NO_RUN_ID = ("", "none")  # torchrun's default --rdzv_id: every job's
_PART = re.compile(r"[A-Za-z0-9_.:@+-]{1,64}")
_PORT = re.compile(r"[0-9]{1,5}")
_COUNT = re.compile(r"[0-9]{1,9}")
_LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback")


def _get(env: Mapping[str, str], name: str, pattern: re.Pattern[str] = _PART) -> str:
    value = env.get(name, "")
    return value if pattern.fullmatch(value) else ""


def is_loopback(addr: str) -> bool:
    """Whether a rendezvous address reaches only the host it is used on."""
    name = addr.strip("[]").lower()
    if name in _LOOPBACK_NAMES or name.endswith(".localhost"):
        return True
    try:
        ip = ipaddress.ip_address(name)
    except ValueError:
        return False  # a host name: not resolved
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback or ip.is_unspecified


def _endpoint(addr: str, port: str) -> str:
    return f"[{addr}]:{port}" if ":" in addr and not addr.startswith("[") else f"{addr}:{port}"


def job_key(env: Mapping[str, str], host: Callable[[], str]) -> str:
    """The process's job key, "" when its environment names no job. ``host`` names where a
    loopback endpoint is valid (the host, and the network namespace when not the agent's);
    called only for one."""
    run_id = _get(env, "TORCHELASTIC_RUN_ID")
    if run_id not in NO_RUN_ID:
        return f"rdzv:{run_id}"
    slurm = _get(env, "SLURM_JOB_ID", _COUNT)
    if slurm:
        step = _get(env, "SLURM_STEP_ID", _PART)
        return f"slurm:{slurm}.{step}" if step else f"slurm:{slurm}"
    addr, port = _get(env, "MASTER_ADDR"), _get(env, "MASTER_PORT", _PORT)
    if addr and port:
        size = _get(env, "WORLD_SIZE", _COUNT)
        key = "tcp:" + _endpoint(addr, port) + (f"/{size}" if size else "")
        return f"{key}@{host()}" if is_loopback(addr) else key
    mpi = _get(env, "PMIX_NAMESPACE") or _get(env, "OMPI_MCA_ess_base_jobid")
    return f"mpi:{mpi}" if mpi else ""


def rank_of(env: Mapping[str, str]) -> str:
    """The process's rank in its job: RANK (torch), else the MPI launcher's world rank. Slurm's
    SLURM_PROCID is not one: under ``srun torchrun`` it numbers the torchrun agents, which are
    no ranks."""
    for name in ("RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        value = _get(env, name, _COUNT)
        if value:
            return value
    return ""


def world_size_of(env: Mapping[str, str]) -> str:
    """How many ranks its job has: WORLD_SIZE, else Open MPI's world size."""
    return _get(env, "WORLD_SIZE", _COUNT) or _get(env, "OMPI_COMM_WORLD_SIZE", _COUNT)
