# Entry points for people and CI. Every target that needs the environment depends on `setup`,
# which is idempotent and takes about a second when nothing is missing.
PY := .venv/bin/python
PYTEST_ARGS ?=


.DEFAULT_GOAL := help
.PHONY: help setup setup-tests lint check test run demo bench package clean

help:
	@echo "make setup   install what hangwatch needs (apt packages, kernel headers, tracefs, .venv)"
	@echo "make setup-tests  setup, and the real software the tests run (PyTorch, uvicorn, zmq:"
	@echo "             a venv of ~5.5 GB outside the checkout, HANGWATCH_REALSW_VENV, once per machine)"
	@echo "make lint    ruff check, ruff format --check and mypy"
	@echo "make check   lint and the unprivileged tests (no BPF, no real software): under a minute"
	@echo "make test    setup, lint, then pytest (extra options: PYTEST_ARGS='-k futex')"
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

# The fast lane: the pure core and everything tested without root or real software.
check: setup lint
	$(PY) -m pytest -q -p no:cacheprovider tests --ignore=tests/privileged --ignore=tests/realsw $(PYTEST_ARGS)

# lint before pytest: a style failure is cheaper to report than a test run.
test: setup-tests lint
	$(PY) -m pytest -q $(PYTEST_ARGS)

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
	rm -rf .venv tests/fixtures/build dist .pytest_cache .mypy_cache .ruff_cache .hypothesis *.egg-info
	find . -path ./.git -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +
