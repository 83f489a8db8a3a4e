#!/usr/bin/env bash
# Everything a lent GPU is for, in calls of under 10 minutes: install, check every op
# on the GPU, tune block sizes on the main shapes, then time the benchmark suite.
# Run from the repository root, e.g. through the device tool with carry [".whl"]
# (wheels the image lacks, jax-triton above all; README "Running on a GPU"):
#
#   bash benchmarks/gpu_session.sh            # the TMA launch check, pytest -m gpu, the tuner, python -m benchmarks
#   QUICK=1 bash benchmarks/gpu_session.sh    # the same with one tiny case per op / problem per family
#   FILTER=dot_product_attention bash benchmarks/gpu_session.sh   # only the matching benchmark cases
#   STEPS=bench,lm RESUME=benchmarks/results/<run>/bench/results.json bash benchmarks/gpu_session.sh
#                                             # a later call: the benchmark cases the last one did not reach
#
# The suite is longer than one call: python -m benchmarks runs the headline cases first,
# stops starting cases when its budget is spent and rewrites bench/results.json after
# every case; commit that file and pass it as RESUME to the next call, which runs only
# the cases it lacks (benchmarks/checkpoint.py).
#
# Environment: PYTHON (default python3), OUT (default benchmarks/results/latest),
# COMMIT (recorded in env.txt; the device's copy of the tree has no .git),
# INSTALL=0 to use what is installed as is, STEPS (default tma,tests,tune,bench; lm adds
# benchmarks.lm, the byte-level LM trained with stock Flax layers and with ours),
# RESUME (a results.json to continue), TUNE=0 (the same as leaving tune out of STEPS).
# Time budgets in seconds, so that the call ends within 10 minutes: SESSION_BUDGET_S
# (default 540) for the whole script; TESTS_BUDGET_S (120) cuts pytest (TEST_WORKERS, 4,
# processes); the tuner starts
# no new problem after TUNE_BUDGET_S (90) and is cut at TUNE_LIMIT_S (140), trying at
# most TUNE_CANDIDATES (8) configs per problem; LM_LIMIT_S (150) cuts benchmarks.lm; the
# benchmarks get what is left, starting no case in its last BENCH_MARGIN_S (60).
# The benchmarks run with the tuner's winners of this call (PALLAS_KERNELS_TUNING_CACHE).
# Writes under $OUT: env.txt, tma_launch.txt, pytest_gpu.txt, tune.txt, tuned_configs.json (the winners,
# a cache file: python -m benchmarks.tune --merge $OUT/tuned_configs.json installs them
# into ops/tuning/configs.json), tune_report.json (every candidate's verdict and time),
# benchmarks.txt and the benchmark folder bench/ (results.json, results.md, results-<family>.png),
# lm.txt and lm.json.
# Copy $OUT to benchmarks/results/<date>-gpu-<device>/ and commit it with the merged cache.
# The device image has no registry: nothing is downloaded, so the project is
# installed without its dependencies, on the image's own JAX, Flax and Triton.
set -uo pipefail
# Every step's output reaches its log as it is printed: a step cut by its time limit
# keeps what it said.
export PYTHONUNBUFFERED=1
py="${PYTHON:-python3}"
out="${OUT:-benchmarks/results/latest}"
mkdir -p "$out"
start=$SECONDS
steps=",${STEPS:-tma,tests,tune,bench},"
if [[ "${TUNE:-1}" == "0" ]]; then steps=${steps//,tune,/,}; fi
has_step() { [[ "$steps" == *",$1,"* ]]; }

if [[ "${INSTALL:-1}" != "0" ]]; then
  if compgen -G ".whl/*.whl" > /dev/null; then
    "$py" -m pip install --quiet --no-deps --no-index .whl/*.whl
  fi
  "$py" -m pip install --quiet --no-deps --no-build-isolation -e .
fi

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: ${COMMIT:-unknown}"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv 2>&1 || true
  "$py" -c "import jax, triton; print('jax', jax.__version__, 'triton', triton.__version__, jax.devices())"
  "$py" -c "import jax_triton; print('jax_triton', jax_triton.__version__)" 2>&1 | tail -1
} > "$out/env.txt" 2>&1
cat "$out/env.txt"

# Tensor descriptors (TMA) through jax_triton's launch: tma kernels against pointer ones
# (tests/test_tma_launch.py). Until this passes on a GPU, tma stays off by default; once
# it has, PALLAS_CORE_TRITON_TMA=1 (TMA=1 here: the whole session with it) may become the
# sm_90 default (docs/pallas_core.md, "The shape of the GPU program").
if [[ -n "${TMA:-}" ]]; then export PALLAS_CORE_TRITON_TMA=1; fi
if has_step tma; then
  timeout -k 10 150 "$py" -m pytest -m gpu -v -rfE -p no:cacheprovider -o addopts= tests/test_tma_launch.py 2>&1 \
    | tee "$out/tma_launch.txt" | tail -8
  echo "tma launch on the GPU: exit ${PIPESTATUS[0]} after $(( SECONDS - start )) s"
fi

# Correctness on the hardware first: a failure here makes the timings meaningless.
# One process (-o addopts= drops the CI's two xdist workers, which would share the GPU),
# over the files that hold GPU tests only: collecting the whole suite costs minutes.
tests_status=0
if has_step tests; then
  gpu_files=$(grep -l "mark.gpu" tests/*.py benchmarks/*.py 2>/dev/null | grep -v test_tma_launch)
  # -v: one line per test as it ends, so a run cut by its limit still says what passed.
  # Compiling dominates these tests and the machine has 16 cores: TEST_WORKERS (4) pytest-xdist
  # processes share the GPU, each allocating as it goes (JAX's default preallocates 75% of the
  # GPU's memory per process, which would leave the second one nothing).
  workers=()
  if [[ "${TEST_WORKERS:-4}" -gt 1 ]] && "$py" -c "import xdist" 2>/dev/null; then
    workers=(-n "${TEST_WORKERS:-4}")
  fi
  # shellcheck disable=SC2086  # one argument per file
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 10 "${TESTS_BUDGET_S:-120}" \
    "$py" -m pytest -m gpu -v -rfE -p no:cacheprovider -o addopts= "${workers[@]}" $gpu_files 2>&1 \
    | tee "$out/pytest_gpu.txt" | tail -25
  tests_status=${PIPESTATUS[0]}
  echo "pytest -m gpu: exit ${tests_status} after $(( SECONDS - start )) s"
fi

tune_status=0
if has_step tune; then
  tune_args=(--out "$out/tuned_configs.json" --report "$out/tune_report.json"
             --budget-s "${TUNE_BUDGET_S:-90}" --max-candidates "${TUNE_CANDIDATES:-8}")
  if [[ -n "${QUICK:-}" ]]; then tune_args+=(--quick); fi
  timeout -k 15 "${TUNE_LIMIT_S:-140}" "$py" -m benchmarks.tune "${tune_args[@]}" 2>&1 \
    | tee "$out/tune.txt" | tail -30
  tune_status=${PIPESTATUS[0]}
  echo "tuner: exit ${tune_status} after $(( SECONDS - start )) s"
  if [[ -s "$out/tuned_configs.json" ]]; then
    export PALLAS_KERNELS_TUNING_CACHE="$out/tuned_configs.json"
  fi
fi

lm_status=0
if has_step lm; then
  timeout -k 10 "${LM_LIMIT_S:-150}" "$py" -m benchmarks.lm --json "$out/lm.json" 2>&1 \
    | tee "$out/lm.txt" | tail -12
  lm_status=${PIPESTATUS[0]}
  echo "benchmarks.lm: exit ${lm_status} after $(( SECONDS - start )) s"
fi

bench_status=0
if has_step bench; then
  bench_args=(--out "$out/bench")
  if [[ -n "${QUICK:-}" ]]; then bench_args+=(--quick); fi
  if [[ -n "${FILTER:-}" ]]; then bench_args+=(--filter "$FILTER"); fi
  if [[ -n "${RESUME:-}" ]]; then bench_args+=(--resume "$RESUME"); fi
  left=$(( ${SESSION_BUDGET_S:-540} - (SECONDS - start) ))
  left=$(( left > 60 ? left : 60 ))
  cases_s=$(( left - ${BENCH_MARGIN_S:-60} ))
  # --budget-s stops starting cases; the margin is for the last case and the report.
  # timeout is the backstop: its SIGTERM still gets the report written.
  timeout -k 10 "$left" "$py" -m benchmarks "${bench_args[@]}" --budget-s "$(( cases_s > 10 ? cases_s : 10 ))" \
    2>&1 | tee "$out/benchmarks.txt" | tail -60
  bench_status=${PIPESTATUS[0]}
fi

echo "pytest -m gpu exit ${tests_status}; tuner exit ${tune_status}; benchmarks.lm exit ${lm_status};" \
     "benchmarks exit ${bench_status} (1 also when cases were left for --resume); $(( SECONDS - start )) s in all"
exit $(( tests_status != 0 || tune_status != 0 || lm_status != 0 || bench_status != 0 ))
