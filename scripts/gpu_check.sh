#!/usr/bin/env bash
# The kernels' one prepared GPU check (issue 5), for a single call on a lent H200:
#
#   1. versions and device;
#   2. the tests marked `gpu` (tests/test_kernels_gpu.py, tests/test_kernel_model.py,
#      tests/test_ep_dispatch_gpu.py);
#   3. engine: scripts/gpu_engine_check.py, the whole offline engine on the GPU against
#      greedy tokens recorded on the CPU (GPU_CHECK_ENGINE_REF, default
#      .gpu_ref/engine_ref.json; made here with its --record), and tok/s per batch
#      (GPU_CHECK_ENGINE_ARGS: more arguments; a cold start compiles every step shape,
#      about 20 per model, which took over 150 s on an H200 for the demo model);
#   4. steps: scripts/bench_step_agreement.py at 2/4/8 processes (the GPU machine's idle
#      CPU cores: issue 16's step-agreement goal is for an idle machine);
#   5. scripts/bench_kernels.py: ceilings, grouped matmul, decode attention;
#   6. scripts/bench_kernels.py --sweep: the tile-table candidates, as time allows.
#
# Every stage runs under its own time cap and a failing stage does not stop the next.
# Logs and JSON go to $OUT (the device tool's output folder; /tmp/gpu_check_out if unset):
# versions.txt pytest.log engine.log engine.json steps.log bench.log bench_kernels.json
# sweep.log sweep.json summary.txt (the device tool returns 8 files at most: the default
# stages leave out the sweep). About 9 minutes with the default caps; at worst the caps,
# 10 s each to kill, and ~15 s of setup: 9.5 minutes.
#
# Usage: scripts/gpu_check.sh [--dry-run] [WHEEL_DIR]
#   WHEEL_DIR   wheels to install first (pip --no-index --no-deps into /tmp/site, which
#               the benchmark puts first on sys.path): tokamax and the dependencies the
#               image lacks (scripts/README.md lists them), and pyzmq, which the engine
#               and steps stages need (installed apart, into /tmp/site_engine).
#   --dry-run   the CPU rehearsal: JAX on the CPU, the gpu tests (they skip), the
#               benchmark's --dry-run (GPU interpreter, tiny shapes); no sweep.
# Caps (seconds): GPU_CHECK_TEST_S (150), GPU_CHECK_ENGINE_S (180),
# GPU_CHECK_ENGINE_HIGHEST_S (0: not run; the engine stage again at the highest matmul
# precision), GPU_CHECK_STEPS_S (60),
# GPU_CHECK_BENCH_S (110), GPU_CHECK_SWEEP_S (80);
# GPU_CHECK_SWEEP_ARGS (default "--tokens 16,4096": the two regimes first);
# GPU_CHECK_STAGES (default "tests,engine,steps,bench": which stages to run; add sweep).
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
TEST_S=${GPU_CHECK_TEST_S:-150}
ENGINE_S=${GPU_CHECK_ENGINE_S:-180}
ENGINE_HIGHEST_S=${GPU_CHECK_ENGINE_HIGHEST_S:-0}
STEPS_S=${GPU_CHECK_STEPS_S:-60}
ENGINE_REF=${GPU_CHECK_ENGINE_REF:-.gpu_ref/engine_ref.json}
BENCH_S=${GPU_CHECK_BENCH_S:-110}
SWEEP_S=${GPU_CHECK_SWEEP_S:-80}
SWEEP_ARGS=${GPU_CHECK_SWEEP_ARGS-"--tokens 16,4096"}
STAGES=,${GPU_CHECK_STAGES:-tests,engine,steps,bench},
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
        # The engine imports pyzmq (jaxserve.ipc), which the image lacks; alone in its own
        # folder so that the tests and the engine see the image's other packages.
        if ls "$WHEELS"/pyzmq-*.whl >/dev/null 2>&1; then
            "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
                --upgrade --target /tmp/site_engine "$WHEELS"/pyzmq-*.whl ||
                note "wheels: pyzmq did not install; the engine stages will fail"
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
# tests/conftest.py imports the engine, which imports pyzmq (see the wheels above).
want tests && stage "pytest -m gpu" "$OUT/pytest.log" "$TEST_S" \
    env PYTHONPATH="/tmp/site_engine:$PYTHONPATH" "$PY" -m pytest -m gpu -q -rA "${TIMEOUT_ARGS[@]}" -p no:cacheprovider \
    --continue-on-collection-errors \
    tests/test_kernels_gpu.py tests/test_kernel_model.py tests/test_ep_dispatch_gpu.py

# --- 2. the engine against CPU-recorded greedy tokens, and tok/s -------------------------
# shellcheck disable=SC2206 # GPU_CHECK_ENGINE_ARGS is a list of arguments
ENGINE_ARGS=(${GPU_CHECK_ENGINE_ARGS:---models demo})
[ "$DRY" = 1 ] && ENGINE_ARGS+=(--batches 1,8 --models demo)
if want engine; then
    if [ -f "$ENGINE_REF" ]; then
        stage "engine" "$OUT/engine.log" "$ENGINE_S" env PYTHONPATH="/tmp/site_engine:$PYTHONPATH" \
            "$PY" scripts/gpu_engine_check.py --reference "$ENGINE_REF" \
            --out "$OUT/engine.json" "${ENGINE_ARGS[@]}"
        # The default precision lets a GPU run float32 dots in TF32: where greedy tokens
        # differ from the CPU's, this run says whether TF32 is why.
        [ "$DRY" = 1 ] || [ "$ENGINE_HIGHEST_S" = 0 ] || stage "engine (highest precision)" "$OUT/engine.log" "$ENGINE_HIGHEST_S" \
            env PYTHONPATH="/tmp/site_engine:$PYTHONPATH" "$PY" scripts/gpu_engine_check.py \
            --reference "$ENGINE_REF" --precision highest --out /tmp/engine_highest.json \
            "${ENGINE_ARGS[@]}"
    else
        note "engine: no reference $ENGINE_REF (record it on the CPU: gpu_engine_check.py --record)"
    fi
fi

# --- 3. step agreement between processes, on the machine's idle cores --------------------
STEPS_ARGS=(--steps 1000)
[ "$DRY" = 1 ] && STEPS_ARGS=(--steps 50 --processes 2)
want steps && stage "step agreement" "$OUT/steps.log" "$STEPS_S" \
    env PYTHONPATH="/tmp/site_engine:$PYTHONPATH" "$PY" scripts/bench_step_agreement.py \
    "${STEPS_ARGS[@]}" --json /tmp/step_agreement.json

# --- 4. benchmark ----------------------------------------------------------------------
BENCH_ARGS=(--extra-path /tmp/site)
[ "$DRY" = 1 ] && BENCH_ARGS+=(--dry-run)
# The benchmark stops starting measurements 40 s before the cap and writes its JSON
# after every row, so a run cut short keeps what it measured.
want bench && stage "bench_kernels" "$OUT/bench.log" "$BENCH_S" \
    "$PY" scripts/bench_kernels.py "${BENCH_ARGS[@]}" --budget-s $((BENCH_S - 40)) \
    --out "$OUT/bench_kernels.json"

# --- 5. tile-table sweep ---------------------------------------------------------------
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
