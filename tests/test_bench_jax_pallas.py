"""The benchmarks' ``jax_pallas`` column: JAX's own Pallas GPU ops (``attention.mha``,
``layer_norm``, ``rms_norm``, ``softmax``, :mod:`benchmarks.jax_pallas_ops`) on JAX's
interpreter, against each case's float64 reference, forward and fwd+bwd; and which
cases get the column on which platform."""
import jax
import pytest

from benchmarks import attention, harness, jax_pallas_ops, norms, softmax
from tests.tolerances import BACKWARD, FORWARD, for_dtype

NAME = jax_pallas_ops.NAME

# One small problem per op (each its own jax.random shapes: a threefry compile apiece).
# Attention: two 32-row backward blocks and one 64-row forward block, causal.
_MAKERS = {
    "mha": lambda pass_name: attention.make_case(
        attention.Shape(1, 64, 64, 2, 2, 32, True, "float32"), pass_name, (),
        jax_pallas_interpret=True),
    "layer_norm": lambda pass_name: norms.make_case("layer_norm", (8, 200), "float32", pass_name,
                                                    (), jax_pallas_interpret=True),
    "rms_norm": lambda pass_name: norms.make_case("rms_norm", (8, 200), "float32", pass_name, (),
                                                  jax_pallas_interpret=True),
    "softmax": lambda pass_name: softmax.make_case("softmax", (8, 200), "float32", "axis=-1",
                                                   pass_name, (), jax_pallas_interpret=True),
}
_PAIRS = [(op, p) for op in _MAKERS for p in harness.PASSES if (op, p) != ("softmax", "fwd+bwd")]


@pytest.mark.parametrize(("op", "pass_name"), _PAIRS, ids=[f"{o}-{p}" for o, p in _PAIRS])
def test_matches_case_reference(op, pass_name):
    # The case's own accuracy check, as python -m benchmarks runs it on a CPU: a kernel
    # called with another scale (mha's default sm_scale=1.0) or epsilon fails here.
    case = _MAKERS[op](pass_name)
    assert set(case.implementations) == {harness.BASELINE, NAME}
    rows = {r["implementation"]: r for r in harness.check_case(case, key=jax.random.key(3))}
    tolerance = for_dtype(BACKWARD if pass_name == "fwd+bwd" else FORWARD, case.dtype)
    assert rows[NAME]["error"] is None, rows[NAME]
    assert rows[NAME]["max_rel_error"] <= tolerance, rows[NAME]


def test_softmax_has_no_backward():
    # JAX's softmax kernel has no VJP: its fwd+bwd case has no column.
    assert NAME not in _MAKERS["softmax"]("fwd+bwd").implementations
    for op in ("log_softmax", "logsumexp"):
        assert NAME not in softmax.make_case(op, (8, 200), "float32", "axis=-1", "fwd", (),
                                             jax_pallas_interpret=True).implementations


def test_mha_unsupported():
    assert jax_pallas_ops.mha_unsupported(4096, 4096, 32, 32) is None
    assert "grouped-query" in jax_pallas_ops.mha_unsupported(4096, 4096, 32, 4)
    assert "q_len=200" in jax_pallas_ops.mha_unsupported(200, 200, 4, 4)
    assert "kv_len=80" in jax_pallas_ops.mha_unsupported(64, 80, 4, 4)  # 32-row backward block
    assert jax_pallas_ops.mha_unsupported(64, 64, 4, 4) is None


def _columns(platform, quick):
    """``{case name: the column's fwd interpret flag (None for fwd+bwd)}`` of the three modules."""
    found = {}
    for module in (attention, norms, softmax):
        for case in module.cases(platform, quick):
            fn = case.implementations.get(NAME)
            if fn is not None:
                keywords = getattr(fn, "keywords", {})
                found[case.name] = keywords.get("interpret")
    return found


def test_columns_by_platform():
    # A quick CPU run (CI's smoke test) has no column; a full one runs JAX's interpreter.
    assert _columns("cpu", quick=True) == {}
    assert _columns("tpu", quick=False) == {}
    cpu = _columns("cpu", quick=False)
    assert all(flag in (True, None) for flag in cpu.values()) and any(cpu.values())
    gpu = _columns("gpu", quick=False)
    assert all(flag in (False, None) for flag in gpu.values())
    ops = {name.split("/")[0] for name in gpu}
    assert ops == {"dot_product_attention", "layer_norm", "rms_norm", "softmax"}
    # Neither grouped-query attention, nor the residual-fused RMSNorm, nor softmax's backward.
    assert not any("gqa" in n or "add+scale" in n or n.startswith("softmax/") and n.endswith("bwd")
                   for n in gpu)
    gpu_attention = [c for c in attention.cases("gpu")
                     if "gqa" not in c.variant and "softcap" not in c.variant]
    assert all(NAME in c.implementations for c in gpu_attention)

