#!/usr/bin/env bash
# The kernels' one prepared GPU check (issue 5), for a single call on a lent H200:
#
#   1. versions and device;
#   2. the tests marked `gpu` (tests/test_kernels.py, tests/test_kernel_model.py);
#   3. scripts/bench_kernels.py: ceilings, grouped matmul, decode attention;
#   4. scripts/bench_kernels.py --sweep: the tile-table candidates, as time allows.
#
# Every stage runs under its own time cap and a failing stage does not stop the next.
# Logs and JSON go to $OUT (the device tool's output folder; /tmp/gpu_check_out if unset),
# 7 files: versions.txt pytest.log bench.log bench_kernels.json sweep.log sweep.json
# summary.txt. About 9 minutes with the default caps; at worst the caps, 10 s each to
# kill, and ~15 s of setup: 9.5 minutes.
#
# Usage: scripts/gpu_check.sh [--dry-run] [WHEEL_DIR]
#   WHEEL_DIR   wheels to install first (pip --no-index --no-deps into /tmp/site, which
#               the benchmark puts first on sys.path): tokamax and the dependencies the
#               image lacks (scripts/README.md lists them).
#   --dry-run   the CPU rehearsal: JAX on the CPU, the gpu tests (they skip), the
#               benchmark's --dry-run (GPU interpreter, tiny shapes); no sweep.
# Caps (seconds): GPU_CHECK_TEST_S (170), GPU_CHECK_BENCH_S (260), GPU_CHECK_SWEEP_S (80);
# GPU_CHECK_SWEEP_ARGS (default "--tokens 16,4096": the two regimes first);
# GPU_CHECK_STAGES (default "tests,bench,sweep": which stages to run).
# See scripts/README.md, "Kernels on a GPU".

set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-${TMPDIR:-/tmp}/gpu_check_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
DRY=0
WHEELS=""
for arg in "$@"; do
    case $arg in
        --dry-run) DRY=1 ;;
        -h | --help) sed -n '2,25p' "$0"; exit 0 ;;
        *) WHEELS=$arg ;;
    esac
done
TEST_S=${GPU_CHECK_TEST_S:-170}
BENCH_S=${GPU_CHECK_BENCH_S:-260}
SWEEP_S=${GPU_CHECK_SWEEP_S:-80}
SWEEP_ARGS=${GPU_CHECK_SWEEP_ARGS-"--tokens 16,4096"}
STAGES=,${GPU_CHECK_STAGES:-tests,bench,sweep},
want() { case $STAGES in *",$1,"*) return 0 ;; *) note "$1: not asked for"; return 1 ;; esac; }
export PYTHONUNBUFFERED=1
# tests/conftest.py defaults JAX to the CPU: name the platform explicitly.
if [ "$DRY" = 1 ]; then export JAX_PLATFORMS=cpu; else export JAX_PLATFORMS=cuda; fi
SUMMARY=$OUT/summary.txt
: >"$SUMMARY"
START=$(date +%s)

note() { echo "$*" | tee -a "$SUMMARY"; }

# stage NAME LOG CAP_S COMMAND...: run under `timeout`, log to LOG, record rc and time.
stage() {
    local name=$1 log=$2 cap=$3
    shift 3
    local t0 rc
    t0=$(date +%s)
    echo "=== $name (cap ${cap}s): $*" >>"$log"
    timeout -k 10 "$cap" "$@" >>"$log" 2>&1
    rc=$?
    tail -n 40 "$log"
    note "$name: rc=$rc$([ "$rc" = 124 ] && echo ' (time cap)') in $(($(date +%s) - t0))s"
    return 0
}

# --- setup: carried wheels, jaxserve importable, versions ------------------------------
if [ -n "$WHEELS" ]; then
    if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
        # Only the benchmark sees them (--extra-path): the tests run on the image as is.
        if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site "$WHEELS"/*.whl; then
            note "wheels: installed into /tmp/site: $(cd "$WHEELS" && echo *.whl)"
        else
            note "wheels: pip install from $WHEELS failed; going on without them"
        fi
    else
        note "wheels: no *.whl in $WHEELS"
    fi
fi
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}

# jaxserve maps models/, sharding/, eplb/ and frontend/ to jaxserve.<part> at install
# time (pyproject.toml). Without an install (the GPU image), link them into place.
LINKS=()
if ! "$PY" -c "import jaxserve.models.base" >/dev/null 2>&1; then
    for part in models sharding eplb frontend; do
        if [ -d "$part" ] && [ ! -e "jaxserve/$part" ]; then
            ln -s "../$part" "jaxserve/$part" && LINKS+=("jaxserve/$part")
        fi
    done
fi
cleanup() { for link in "${LINKS[@]}"; do rm -f "$link"; done; }
trap cleanup EXIT
"$PY" -c "import jaxserve.models.base" || note "setup: jaxserve.models does not import"

{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1
    "$PY" --version
    "$PY" -m pip list 2>/dev/null | grep -iE \
        '^(jax|jaxlib|jax-cuda|flax|numpy|transformers|torch |pytest|tokamax|ml.dtypes)'
    "$PY" -c "import jax; print('jax', jax.__version__, jax.devices())"
} >"$OUT/versions.txt" 2>&1
cat "$OUT/versions.txt"

# --- 1. tests marked gpu ---------------------------------------------------------------
TIMEOUT_ARGS=()
if "$PY" -c "import pytest_timeout" >/dev/null 2>&1; then
    # thread method: a kernel that hangs the device cannot be interrupted by a signal.
    TIMEOUT_ARGS=(--timeout=120 --timeout-method=thread)
fi
want tests && stage "pytest -m gpu" "$OUT/pytest.log" "$TEST_S" \
    "$PY" -m pytest -m gpu -q -rA "${TIMEOUT_ARGS[@]}" -p no:cacheprovider \
    --continue-on-collection-errors \
    tests/test_kernels.py tests/test_kernel_model.py tests/test_ep_dispatch_gpu.py

# --- 2. benchmark ----------------------------------------------------------------------
BENCH_ARGS=(--extra-path /tmp/site)
[ "$DRY" = 1 ] && BENCH_ARGS+=(--dry-run)
# The benchmark stops starting measurements 40 s before the cap and writes its JSON
# after every row, so a run cut short keeps what it measured.
want bench && stage "bench_kernels" "$OUT/bench.log" "$BENCH_S" \
    "$PY" scripts/bench_kernels.py "${BENCH_ARGS[@]}" --budget-s $((BENCH_S - 40)) \
    --out "$OUT/bench_kernels.json"

# --- 3. tile-table sweep ---------------------------------------------------------------
if [ "$DRY" = 1 ]; then
    note "sweep: skipped in --dry-run"
elif want sweep; then
    # shellcheck disable=SC2086 # SWEEP_ARGS is a list of arguments
    stage "bench_kernels --sweep" "$OUT/sweep.log" "$SWEEP_S" \
        "$PY" scripts/bench_kernels.py --sweep "${BENCH_ARGS[@]}" --budget-s $((SWEEP_S - 25)) \
        $SWEEP_ARGS --out "$OUT/sweep.json"
fi

note "total: $(($(date +%s) - START))s"
cat "$SUMMARY"
