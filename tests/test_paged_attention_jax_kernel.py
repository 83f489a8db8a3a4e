"""ops.paged_attention against JAX's own GPU kernel, ``jax.experimental.pallas.ops.gpu.
paged_attention``, run on pallas_core's interpreter (its source loaded with only the Pallas
imports swapped, :func:`benchmarks.jax_pallas_tests.load_on_pallas_core`): the same inputs,
random pages and page tables, lengths 0, 1, partial and full pages, GQA, soft caps and int8
pages with per-token scales."""
import jax
import jax.numpy as jnp
import pytest

import ops
from benchmarks.jax_pallas_tests import load_on_pallas_core
from tests.test_paged_attention import make_case
from tests.tolerances import assert_close

MODULE = "jax.experimental.pallas.ops.gpu.paged_attention"


@pytest.fixture(scope="module")
def theirs():
    return load_on_pallas_core(MODULE)


def test_loaded_on_pallas_core(theirs):
    # The kernel's Pallas modules are pallas_core's, and interpret=True runs pallas_core's
    # interpreter: no JAX pallas_call is left in the traced program.
    assert theirs.pl.__name__ == "pallas_core" and theirs.plgpu.__name__ == "pallas_core.triton"
    q, kp, vp, tables, lengths, _, _ = make_case(0, B=1, N=2, K=1, pages_per_seq=2)
    jaxpr = jax.make_jaxpr(lambda *a: theirs.paged_attention(
        *a, k_splits=1, pages_per_compute_block=1, interpret=True))(q, kp, vp, tables, lengths)
    assert "pallas_call" not in str(jaxpr)


# The kernel on our interpreter is compiled once per case (~3 s): CI runs it on the first
# case and compares the others with the op's XLA path (the kernels' reference); --slow runs all.
_SOFT_CAP = dict(N=16, K=1, lengths=[16, 0, 63, 48], soft_cap=2.5)
_INT8 = dict(N=4, K=4, lengths=[64, 17, 0, 32], int8=True)


@pytest.mark.parametrize("case, impls", [
    pytest.param(dict(N=8, K=2, lengths=[0, 1, 37, 64]), ("xla", "interpret"), id="gqa"),
    pytest.param(_SOFT_CAP, ("xla",), id="soft_cap-xla"),
    pytest.param(_SOFT_CAP, ("interpret",), id="soft_cap-interpret", marks=pytest.mark.slow),
    pytest.param(_INT8, ("xla",), id="int8-xla"),
    pytest.param(_INT8, ("interpret",), id="int8-interpret", marks=pytest.mark.slow),
])
def test_matches_jax_gpu_kernel_on_pallas_core(theirs, case, impls):
    case = dict(case)
    soft_cap = case.pop("soft_cap", None)
    q, kp, vp, tables, lengths, ks, vs = make_case(11, **case)
    want = theirs.paged_attention(q, kp, vp, tables, lengths, ks, vs, k_splits=2,
                                  pages_per_compute_block=1, attn_logits_soft_cap=soft_cap,
                                  interpret=True)
    for impl in impls:
        got = ops.paged_attention(q, kp, vp, tables, lengths, ks, vs, logits_soft_cap=soft_cap,
                                  implementation=impl, block_sizes=(1, 2))
        # JAX's kernel divides by (l + eps): 1e-7 relative, plus float32 rounding.
        assert_close(got, want, 2e-5, f"{impl} vs JAX's kernel")
