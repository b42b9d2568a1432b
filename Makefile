# Entry points for people and CI. Every target that needs the environment depends on `setup`,
# which is idempotent and takes about a second when nothing is missing.
PY := .venv/bin/python
PYTEST_ARGS ?=
# make test's parallel step: scenarios side by side. Most of their time is waiting (for a hang
# to age, a daemon to tick, an engine to start), so more workers than cores pay off, up to the
# CPU pressure each step's report gives (.test-report/summary.txt; docs/install.md).
TEST_WORKERS ?= 3

.DEFAULT_GOAL := help
.PHONY: help setup setup-tests lint check test run demo bench package clean

help:
	@echo "make setup   install what hangwatch needs (apt packages, kernel headers, tracefs, .venv)"
	@echo "make setup-tests  setup, and the real software the tests run (PyTorch, uvicorn, zmq:"
	@echo "             a venv of ~5.5 GB outside the checkout, HANGWATCH_REALSW_VENV, once per machine)"
	@echo "make lint    ruff check, ruff format --check and mypy"
	@echo "make check   lint and the pure tests, tests/test_*.py (no process started, no root): ~30 s"
	@echo "make test    setup, lint, then every test: the pure tier, the rest TEST_WORKERS side by"
	@echo "             side, the serial ones alone (PYTEST_ARGS='-k futex'); report in .test-report/"
	@echo "make run     the daemon on its built-in defaults, /metrics on :9817 (root)"
	@echo "make demo    the daemon watching four demo programs, printing their states live"
	@echo "make bench   benchmark suite: overhead per call, daemon CPU/RSS beside node_exporter, latency"
	@echo "             (root; fetches node_exporter's binary once; BENCH_ARGS=--quick)"
	@echo "make package a wheel, an sdist and a .deb of the checkout in dist/ (needs dpkg-deb)"
	@echo "make clean   remove .venv, built test fixtures, dist/ and caches"

setup:
	@bash scripts/setup.sh

setup-tests:
	@bash scripts/setup.sh --tests

lint: setup
	$(PY) -m ruff check agent tests scripts bench
	$(PY) -m ruff format --check agent tests scripts bench
	$(PY) -m mypy

# The fast lane: the pure tier, tests/test_*.py. They start no process (tests/noprocess.py makes
# one that does fail) and need no root; tests/host, tests/privileged and tests/realsw are make test's.
check: setup lint
	$(PY) -m pytest -q -p no:cacheprovider tests/test_*.py $(PYTEST_ARGS)

# lint before pytest: a style failure is cheaper to report than a test run. Then three steps
# (scripts/testsuite.py): the pure tier alone (its write guard on), the other tiers but the tests
# marked serial on TEST_WORKERS workers, the serial ones alone. Each step runs; the report of
# times, CPU pressure, the slowest tests and every failure is .test-report/summary.txt.
test: setup-tests lint
	$(PY) -m scripts.testsuite --workers $(TEST_WORKERS) -- $(PYTEST_ARGS)

# The daemon on its built-in defaults (GPU processes and known inference servers).
run: setup
	$(PY) -m agent run

# The daemon watching four small programs (deadlock, stall, loading then idle, idle), live.
demo: setup
	$(PY) -m scripts.demo

bench:
	@bash scripts/setup.sh --bench
	$(PY) -m bench $(BENCH_ARGS)

# Needs only python3 with setuptools and dpkg-deb, not `setup`: a release can be built on a
# machine without bcc. .venv's python when there is one, since it has setuptools.
package:
	$(if $(wildcard $(PY)),$(PY),python3) -m scripts.package

# The merged kernel headers in /usr/src are left alone: they are system-wide, not the checkout's.
clean:
	rm -rf .venv .build tests/fixtures/build dist .test-report .pytest_cache .mypy_cache .ruff_cache .hypothesis *.egg-info
	find . -path ./.git -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +
