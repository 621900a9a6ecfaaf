#!/usr/bin/env bash
# Set up the test environment, lint the tree and run the whole CPU test suite.
#   bash scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
# The bench extra too: tests/test_bench_cli.py runs `jaxserve bench` (aiohttp, matplotlib).
bash scripts/setup_venv.sh test bench
venv="${JAXSERVE_VENV:-.venv}"
# Lint first: the whole tree, as ruff is configured in pyproject.toml.
"$venv/bin/ruff" check .
# Tests that need several devices get them from emulated CPU devices (see tests/conftest.py).
# `gpu`-marked tests need an NVIDIA GPU; run them there with `pytest -m gpu`.
# The slowest tests are listed at the end (the suite's budget is 15 min on 2 cores); for a
# table per file, add --junitxml=FILE and run scripts/test_file_times.py FILE.
# The JAX compilation cache is one temporary folder per run (tests/conftest.py); set
# JAXSERVE_TEST_CACHE_ROOT to a folder to keep it between runs.
exec "$venv/bin/python" -m pytest -q -m "not gpu" --durations=25 "$@"
