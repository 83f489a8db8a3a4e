#!/usr/bin/env bash
# Everything a lent GPU is for, in one call: install, check every op on the GPU,
# then time the benchmark suite. Run from the repository root, e.g. through the
# device tool with carry [".whl"] (wheels the image lacks, jax-triton above all):
#
#   bash benchmarks/gpu_session.sh            # pytest -m gpu, then python -m benchmarks
#   QUICK=1 bash benchmarks/gpu_session.sh    # the same with one tiny case per op
#   FILTER=dot_product_attention bash benchmarks/gpu_session.sh   # only the matching cases
#
# Environment: PYTHON (default python3), OUT (default benchmarks/results/latest),
# COMMIT (recorded in env.txt; the device's copy of the tree has no .git),
# INSTALL=0 to use what is installed as is.
# Writes under $OUT: env.txt, pytest_gpu.txt, benchmarks.txt and the benchmark
# folder bench/ (results.json, results.md, results.png). Copy that folder to
# benchmarks/results/<date>-gpu-<device>/ and commit it.
# The device image has no registry: nothing is downloaded, so the project is
# installed without its dependencies, on the image's own JAX, Flax and Triton.
set -uo pipefail
py="${PYTHON:-python3}"
out="${OUT:-benchmarks/results/latest}"
mkdir -p "$out"

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

# Correctness on the hardware first: a failure here makes the timings meaningless.
"$py" -m pytest -m gpu -q -p no:cacheprovider 2>&1 | tee "$out/pytest_gpu.txt" | tail -25
tests_status=${PIPESTATUS[0]}

bench_args=(--out "$out/bench")
if [[ -n "${QUICK:-}" ]]; then bench_args+=(--quick); fi
if [[ -n "${FILTER:-}" ]]; then bench_args+=(--filter "$FILTER"); fi
"$py" -m benchmarks "${bench_args[@]}" 2>&1 | tee "$out/benchmarks.txt" | tail -60
bench_status=${PIPESTATUS[0]}

echo "pytest -m gpu exit ${tests_status}; benchmarks exit ${bench_status}"
exit $(( tests_status != 0 || bench_status != 0 ))
