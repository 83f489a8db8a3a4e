"""Issue 13 section 1: loop peeling, grouped program order, persistent programs and tensor
descriptors (TMA) in our Triton code generator.

Results run in Triton's CPU interpreter and are compared with the interpret
backend (bit for bit where the arithmetic is the same sequence of float32
operations) and with XLA references; the GPU code is checked in the sm_90
PTX that Triton's own compiler produces on this host.
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ops
import pallas_core as pl
from pallas_core.triton import program_order
from tests.tolerances import FORWARD, assert_close

pytest.importorskip("triton")
pytest.importorskip("torch")

# A seed-002 reduction over grid axis 2, on shapes that divide none of the blocks.
M, N, K = 40, 72, 100
BM, BN, BK = 16, 32, 16


def _reduction_kernel(x_ref, y_ref, o_ref, acc_ref):
    k = pl.program_id(2)

    @pl.when(k == 0)
    def _init():
        acc_ref[...] = jnp.full(acc_ref.shape, 0.5, jnp.float32)

    acc_ref[...] += x_ref[...] - y_ref[...]

    @pl.when(k == pl.num_programs(2) - 1)
    def _store():
        o_ref[...] = acc_ref[...] * 2.0


def _reduction(backend, **switches):
    """``2 * (0.5 + sum_k (x[k] - y[k]))`` blockwise, k over grid axis 2: float32 adds in one
    order and nothing XLA could fuse into an FMA, so every backend agrees bit for bit."""
    params = (pl.triton.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"), **switches)
              if backend == "triton" else pl.CompilerParams(("parallel", "parallel", "arbitrary")))
    spec = pl.BlockSpec((BM, BN), lambda i, j, k: (i, j))
    stacked = pl.BlockSpec((None, BM, BN), lambda i, j, k: (k, i, j))
    return pl.pallas_call(
        _reduction_kernel, out_shape=jax.ShapeDtypeStruct((M, N), jnp.float32),
        grid=(pl.cdiv(M, BM), pl.cdiv(N, BN), 3), in_specs=[stacked, stacked], out_specs=spec,
        scratch_shapes=[pl.tpu.VMEM((BM, BN), jnp.float32)], compiler_params=params, backend=backend)


def _inputs(*shapes, dtype=jnp.float32, seed=0):
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    return [jax.random.normal(k, s, jnp.float32).astype(dtype) for k, s in zip(keys, shapes)]


def _loop_body(source: str) -> str:
    """The lines of the generated kernel's (last) loop over a grid axis."""
    lines = source.splitlines()
    start = max(i for i, line in enumerate(lines) if re.match(r"\s*for i\d+ in range\(G\d+\):", line))
    indent = len(lines[start]) - len(lines[start].lstrip())
    body = []
    for line in lines[start + 1:]:
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            break
        body.append(line)
    return "\n".join(body)


# ---------------------------------------------------------------------------------------
# Loop peeling
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("peel", [True, False])
def test_peeling_bit_identical_to_interpret(peel):
    x, y = _inputs((3, M, N), (3, M, N))
    got = _reduction("triton", loop_peeling=peel)(x, y)
    want = _reduction("interpret")(x, y)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_allclose(np.asarray(got), 2 * (0.5 + np.sum(np.asarray(x) - np.asarray(y), 0)),
                               rtol=1e-6, atol=1e-6)


def test_peeling_moves_first_and_last_iteration_blocks_out_of_the_loop():
    x, y = _inputs((3, M, N), (3, M, N))
    peeled = pl.triton.source(_reduction("triton"), x, y)[0]
    kept = pl.triton.source(_reduction("triton", loop_peeling=False), x, y)[0]
    assert "if " not in _loop_body(peeled), peeled
    assert _loop_body(kept).count("if ") == 2, kept
    # The init before the loop, the store after it (at the last block of axis 2).
    before, after = peeled.split("for i2 in range(G2):")
    assert "tl.full((16, 32), 0.5, tl.float32)" in before
    assert "tl.store(" in after.split("\n    pass\n", 1)[-1] or "tl.store(" in after.splitlines()[-1]


def _kernel_with(guard):
    """A reduction whose pl.when blocks are placed so that peeling must leave them alone."""
    def kernel(x_ref, o_ref):
        k = pl.program_id(1)
        if guard == "after_a_load":
            seen = x_ref[...]  # an effect before the k == 0 block: the block must stay in place

            @pl.when(k == 0)
            def _():
                o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)
            o_ref[...] += seen
        elif guard == "middle_iteration":
            @pl.when(k == 1)
            def _():
                o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)
            o_ref[...] += x_ref[...]
        elif guard == "reads_a_loop_value":
            @pl.when(k == 0)
            def _():
                o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)
            total = o_ref[...] + x_ref[...]
            o_ref[...] = total

            @pl.when(k == pl.num_programs(1) - 1)
            def _():
                o_ref[...] = total * 3.0  # a value of the loop body, not a Ref
    return kernel


@pytest.mark.parametrize("guard", ["after_a_load", "middle_iteration", "reads_a_loop_value"])
def test_peeling_leaves_blocks_that_may_not_move(guard):
    (x,) = _inputs((24, 3 * 16))

    def call(backend):
        return pl.pallas_call(_kernel_with(guard), out_shape=jax.ShapeDtypeStruct((24, 16), jnp.float32),
                              grid=(3, 3), in_specs=[pl.BlockSpec((8, 16), lambda i, k: (i, k))],
                              out_specs=pl.BlockSpec((8, 16), lambda i, k: (i, 0)), backend=backend,
                              compiler_params=pl.CompilerParams(("parallel", "arbitrary")))
    assert "if " in _loop_body(pl.triton.source(call("triton"), x)[0])
    np.testing.assert_array_equal(np.asarray(call("triton")(x)), np.asarray(call("interpret")(x)))


def test_peeling_shrinks_fused_matmul_on_sm90():
    """The k == 0 / k == last blocks of fused_matmul out of the K loop: 96 KiB of shared memory
    (the three pipeline stages) instead of 128 KiB (plus the epilogue's layout conversion,
    live inside the loop), and no per-iteration select of the accumulator."""
    x = jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16)
    f = lambda a, b: ops.fused_matmul(a, b, implementation="triton")
    (report,) = pl.triton.compile(f, x, x)
    assert report["shared_memory_bytes"] == 3 * (128 * 64 + 64 * 128) * 2
    assert report["spill_bytes"] == 0
    ptx = report["asm"]["ptx"]
    loop = _ptx_loop(ptx)
    assert loop.count("wgmma.mma_async") == 4
    assert len(re.findall(r"\bselp", loop)) < 8, "the accumulator is re-selected in every iteration"
    assert len(re.findall(r"\bbra", loop)) == 0


def _ptx_loop(ptx: str) -> str:
    """The PTX of the innermost loop: from its header label to its back edge."""
    (label,) = re.findall(r"^(\$L__BB\d+_\d+):\s*// .*Loop Header", ptx, re.M)[-1:]
    body = ptx[ptx.index(label + ":"):]
    return body[:body.index(f"bra \t{label};")]
