"""The static performance gate (benchmarks/static.py, docs/design.md §7.4) in CI.

CI compiles a small subset for sm_90 (compiles are slow on the CI host): the
fused matmul with its epilogue (wgmma, shared memory, spills, its committed
SASS budget), causal flash attention at head dim 64 (forward, dQ and dK/dV
against their committed budgets: SASS instructions per key/value iteration,
registers, no mma.sync) and a softmax
whose rows take several chunks, whose global-memory reads are counted in
Triton's interpreter against its two-pass design. The gate's own failure
conditions are checked on rows built to fail. The full sweep at every model
size (``python -m benchmarks.static``) is behind ``--slow``.
"""
from __future__ import annotations

import pytest

from benchmarks import static

_PASSING = dict(spill_bytes=0, registers=100, shared_memory_bytes=96 * 1024, has_dot=True,
                sixteen_bit=True, wgmma=4, mma_sync=0, tma=0, reads_per_element=1.0, design_reads=1,
                sass_instructions=3000, loop_instructions=[90, 80], budget_loops=[100, 90],
                budget_registers=128, budget_instructions=3560, budget_tma=False)


@pytest.fixture(scope="module")
def quick_rows():
    return static.run(static.quick_cases(), "sm_90", log=lambda _: None)


def test_quick_subset_passes_the_gate(quick_rows):
    by_kernel = {r["kernel"]: r for r in quick_rows}
    assert set(by_kernel) == {"fused_matmul_bias_gelu", "softmax_fwd", "flash_attention_fwd",
                              "flash_attention_dq", "flash_attention_dkdv"}, sorted(by_kernel)
    for row in quick_rows:
        assert row["violations"] == [], (row["kernel"], row["violations"])
    matmul = by_kernel["fused_matmul_bias_gelu"]
    assert matmul["wgmma"] > 0 and matmul["cp_async"] > 0 and matmul["mma_sync"] == 0
    assert matmul["budget_instructions"] and matmul["sass_instructions"] <= matmul["budget_instructions"]
    forward = by_kernel["flash_attention_fwd"]
    # Causal: the off-diagonal loop without the mask, then the diagonal one with it.
    assert len(forward["loop_instructions"]) == 2 and forward["budget_loops"] == [516, 717]
    for name in ("flash_attention_fwd", "flash_attention_dq", "flash_attention_dkdv"):
        row = by_kernel[name]
        assert row["wgmma"] > 0 and row["mma_sync"] == 0, (name, row["wgmma"], row["mma_sync"])
        assert row["budget_loops"] and row["budget_registers"] and row["budget_reason"], name
    softmax = by_kernel["softmax_fwd"]
    # 32768 bf16 features walk four 4096-wide chunks twice: statistics, then output.
    assert softmax["design_reads"] == 2 and softmax["reads_per_element"] == pytest.approx(2.0)
    assert softmax["writes_per_element"] == pytest.approx(1.0)


def test_a_kernel_reading_more_than_designed_fails(quick_rows):
    softmax = next(r for r in quick_rows if r["kernel"] == "softmax_fwd")
    assert "designed 1" in " ".join(static.violations(dict(softmax, design_reads=1)))


@pytest.mark.parametrize("change, message", [
    (dict(spill_bytes=64), "spills 64 bytes"),
    (dict(shared_memory_bytes=228 * 1024), "bytes of shared memory"),
    (dict(wgmma=0), "not wgmma"),
    (dict(reads_per_element=3.0, design_reads=2), "3.0 times, designed 2"),
    (dict(reads_per_element=None), "designed 1"),
    (dict(mma_sync=2), "2 mma.sync beside 16-bit dots"),
    (dict(loop_instructions=[120, 80], budget_loops=[100, 90]), "loop 0: 120 instructions per iteration > 100"),
    (dict(loop_instructions=[80], budget_loops=[100, 90]), "1 loop(s), budgeted 2"),
    (dict(budget_registers=96), "100 registers > 96"),
    (dict(sass_instructions=4000, budget_instructions=3560), "4000 instructions > 3560"),
    (dict(budget_tma=True, tma=0), "no TMA"),
])
def test_gate_failure_conditions(change, message):
    assert static.violations(_PASSING) == []
    assert message in " ".join(static.violations({**_PASSING, **change}))


def test_float32_dots_need_no_wgmma_and_unknown_targets_are_refused():
    assert static.violations({**_PASSING, "sixteen_bit": False, "wgmma": 0}) == []
    with pytest.raises(ValueError, match="target"):
        static.main(["--target", "sm_75", "--quick"])


@pytest.mark.slow
def test_every_op_at_model_sizes_passes_the_gate():
    rows = static.run(static.all_cases("sm_90"), "sm_90", log=lambda _: None)
    failing = [(r["case"], r["kernel"], r["violations"]) for r in rows if r["violations"]]
    assert not failing, failing


def test_backward_matmuls_are_named_and_budgeted_apart():
    """fused_matmul's dx and dw kernels carry their own names, so each K loop has its budget."""
    import jax
    import jax.numpy as jnp

    import ops
    import pallas_core as pl

    x, w = jnp.ones((64, 48), jnp.bfloat16), jnp.ones((48, 80), jnp.bfloat16)
    grads = jax.grad(lambda x, w: jnp.sum(ops.fused_matmul(x, w, implementation="triton")
                                          .astype(jnp.float32)), (0, 1))
    names = {line.split("(")[0][4:] for src in pl.triton.source(grads, x, w)
             for line in src.splitlines() if line.startswith("def fused_matmul")}
    assert {"fused_matmul", "fused_matmul_dx", "fused_matmul_dw"} <= names, names
    case = "fused_matmul/bias+gelu/4096x4096x4096/bfloat16/fwd+bwd"
    dx, dw = static.budget_fields(case, "fused_matmul_dx"), static.budget_fields(case, "fused_matmul_dw")
    assert dx["budget_loops"] and dw["budget_loops"] and dx["budget_loops"] != dw["budget_loops"]
