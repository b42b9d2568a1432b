"""docs/security.md, checked: the minimal capability set, no secrets in /metrics, and TLS with
basic auth on /metrics.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import bcrypt
import pytest

from scripts.fixturelib import REPO_ROOT, Fixture, build
from tests.host.test_webconfig import make_cert
from tests.limits import HANG_S
from tests.privileged.daemonlib import (
    INTERVAL,
    Daemon,
    free_port,
    own_status_socket,
    value,
    wait_until,
)

CAPS = ["bpf", "perfmon", "sys_ptrace", "dac_read_search"]  # docs/security.md
AGENT_UID = 4242  # no passwd entry needed: a user that is neither root nor the target's
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all"]


def with_caps(caps: list[str], uid: int = AGENT_UID) -> list[str]:
    """setpriv as a non-root user holding exactly ``caps`` (ambient, so they survive exec)."""
    want = ",".join(["-all", *(f"+{c}" for c in caps)])
    return [
        "setpriv",
        f"--reuid={uid}",
        f"--regid={uid}",
        "--clear-groups",
        f"--bounding-set={want}",
        f"--inh-caps={want}",
        f"--ambient-caps={want}",
    ]


def diagnose(pid: int, prefix: list[str]) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "agent", "diagnose", "--pid", str(pid), "--json"]
    return subprocess.run(
        [*prefix, *argv, "--threshold", "1", "--duration", "2"],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},  # the checkout is not its to write
        capture_output=True,
        text=True,
        timeout=HANG_S,
        check=False,
    )


def test_the_documented_capabilities_are_enough() -> None:
    """A non-root agent with exactly the four capabilities finds the lock cycle of a target
    that runs as a third user (nobody): BPF loads, tracepoints attach, /proc/PID/mem reads."""
    with Fixture([*NOBODY, build("deadlock_mutex")]) as fx:
        r = diagnose(fx.pid, with_caps(CAPS))
        tids = set(fx.info.get_ints("tids"))
    msg = f"exit {r.returncode}\nstderr:\n{r.stderr}\nstdout:\n{r.stdout}"
    assert r.returncode == 0, msg
    (svc,) = json.loads(r.stdout)["services"]
    assert svc["state"] == "deadlocked" and [set(c) for c in svc["cycles"]] == [tids], msg


@pytest.mark.parametrize("dropped", CAPS)
def test_each_capability_is_needed_and_named(dropped: str) -> None:
    """Without any one of them: exit 3 naming it, before anything is loaded. (Without
    CAP_SYS_PTRACE or CAP_DAC_READ_SEARCH bcc would load fine and every lock owner would be
    silently missing: the check is what makes that loud.)"""
    with Fixture([*NOBODY, build("condvar_pool"), "2"]) as fx:
        r = diagnose(fx.pid, with_caps([c for c in CAPS if c != dropped]))
    msg = f"exit {r.returncode}\nstderr:\n{r.stderr}"
    assert r.returncode == 3, msg
    assert f"missing capability CAP_{dropped.upper()}" in r.stderr, msg
    assert "Traceback" not in r.stderr, msg


# --- no secrets in /metrics ---------------------------------------------------------------------

SECRET = "sk-live-0123456789abcdefSECRET"


def test_cmdline_and_environment_secrets_stay_out_of_metrics(tmp_path: Path) -> None:
    port = free_port()
    cfg = tmp_path / "hangwatch.yaml"
    cfg.write_text(
        f'listen: "127.0.0.1:{port}"\ninterval_seconds: {INTERVAL}\n'
        "targets:\n  - name: secretive\n    cmdline: 'hangwatch-secret-test'\n"
    )
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "RANK": "3",  # allow-listed: becomes a label
        "OPENAI_API_KEY": SECRET,
        "HF_TOKEN": SECRET,
    }
    script = "import time; print('READY', flush=True); time.sleep(600)"
    argv = [sys.executable, "-c", script, "hangwatch-secret-test", f"--api-key={SECRET}"]
    d = Daemon(cfg, port)
    try:
        with Fixture(argv, env=env) as fx:
            s = wait_until(
                d,
                lambda s: value(s, "hangwatch_process_threads", pid=str(fx.pid)) is not None,
                "the secretive process to be watched",
            )
            labels = next(dict(ls) for (n, ls) in s if dict(ls).get("pid") == str(fx.pid))
            assert labels.get("rank") == "3", labels  # the environment was read
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                text = r.read().decode()
    finally:
        rc = d.stop()
    assert rc == 0, d.output()
    assert "SECRET" not in text and "sk-live" not in text, "a secret reached /metrics"
    assert "SECRET" not in d.output(), "a secret reached the log"


# --- TLS and basic auth ---------------------------------------------------------------------------


def test_metrics_over_tls_with_basic_auth(tmp_path: Path) -> None:
    cert, _ = make_cert(tmp_path)
    password = b"correct horse battery staple"
    hashed = bcrypt.hashpw(password, bcrypt.gensalt(rounds=6)).decode()
    web = tmp_path / "web.yml"
    web.write_text(
        "tls_server_config:\n  cert_file: tls.crt\n  key_file: tls.key\n"
        f"basic_auth_users:\n  prometheus: '{hashed}'\n"
    )
    port = free_port()
    cfg = tmp_path / "hangwatch.yaml"
    cfg.write_text(
        f'listen: "127.0.0.1:{port}"\ninterval_seconds: {INTERVAL}\n'
        "targets:\n  - name: none\n    pids: [1]\n"
    )
    own_status_socket(cfg)
    log = (tmp_path / "daemon.log").open("w")
    cmd = [sys.executable, "-m", "agent", "run", "--config", str(cfg), "--web-config", str(web)]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
    ctx = ssl.create_default_context(cafile=str(cert))
    url = f"https://127.0.0.1:{port}/metrics"

    def get(auth: bytes | None) -> tuple[int, str]:
        headers = {"Authorization": "Basic " + base64.b64encode(auth).decode()} if auth else {}
        req = urllib.request.Request(url, headers=headers)
        try:
            with urllib.request.urlopen(req, context=ctx, timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, ""

    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (tmp_path / "daemon.log").read_text()
            try:  # /metrics answers before the probes attach; a first tick means attached
                status, body = get(b"prometheus:" + password)
                if status == 200 and 'collector="proc"} 1.0' in body:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, (tmp_path / "daemon.log").read_text()
            time.sleep(0.5)
        assert get(None)[0] == 401
        assert get(b"prometheus:wrong")[0] == 401
        assert get(b"grafana:" + password)[0] == 401
        with pytest.raises(OSError):  # plain HTTP gets no answer from a TLS port
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=30)
        log.close()
    out = (tmp_path / "daemon.log").read_text()
    assert rc == 0, out
    assert "(https, basic auth for 1 users" in out, out
    assert password.decode() not in out and hashed not in out
