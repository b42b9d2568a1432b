"""A job's key: what every rank of it shares and no other job does (agent.observe.jobkey)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.observe import jobkey
from agent.observe.discovery import env_labels, local_scope, process_labels
from agent.sources.procfs import ProcFS


def key(host: str = "node-a", **env: str) -> str:
    return jobkey.job_key(env, lambda: host)


def never() -> str:
    raise AssertionError("the host is asked only for a loopback endpoint")


def environ(**env: object) -> bytes:
    return b"\0".join(f"{k}={v}".encode() for k, v in env.items()) + b"\0"


TORCHRUN_STATIC = {  # what torchrun gives a worker without --rdzv_id
    "TORCHELASTIC_RUN_ID": "none",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
    "WORLD_SIZE": "4",
}


def test_an_explicit_id_comes_first_then_slurm_then_the_endpoint_then_mpi():
    mpi = {"PMIX_NAMESPACE": "prterun-node-a-4242@1"}
    slurm = {"SLURM_JOB_ID": "81234", "SLURM_STEP_ID": "0"}
    explicit = {**TORCHRUN_STATIC, "TORCHELASTIC_RUN_ID": "run-7"}
    assert key(**explicit, **slurm, **mpi) == "rdzv:run-7"
    assert key(**TORCHRUN_STATIC, **slurm, **mpi) == "slurm:81234.0"
    assert key(**TORCHRUN_STATIC, **mpi) == "tcp:10.0.0.1:29500/4"
    assert key(**mpi) == "mpi:prterun-node-a-4242@1"
    assert key(OMPI_MCA_ess_base_jobid="3524329473") == "mpi:3524329473"
    assert key() == ""


def test_torchruns_default_run_id_names_no_job():
    assert key(TORCHELASTIC_RUN_ID="none") == ""
    assert key(TORCHELASTIC_RUN_ID="") == ""


def test_the_endpoint_needs_address_and_port_and_keeps_the_world_size_when_given():
    assert key(MASTER_ADDR="10.0.0.1") == ""
    assert key(MASTER_PORT="29500") == ""
    assert key(MASTER_ADDR="node-0.cluster", MASTER_PORT="29500") == "tcp:node-0.cluster:29500"
    assert key(MASTER_ADDR="fd00::1", MASTER_PORT="29500", WORLD_SIZE="8") == (
        "tcp:[fd00::1]:29500/8"
    )
    assert key(SLURM_JOB_ID="81234") == "slurm:81234"


def test_every_rank_of_one_job_gets_one_key_and_two_endpoints_two():
    ranks = [
        {**TORCHRUN_STATIC, "RANK": str(r), "LOCAL_RANK": str(r % 2), "GROUP_RANK": str(r // 2)}
        for r in range(4)
    ]
    assert {jobkey.job_key(env, never) for env in ranks} == {"tcp:10.0.0.1:29500/4"}
    other = {**TORCHRUN_STATIC, "MASTER_PORT": "29600"}
    assert jobkey.job_key(other, never) != jobkey.job_key(TORCHRUN_STATIC, never)


@pytest.mark.parametrize(
    "addr",
    ["127.0.0.1", "127.3.2.1", "localhost", "LOCALHOST", "::1", "0.0.0.0", "::",
     "::ffff:127.0.0.1", "ip6-localhost", "trainer.localhost"],
)  # fmt: skip
def test_a_loopback_endpoint_is_scoped_to_its_host(addr):
    got = key("node-b", MASTER_ADDR=addr, MASTER_PORT="29500", WORLD_SIZE="2")
    assert got.startswith("tcp:") and got.endswith("/2@node-b"), got
    assert got != key("node-a", MASTER_ADDR=addr, MASTER_PORT="29500", WORLD_SIZE="2")


@pytest.mark.parametrize("addr", ["10.0.0.1", "node-0", "fd00::1", "192.0.2.2", "127.example"])
def test_a_routable_endpoint_is_the_same_from_every_host(addr):
    assert jobkey.job_key({"MASTER_ADDR": addr, "MASTER_PORT": "1"}, never).startswith("tcp:")


@pytest.mark.parametrize(
    "bad",
    ["a b", "x" * 65, "10.0.0.1\n", "run}7", 'run"7', "", "ü", "$(id)"],
)
def test_a_value_that_is_no_identifier_is_ignored_as_if_absent(bad):
    assert key(**{**TORCHRUN_STATIC, "TORCHELASTIC_RUN_ID": bad}) == "tcp:10.0.0.1:29500/4"
    assert key(**{**TORCHRUN_STATIC, "MASTER_ADDR": bad}) == ""
    assert key(**{**TORCHRUN_STATIC, "WORLD_SIZE": bad}) == "tcp:10.0.0.1:29500"
    assert key(SLURM_JOB_ID=bad, PMIX_NAMESPACE="ns") == "mpi:ns"
    assert key(MASTER_ADDR="10.0.0.1", MASTER_PORT="295000") == ""  # six digits: no port


def test_the_rank_is_torchs_else_the_mpi_launchers_and_never_slurms_task_number():
    assert jobkey.rank_of({"RANK": "3", "OMPI_COMM_WORLD_RANK": "5"}) == "3"
    assert jobkey.rank_of({"OMPI_COMM_WORLD_RANK": "5", "PMIX_RANK": "6"}) == "5"
    assert jobkey.rank_of({"PMIX_RANK": "6"}) == "6"
    # `srun torchrun`: the agent has SLURM_PROCID (its node's number) and is no rank.
    assert jobkey.rank_of({"SLURM_PROCID": "1", "SLURM_JOB_ID": "81234"}) == ""
    assert jobkey.world_size_of({"OMPI_COMM_WORLD_SIZE": "16"}) == "16"
    assert jobkey.world_size_of({"WORLD_SIZE": "4", "OMPI_COMM_WORLD_SIZE": "16"}) == "4"


def test_labels_carry_the_key_and_the_mpi_rank():
    got = env_labels(environ(OMPI_COMM_WORLD_RANK=2, OMPI_COMM_WORLD_SIZE=8, PMIX_NAMESPACE="ns"))
    assert got == {"job_key": "mpi:ns", "rank": "2", "world_size": "8"}
    got = env_labels(environ(**TORCHRUN_STATIC, RANK=1, PATH="/bin"))
    assert got == {
        "job_key": "tcp:10.0.0.1:29500/4",
        "rank": "1",
        "torchelastic_run_id": "none",
        "world_size": "4",
    }


# The shape of every key: bounded, printable, one of the four kinds.
KEY = re.compile(r"(?:rdzv|slurm|tcp|mpi):[A-Za-z0-9_.:@+\-\[\]/]{1,220}")
NAMES = st.sampled_from([*jobkey.VARIABLES, "RANK", "PATH", "SLURM_PROCID", "HOME"])


# A process's environment cannot hold a NUL (the kernel separates its strings with one), and
# its bytes are what the test encodes: no lone surrogate, which UTF-8 cannot encode.
VALUES = st.text(
    st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)), max_size=80
)


@given(st.dictionaries(NAMES, VALUES, max_size=12), VALUES)
def test_any_environment_gives_a_bounded_key_from_the_named_variables_only(env, noise):
    got = jobkey.job_key(env, lambda: "node-a")
    assert got == "" or KEY.fullmatch(got), got
    # Nothing outside the named variables moves it.
    assert jobkey.job_key({**env, "PATH": noise, "HOME": noise}, lambda: "node-a") == got
    labels = env_labels(b"\0".join(f"{k}={v}".encode() for k, v in env.items()))
    assert labels.get("job_key", "") == got


def fake_proc(tmp_path: Path, own: str, theirs: str) -> ProcFS:
    root = tmp_path / "proc"
    for pid, ns in (("self", own), ("42", theirs)):
        (root / pid / "ns").mkdir(parents=True)
        os.symlink(ns, root / pid / "ns" / "net")
    (root / "42" / "environ").write_bytes(
        environ(MASTER_ADDR="127.0.0.1", MASTER_PORT=29500, WORLD_SIZE=2, RANK=0)
    )
    return ProcFS(str(root))


def test_a_container_of_its_own_network_gets_its_namespace_in_the_key(tmp_path):
    host = os.uname().nodename
    proc = fake_proc(tmp_path, "net:[4026531840]", "net:[4026532001]")
    assert local_scope(proc, 42) == f"{host}/net4026532001"
    assert process_labels(proc, 42)["job_key"] == f"tcp:127.0.0.1:29500/2@{host}/net4026532001"


def test_a_process_in_the_agents_network_gets_the_host_alone(tmp_path):
    proc = fake_proc(tmp_path, "net:[4026531840]", "net:[4026531840]")
    assert local_scope(proc, 42) == os.uname().nodename
