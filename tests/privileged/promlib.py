"""A throwaway Prometheus server (Debian's package) scraping a test daemon every second."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import pytest

from tests.privileged.daemonlib import free_port


def prometheus_binary() -> str:
    found = shutil.which("prometheus")
    if found is None:
        msg = "the prometheus server is not installed (make setup installs Debian's package)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(msg)
        pytest.skip(msg)
    return found


class Prometheus:
    """Scrapes 127.0.0.1:``target_port`` (one port, or several: one target each) as job
    "hangwatch" every ``scrape_s`` seconds, evaluating ``rule_files`` every second."""

    def __init__(
        self,
        tmp: Path,
        target_port: int | Sequence[int],
        rule_files: Sequence[Path] = (),
        scrape_s: int = 1,
    ) -> None:
        self.port = free_port()
        ports = [target_port] if isinstance(target_port, int) else list(target_port)
        cfg = tmp / "prometheus.yml"
        cfg.write_text(
            json.dumps(  # JSON is YAML: no template escaping to get wrong
                {
                    "global": {"scrape_interval": f"{scrape_s}s", "evaluation_interval": "1s"},
                    "rule_files": [str(p) for p in rule_files],
                    "scrape_configs": [
                        {
                            "job_name": "hangwatch",
                            "static_configs": [{"targets": [f"127.0.0.1:{p}" for p in ports]}],
                        }
                    ],
                }
            )
        )
        self.log_path = tmp / "prometheus.log"
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            [
                prometheus_binary(),
                f"--config.file={cfg}",
                f"--storage.tsdb.path={tmp / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def api(self, path: str) -> dict:
        """The API's whole answer, errors included (a bad query is HTTP 400 with a body)."""
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{self.port}/api/v1/{path}", timeout=10
            ) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            body = e.read()
            try:
                return json.loads(body)
            except ValueError:  # not the API's JSON (a busy server's plain 503): no answer yet
                return {"status": "error", "error": body.decode(errors="replace")}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def query(self, expr: str) -> dict:
        return self.api("query?" + urllib.parse.urlencode({"query": expr}))

    def results(self, expr: str) -> list[dict] | None:
        try:
            answer = self.query(expr)
        except OSError:
            return None
        return answer["data"]["result"] if answer.get("status") == "success" else None

    def firing(self, alertname: str) -> tuple[list[dict], set[tuple[str, str]]]:
        """All alerts now, and the (service, service_pid) of those named ``alertname`` that
        are firing."""
        alerts = self.alerts()
        firing = {
            (a["labels"].get("service", ""), a["labels"].get("service_pid", ""))
            for a in alerts
            if a["labels"]["alertname"] == alertname and a["state"] == "firing"
        }
        return alerts, firing

    def alerts(self) -> list[dict]:
        try:
            answer = self.api("alerts")
        except (OSError, ValueError):
            return []
        return answer["data"]["alerts"] if answer.get("status") == "success" else []

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        finally:
            self._log.close()
