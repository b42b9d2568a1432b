"""What a command line and an environment say about a distributed job's plumbing
(agent.observe.launchers): torchrun's flags, MASTER_PORT, the ports a command line names."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from agent.model import Plumbing
from agent.observe.launchers import parse_master_port, parse_plumbing, parse_rdzv_port


def test_parse_master_port():
    env = b"PATH=/usr/bin\0MASTER_ADDR=127.0.0.1\0MASTER_PORT=29611\0RANK=0\0"
    assert parse_master_port(env) == 29611
    assert parse_master_port(b"MASTER_PORT=1\0MASTER_PORT=2\0") == 2  # the last, as os.environ
    assert parse_master_port(b"XMASTER_PORT=5\0") is None
    for bad in (b"MASTER_PORT=0", b"MASTER_PORT=70000", b"MASTER_PORT=2_9500", b"MASTER_PORT="):
        assert parse_master_port(bad) is None, bad
    assert parse_master_port(b"MASTER_PORT=\xff\xfe") is None


def test_parse_rdzv_port():
    assert parse_rdzv_port("127.0.0.1:29633") == 29633
    assert parse_rdzv_port("node1.example.com") == 29400  # the c10d backend's default
    assert parse_rdzv_port("[::1]:29633") == 29633
    assert parse_rdzv_port("[::1]") == 29400
    assert parse_rdzv_port("localhost:0") is None  # auto-assigned: nothing to name
    assert parse_rdzv_port("") is None
    assert parse_rdzv_port("host:port") is None


TORCHRUN = "/venv/bin/python3 /venv/bin/torchrun"


def plumbing(cmdline: str, environ: bytes | None = None) -> Plumbing:
    return parse_plumbing(environ, cmdline.split())


def test_the_ports_a_command_line_names():
    cases = {
        "python -m vllm.entrypoints.openai.api_server /m --port 8123 --host 127.0.0.1": (8123,),
        "uvicorn app:app --port=9000": (9000,),
        "gunicorn -b 0.0.0.0:8080 app:app": (8080,),
        "python -m http.server 8000": (8000,),
        "server --listen [::1]:7000 --workers 4": (7000,),
        "python train.py --epochs 3 --lr 0.1 --port auto": (),
        "python -m sglang.launch_server --port 0": (),
    }
    for cmd, want in cases.items():
        assert plumbing(cmd).named_ports == want, cmd


def test_torchrun_flags_in_all_their_spellings():
    for flags, want in [
        ("--master_port=29611", (("--master-port", 29611),)),
        ("--master-port=29611", (("--master-port", 29611),)),
        ("--master_port 29611", (("--master-port", 29611),)),
        ("--master-port 29611", (("--master-port", 29611),)),
        ("--rdzv_endpoint=127.0.0.1:29633", (("--rdzv-endpoint", 29633),)),
        ("--rdzv-endpoint 127.0.0.1:29633", (("--rdzv-endpoint", 29633),)),
        ("--rdzv-endpoint=h --master_port=1", (("--rdzv-endpoint", 29400), ("--master-port", 1))),
        ("--standalone", ()),
        ("--standalone --rdzv-endpoint=localhost:0", ()),
        ("", (("torchrun's default --master-port", 29500),)),
        ("--master_port=auto", (("torchrun's default --master-port", 29500),)),
    ]:
        p = plumbing(f"{TORCHRUN} --nproc_per_node=2 {flags} train.py")
        assert p.launcher == "torchrun" and p.flag_ports == want, flags
        assert p.distributed and p.master_port is None


def test_torchrun_is_found_however_it_is_started():
    for cmd in (
        "torchrun --standalone x.py",
        "/usr/local/bin/torchrun x.py",
        "python3 -u /usr/local/bin/torchrun x.py",
        "python3 -m torch.distributed.run x.py",
        "python -u -m torch.distributed.launch --use-env x.py",
    ):
        assert plumbing(cmd).launcher == "torchrun", cmd
    for cmd in ("python3 train.py torchrun", "python3 -m torchrunner", "python3 -m x torchrun"):
        assert plumbing(cmd).launcher is None, cmd


def test_a_rank_by_its_environment_and_nothing_else_of_it():
    p = plumbing("python3 -u train.py", b"SECRET=hunter2\0MASTER_PORT=29611\0RANK=1\0")
    assert p == Plumbing(master_port=29611)
    assert p.ports == {29611} and p.distributed and p.why(29611) == "MASTER_PORT"
    assert p.why(1) is None
    assert plumbing("python3 -m http.server 8000", b"PATH=/bin\0") == Plumbing(named_ports=(8000,))
    assert not Plumbing().distributed and Plumbing().ports == frozenset()


def test_a_master_port_flag_on_any_command_line_counts():
    # deepspeed's launcher, a script's own flag: the port is the job's plumbing either way.
    p = plumbing("python -u -m deepspeed.launcher.launch --master_port=29700 train.py")
    assert p.launcher is None and p.flag_ports == (("--master-port", 29700),) and p.distributed


@given(
    st.lists(
        st.sampled_from(["torchrun", "--master_port", "--rdzv-endpoint", "-m", "[", ":", "="])
        | st.text(max_size=12),
        max_size=8,
    ),
    st.none() | st.binary(max_size=40) | st.just(b"MASTER_PORT=29500\0"),
)
def test_parse_plumbing_any_input(argv, environ):
    p = parse_plumbing(environ, argv)
    assert all(0 < port < 1 << 16 for port in p.ports)
