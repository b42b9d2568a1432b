"""promtool accepts the shipped Prometheus rules and their unit tests pass. promtool comes with
Debian's ``prometheus`` package (``make setup`` installs it); without it these tests are
skipped locally and fail under ``CI=true``. tests/test_rules.py holds the checks that need no
process."""

from __future__ import annotations

from tests.conftest import run_promtool
from tests.test_rules import RULE_TESTS, RULES


def test_promtool_check_rules(promtool: str) -> None:
    run_promtool(promtool, "check", "rules", str(RULES))


def test_promtool_unit_tests(promtool: str) -> None:
    run_promtool(promtool, "test", "rules", str(RULE_TESTS))
