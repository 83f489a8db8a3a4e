"""Every registered benchmark case (:mod:`benchmarks.suite`) under pytest-benchmark.

Run with ``pytest benchmarks --benchmark-only``. Each test times one
implementation of one case on the default device (small sizes on CPU) and
records TFLOP/s or GB/s and the error against the float32 reference in
``extra_info``; nothing about speed is asserted.
"""
import jax
import pytest

from benchmarks import harness
from benchmarks.suite import collect_cases

PLATFORM = jax.default_backend()
CASES = collect_cases(PLATFORM)
PARAMS = [pytest.param(case, impl, id=f"{case.name}/{impl}")
          for case in CASES for impl in case.implementations]
# Fewer rounds on CPU, where the interpreter makes each call slow.
ROUNDS, WARMUP_ROUNDS = (10, 2) if PLATFORM == "cpu" else (50, 5)


@pytest.mark.parametrize(("case", "implementation"), PARAMS)
def test_case(benchmark, case, implementation):
    inputs = case.make_inputs(jax.random.key(0))
    compiled = harness.compile_fn(case.implementations[implementation], *inputs)

    def run():
        return jax.block_until_ready(compiled(*inputs))

    output = benchmark.pedantic(run, rounds=ROUNDS, warmup_rounds=WARMUP_ROUNDS, iterations=1)
    reference = jax.jit(case.reference)(*inputs)
    median_s = benchmark.stats.stats.median if benchmark.stats else float("nan")
    benchmark.extra_info.update({
        "shape": list(case.shape), "dtype": case.dtype, "pass": case.pass_name,
        "tflops": case.flops / median_s / 1e12,
        "gbps": (case.bytes_accessed or 0.0) / median_s / 1e9,
        "max_rel_error": harness.max_relative_error(output, reference),
        **harness.device_info(),
    })
