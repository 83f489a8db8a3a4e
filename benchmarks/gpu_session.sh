#!/usr/bin/env bash
# One call to a lent GPU (at most 9 minutes; a lease is 15 minutes in all, starts
# included): decisions first. Run from the repository root through the device tool with
# carry [".whl"], after `python -m benchmarks.provenance --prepare` here (it writes
# .whl/tree.json: the tree's commit, since the device's copy has no .git) and with the
# wheels the image lacks in .whl/ (jax-triton; README "Running on a GPU"):
#
#   bash benchmarks/gpu_session.sh                  # every step below, in this order
#   QUICK=1 bash benchmarks/gpu_session.sh          # the same on the quick cases (a CPU host: INSTALL=0 QUICK=1)
#   STEPS=bench RESUME=benchmarks/results/<run>/bench/results.json bash benchmarks/gpu_session.sh
#                                                   # a later call: the cases the last one did not reach
#
# Steps (STEPS, comma-separated; default all but lm), each with its budget in seconds:
#   compat    python -m benchmarks.compat: every kernel's Triton source generated and JAX's
#             Pallas Triton path lowered for cuda under this machine's JAX, every unsupported
#             primitive listed with its kernel; the versions (COMPAT_S, 60)
#   smoke     python -m benchmarks.smoke: one small case per op family, every implementation,
#             against float64; each verdict written as it is known (SMOKE_S, 100)
#   headline  python -m benchmarks --headline: the headline cases, every column (xla, cudnn,
#             jax_pallas, ours) (HEADLINE_S, 170)
#   queue     python -m benchmarks.lease_queue: the A/B experiments of benchmarks/lease_queue.json,
#             arms side by side, judged against their predictions (QUEUE_S, 100)
#   tune      python -m benchmarks.tune on the headline ops' shapes (TUNE_OPS; TUNE_S, 50);
#             the later steps run with its winners
#   tma       tests/test_tma_launch.py (TMA_S, 40)
#   tests     pytest -m gpu (TESTS_S, 90; TEST_WORKERS processes, 4)
#   bench     python -m benchmarks --resume: the rest of the suite, with what is left
#   lm        python -m benchmarks.lm (LM_S, 150)
# SESSION_BUDGET_S (540) bounds the whole call: a step gets its budget or what is left,
# less RESERVE_S (20) for the later ones' reports, and no step starts with under 15 s;
# a step that ends early leaves its time to the next. With the defaults the decisions
# (compat to tune) take at most 480 s, and the rest gets what they leave.
# Every step prints its seconds; steps.txt lists them all.
# Nothing is lost when a step is cut: the Python steps write each verdict or case as it
# is known and end with their report on SIGTERM; pytest is stopped with SIGINT (its
# summary still prints) and writes each failure as it happens (benchmarks.live_failures).
#
# Environment: PYTHON (python3), SESSION_DIR (benchmarks/results/latest, git-ignored),
# OUT (the device tool's folder of files that come back: at most 8 files, so the script
# puts there only session.tar.gz, the whole SESSION_DIR, refreshed every BUNDLE_EVERY_S
# (30) seconds and after every step, and steps.txt), INSTALL=0 to use what is installed,
# QUICK, FILTER (benchmark cases), RESUME (a results.json to continue), COMMIT (overrides
# the recorded commit), TMA=1 (the whole session with tensor descriptors).
# Writes under SESSION_DIR: env.txt, steps.txt, compat.json/.txt, smoke.jsonl/.txt, bench/
# (the headline and the rest: results.json, results.md, figures), queue.jsonl/.md,
# tune.txt, tuned_configs.json, tune_report.json, tma_launch.txt, pytest_gpu.txt,
# pytest_failures.txt, benchmarks.txt, lm.txt, lm.json, and each step's log.
# The device image has no registry: nothing is downloaded; the project is installed
# without its dependencies, on the image's own JAX, Flax and Triton.
set -uo pipefail
export PYTHONUNBUFFERED=1  # every step's output reaches its log as it is printed
py="${PYTHON:-python3}"
out="${SESSION_DIR:-benchmarks/results/latest}"
mkdir -p "$out"
start=$SECONDS

# $OUT/session.tar.gz: everything so far, written whole (a cut call keeps the last one).
bundle() {
  [[ -n "${OUT:-}" ]] || return 0
  mkdir -p "$OUT"
  local tmp="$OUT/session.tar.gz.$BASHPID.tmp"  # the loop below bundles too
  tar -czf "$tmp" -C "$out" . 2>/dev/null
  if (( $? <= 1 )); then mv -f "$tmp" "$OUT/session.tar.gz"; else rm -f "$tmp"; fi
  cp -f "$out/steps.txt" "$OUT/steps.txt" 2>/dev/null || true
}
if [[ -n "${OUT:-}" ]]; then
  # Its output goes nowhere: a sleep left behind must not hold the caller's pipe open.
  ( while sleep "${BUNDLE_EVERY_S:-30}"; do bundle; done ) > /dev/null 2>&1 &
  bundler=$!
  trap 'kill "$bundler" 2>/dev/null; bundle' EXIT
fi
steps=",${STEPS:-compat,smoke,headline,queue,tune,tma,tests,bench},"
has_step() { [[ "$steps" == *",$1,"* ]]; }
quick=()
if [[ -n "${QUICK:-}" ]]; then quick=(--quick); fi
: > "$out/steps.txt"

# Seconds a step may run: its budget, or what is left of the call less the reserve.
budget() {
  local left=$(( ${SESSION_BUDGET_S:-540} - (SECONDS - start) - ${RESERVE_S:-20} ))
  echo $(( $1 < left ? $1 : left ))
}

# run_step NAME BUDGET SIGNAL LOG COMMAND...: the command under timeout (SIGNAL first,
# SIGKILL 10 s later), its output to LOG and the terminal's last lines, its seconds printed.
statuses=()
run_step() {
  local name=$1 limit=$2 signal=$3 log=$4
  shift 4
  if (( limit < 15 )); then
    echo "== $name: skipped, ${limit} s left" | tee -a "$out/steps.txt"
    return
  fi
  echo "== $name (at most ${limit} s, at $(( SECONDS - start )) s)"
  local t0=$SECONDS
  timeout -s "$signal" -k 10 "$limit" "$@" 2>&1 | tee "$log" | tail -"${TAIL_LINES:-30}"
  local status=${PIPESTATUS[0]}
  echo "== $name: exit $status after $(( SECONDS - t0 )) s (total $(( SECONDS - start )) s)" \
    | tee -a "$out/steps.txt"
  statuses+=("$name=$status")
  bundle
}

if [[ "${INSTALL:-1}" != "0" ]]; then
  t0=$SECONDS
  if compgen -G ".whl/*.whl" > /dev/null; then
    "$py" -m pip install --quiet --no-deps --no-index .whl/*.whl
  fi
  "$py" -m pip install --quiet --no-deps --no-build-isolation -e .
  echo "== install: $(( SECONDS - t0 )) s" | tee -a "$out/steps.txt"
fi

# The tree's own commit (benchmarks/provenance.py): COMMIT, else git where the tree is
# a checkout, else .whl/tree.json; every step records it from this variable.
if [[ -n "${COMMIT:-}" ]]; then export PALLAS_KERNELS_COMMIT="$COMMIT"; fi
PALLAS_KERNELS_COMMIT="$("$py" -m benchmarks.provenance 2>/dev/null || echo unknown)"
export PALLAS_KERNELS_COMMIT
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $PALLAS_KERNELS_COMMIT"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv 2>&1 || true
  "$py" -c "import jax, triton; print('jax', jax.__version__, 'triton', triton.__version__, jax.devices())"
  "$py" -c "
try:
    import jax_triton; print('jax_triton', jax_triton.__version__)
except Exception as e:
    print('jax_triton not importable:', type(e).__name__, str(e).splitlines()[0])"
} > "$out/env.txt" 2>&1
cat "$out/env.txt"
if [[ -n "${TMA:-}" ]]; then export PALLAS_CORE_TRITON_TMA=1; fi

if has_step compat; then
  limit=$(budget "${COMPAT_S:-60}")
  run_step compat "$limit" TERM "$out/compat.log" \
    "$py" -m benchmarks.compat --out "$out" --budget-s "$(( limit > 25 ? limit - 10 : 15 ))"
fi

if has_step smoke; then
  limit=$(budget "${SMOKE_S:-100}")
  run_step smoke "$limit" TERM "$out/smoke.log" \
    "$py" -m benchmarks.smoke --out "$out" --budget-s "$(( limit > 40 ? limit - 20 : 15 ))"
fi

bench_args=(--out "$out/bench" --no-static "${quick[@]}")
if [[ -n "${FILTER:-}" ]]; then bench_args+=(--filter "$FILTER"); fi
if has_step headline; then
  limit=$(budget "${HEADLINE_S:-170}")
  headline_args=("${bench_args[@]}")
  if [[ -n "${RESUME:-}" ]]; then headline_args+=(--resume "$RESUME"); fi
  # --budget-s stops starting cases; the margin is for the last case and the report.
  run_step headline "$limit" TERM "$out/headline.txt" \
    "$py" -m benchmarks --headline "${headline_args[@]}" --budget-s "$(( limit > 60 ? limit - 40 : 20 ))"
fi

if has_step queue; then
  limit=$(budget "${QUEUE_S:-100}")
  run_step queue "$limit" TERM "$out/queue.txt" \
    "$py" -m benchmarks.lease_queue --out "$out" "${quick[@]}" --budget-s "$(( limit > 50 ? limit - 30 : 15 ))"
fi

if has_step tune; then
  limit=$(budget "${TUNE_S:-50}")
  tune_args=(--out "$out/tuned_configs.json" --report "$out/tune_report.json"
             --ops "${TUNE_OPS:-fused_matmul,dot_product_attention,gated_linear_unit}"
             --budget-s "$(( limit > 40 ? limit - 25 : 10 ))" --max-candidates "${TUNE_CANDIDATES:-6}"
             "${quick[@]}")
  run_step tune "$limit" TERM "$out/tune.txt" "$py" -m benchmarks.tune "${tune_args[@]}"
  if [[ -s "$out/tuned_configs.json" ]]; then
    export PALLAS_KERNELS_TUNING_CACHE="$out/tuned_configs.json"
  fi
fi

# pytest: SIGINT lets it print its summary; each failure is written when it happens.
pytest_args=(-m gpu -v -rfE -p no:cacheprovider -o addopts= -p benchmarks.live_failures
             --live-failures "$out/pytest_failures.txt")
if has_step tma; then
  run_step tma "$(budget "${TMA_S:-40}")" INT "$out/tma_launch.txt" \
    "$py" -m pytest "${pytest_args[@]}" tests/test_tma_launch.py
fi

if has_step tests; then
  # gpu-marked tests, and the op batteries' test_on_gpu in the modules subclassing OpBattery.
  gpu_files=$(grep -lE "mark\.gpu|\(OpBattery\)" tests/*.py benchmarks/*.py 2>/dev/null | grep -v test_tma_launch)
  workers=()
  if [[ "${TEST_WORKERS:-4}" -gt 1 ]] && "$py" -c "import xdist" 2>/dev/null; then
    workers=(-n "${TEST_WORKERS:-4}")
  fi
  # Workers share the GPU, each allocating as it goes (JAX's default preallocates 75%).
  # shellcheck disable=SC2086  # one argument per file
  XLA_PYTHON_CLIENT_PREALLOCATE=false run_step tests "$(budget "${TESTS_S:-90}")" INT \
    "$out/pytest_gpu.txt" "$py" -m pytest "${pytest_args[@]}" "${workers[@]}" $gpu_files
fi

if has_step lm; then
  run_step lm "$(budget "${LM_S:-150}")" TERM "$out/lm.txt" "$py" -m benchmarks.lm --json "$out/lm.json"
fi

if has_step bench; then
  # The rest of the suite after the headline (the same results.json, resumed).
  rest_args=("${bench_args[@]}")
  if [[ -s "$out/bench/results.json" ]]; then
    rest_args+=(--resume "$out/bench/results.json")
  elif [[ -n "${RESUME:-}" ]]; then
    rest_args+=(--resume "$RESUME")
  fi
  limit=$(( ${SESSION_BUDGET_S:-540} - (SECONDS - start) ))
  TAIL_LINES=60 run_step bench "$limit" TERM "$out/benchmarks.txt" \
    "$py" -m benchmarks "${rest_args[@]}" --budget-s "$(( limit > 60 ? limit - 45 : 15 ))"
fi

echo "steps: ${statuses[*]}; $(( SECONDS - start )) s in all" | tee -a "$out/steps.txt"
for s in "${statuses[@]}"; do [[ "${s#*=}" == "0" ]] || exit 1; done
exit 0
