#!/usr/bin/env bash
# Set up the test environment, lint the tree and run the whole CPU test suite.
#   bash scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
# The bench extra too: tests/test_bench_cli.py runs `jaxserve bench` (aiohttp, matplotlib).
bash scripts/setup_venv.sh test bench
venv="${JAXSERVE_VENV:-.venv}"
# A pytest process keeps hundreds of compiled XLA executables, ~15 memory maps each: a
# full run in one process peaked at 65,250 maps, at Linux's default limit of 65530 per
# process, where XLA's CPU runtime fails an mmap ("LLVM compilation error: Cannot allocate
# memory") and segfaults: two of three full runs died so, in jax's compilation-cache read.
# `scripts/map_count.py` measures both. Raise the limit where we may (root: CI), else say how.
min_maps=262144
if [ "$(cat /proc/sys/vm/max_map_count 2>/dev/null || echo "$min_maps")" -lt "$min_maps" ]; then
  { echo "$min_maps" > /proc/sys/vm/max_map_count; } 2>/dev/null ||
    echo "warning: vm.max_map_count is $(cat /proc/sys/vm/max_map_count), under the" \
      "$min_maps a full run needs: 'sudo sysctl -w vm.max_map_count=$min_maps'" >&2
fi
# Lint first: the whole tree, as ruff is configured in pyproject.toml.
"$venv/bin/ruff" check .
# Tests that need several devices get them from emulated CPU devices (see tests/conftest.py).
# `gpu`-marked tests need an NVIDIA GPU; run them there with `pytest -m gpu`.
# The slowest tests are listed at the end (the suite's budget is 15 min on 2 cores); for a
# table per file, add --junitxml=FILE and run scripts/test_file_times.py FILE.
# Two pytest-xdist workers (JAXSERVE_TEST_WORKERS; 0: one process, no workers): much of the
# suite waits on the servers, compilations and processes it starts, so on 2 cores two
# workers took the suite from ~1000 s to ~690 s. A test file (a folder under tests/)
# runs whole in one worker (tests/conftest.py's scheduler), its module fixtures once.
# The JAX compilation cache is one temporary folder per run, shared by the workers
# (tests/conftest.py); set JAXSERVE_TEST_CACHE_ROOT to a folder to keep it between runs.
workers="${JAXSERVE_TEST_WORKERS:-2}"
exec "$venv/bin/python" -m pytest -q -m "not gpu" --durations=25 \
  -n "$workers" --dist loadfile "$@"
