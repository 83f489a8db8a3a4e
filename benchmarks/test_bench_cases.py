"""Every registered benchmark case (:mod:`benchmarks.suite`) under pytest-benchmark.

Run with ``pytest benchmarks --benchmark-only`` (add ``-k SUBSTR`` to pick
cases, ``--benchmark-autosave`` to keep a run under ``.benchmarks/`` and
``--benchmark-compare`` to compare with the last saved one). The cases are
``python -m benchmarks``'s own (:func:`benchmarks.suite.collect_cases`),
every implementation of each, on the default device (small sizes on a CPU,
where ``interpret`` and ``triton`` are interpreters and their times say
nothing about the kernels). Each test records TFLOP/s or GB/s and the error
against the float64 reference in ``extra_info``; nothing about speed is
asserted. The project's test command never collects this folder
(``testpaths = ["tests"]``).
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
    reference = harness.reference_output(case, inputs)
    median_s = benchmark.stats.stats.median if benchmark.stats else float("nan")
    benchmark.extra_info.update({
        "shape": list(case.shape), "dtype": case.dtype, "pass": case.pass_name,
        "tflops": case.flops / median_s / 1e12,
        "gbps": (case.bytes_accessed or 0.0) / median_s / 1e9,
        "max_rel_error": harness.max_relative_error(output, reference),
        **harness.device_info(),
    })
