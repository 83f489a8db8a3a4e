"""ops.ragged_dot: the grouped matmul against jax.lax.ragged_dot (values and jax.grad), an
independent dense reference, JAX's megablox gmm on pallas_core, on every kernel backend that
runs here (interpret with both walks, triton in Triton's CPU interpreter) and lowered for TPU."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ops
from ops.moe import group_table
from ops.moe.config import RaggedDotConfig
from ops.moe.ragged_dot import _kernel_ragged_dot
from ops.moe.reference import dense_reference
from tests.op_battery import Case, OpBattery, OpSpec
from tests.tolerances import BACKWARD, FORWARD, assert_close, for_dtype

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
HIGHEST = jax.lax.Precision.HIGHEST


def normal(shape, seed, dtype=F32):
    """NumPy draws: a new jax.random shape costs an XLA compile of threefry."""
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def sizes(*s):
    return jnp.asarray(s, jnp.int32)


def lax_ragged_dot(lhs, rhs, gs):
    """jax.lax.ragged_dot with float32 accumulation, in lhs's dtype."""
    return jax.lax.ragged_dot(lhs, rhs, gs, precision=HIGHEST,
                              preferred_element_type=F32).astype(lhs.dtype)


def run(impl, lhs, rhs, gs, offset=None, walk=None, blocks=(8, 16, 16), out_dtype=None):
    """ops.ragged_dot on ``impl`` with small tiles (edge tiles, group boundaries inside
    tiles); ``walk`` forces the interpreter onto the loop walk triton uses ("loop") or
    onto pallas_triton's form ("operands": programs per output tile, the tables as
    ordinary operands), which JAX's Triton lowering cannot run on a CPU."""
    if walk is None:
        return ops.ragged_dot(lhs, rhs, gs, group_offset=offset, implementation=impl,
                              preferred_element_type=out_dtype, block_sizes=blocks)
    off = None if offset is None else jnp.int32(offset)
    return _kernel_ragged_dot(lhs, rhs, gs, off, impl, RaggedDotConfig(*blocks),
                              out_dtype or lhs.dtype, "loop", walk != "operands")


BACKENDS = [("interpret", None), ("interpret", "loop"), ("interpret", "operands"),
            ("triton", None)]
BACKEND_IDS = ["interpret", "interpret-loop", "pallas_triton-form", "triton"]

# M = 37 rows (not a multiple of 8 or 16), K = 20, N = 24 (not multiples of 16); eight
# groups: empty ones, one holding every row, a sum below M, every group empty.
G8_PATTERNS = {
    "mixed": (0, 6, 1, 0, 13, 9, 0, 8),
    "one_holds_all": (0, 0, 0, 37, 0, 0, 0, 0),
    "sum_below_M": (5, 0, 9, 3, 0, 0, 2, 1),
    "all_empty": (0,) * 8,
}


def blocks_for(impl):
    return (16, 16, 16) if impl == "triton" else (8, 16, 16)  # tl.dot's minimum is 16


def loss_of(fn, cot):
    return lambda a, b, g: jnp.sum(fn(a, b, g).astype(F32) * cot)


def check_against_lax(fn, lhs, rhs, patterns, dtype=F32, what=""):
    """``fn(lhs, rhs, group_sizes)`` (jitted: one compile for every pattern) against
    jax.lax.ragged_dot: values, rows past the sum exactly 0, and jax.grad in lhs and rhs;
    an empty group's rhs gradient exactly 0 (stored, not left unwritten)."""
    cot = normal((lhs.shape[0], rhs.shape[2]), 99)
    f = jax.jit(fn)
    grad = jax.jit(jax.grad(loss_of(fn, cot), (0, 1)))
    want_grad = jax.jit(jax.grad(loss_of(lax_ragged_dot, cot), (0, 1)))
    for name, gsz in patterns.items():
        gs = sizes(*gsz)
        out = f(lhs, rhs, gs)
        assert out.dtype == lhs.dtype
        assert_close(out, lax_ragged_dot(lhs, rhs, gs), for_dtype(FORWARD, dtype), f"{what} {name}")
        assert np.all(np.asarray(out, np.float32)[int(sum(gsz)):] == 0), "rows past the sum"
        for part, a, b in zip(("dlhs", "drhs"), grad(lhs, rhs, gs), want_grad(lhs, rhs, gs)):
            assert a.dtype == lhs.dtype
            assert_close(a, b, for_dtype(BACKWARD, dtype), f"{what} {name} {part}")
        got_drhs = np.asarray(grad(lhs, rhs, gs)[1], np.float32)
        assert np.all(got_drhs[np.asarray(gsz) == 0] == 0), f"{name}: empty groups' drhs"


@pytest.mark.parametrize("impl,walk", [
    BACKENDS[0], pytest.param(*BACKENDS[1], marks=pytest.mark.slow),
    pytest.param(*BACKENDS[2], marks=pytest.mark.slow), BACKENDS[3]], ids=BACKEND_IDS)
def test_eight_groups_match_lax_ragged_dot_and_its_grad(impl, walk):
    lhs, rhs = normal((37, 20), 0), normal((8, 20, 24), 1)
    check_against_lax(lambda a, b, g: run(impl, a, b, g, walk=walk, blocks=blocks_for(impl)),
                      lhs, rhs, G8_PATTERNS, what=impl)


def test_one_group():
    """G = 1: one group holding all rows, or fewer (interpreter, tiles of 8 rows; values,
    the gradients' kernels being those of the G = 8 test)."""
    lhs, rhs = normal((37, 20), 2), normal((1, 20, 24), 3)
    f = jax.jit(lambda a, b, g: run("interpret", a, b, g))
    for gsz in ((37,), (30,)):
        gs = sizes(*gsz)
        out = f(lhs, rhs, gs)
        assert_close(out, lax_ragged_dot(lhs, rhs, gs), for_dtype(FORWARD, F32), f"G1 {gsz}")
        assert np.all(np.asarray(out)[gsz[0]:] == 0)


def test_16_bit_dtypes():
    """G = 3 with an empty middle group in bfloat16 (values and gradients) and float16
    (values): the operands' dtype out, float32 accumulation (interpret)."""
    lhs, rhs = normal((37, 20), 5, BF16), normal((3, 20, 24), 6, BF16)
    check_against_lax(lambda a, b, g: run("interpret", a, b, g), lhs, rhs,
                      {"empty_middle": (11, 0, 26)}, dtype=BF16, what="bfloat16")
    lhs, rhs, gs = lhs.astype(F16), rhs.astype(F16), sizes(11, 0, 26)
    out = jax.jit(lambda a, b, g: run("interpret", a, b, g))(lhs, rhs, gs)
    assert out.dtype == F16
    assert_close(out, lax_ragged_dot(lhs, rhs, gs), for_dtype(FORWARD, F16), "float16")


def test_preferred_element_type():
    lhs, rhs, gs = normal((37, 20), 8, BF16), normal((3, 20, 24), 9, BF16), sizes(11, 0, 26)
    out = jax.jit(lambda a, b, g: run("interpret", a, b, g, out_dtype=F32))(lhs, rhs, gs)
    assert out.dtype == F32
    want = jax.lax.ragged_dot(lhs, rhs, gs, preferred_element_type=F32)
    assert_close(out, want, for_dtype(FORWARD, F32) * 10, "bf16 in, float32 out")
    assert ops.ragged_dot(lhs, rhs, gs, preferred_element_type=F32,
                          implementation="xla").dtype == F32


@pytest.mark.parametrize("impl,walk", [
    BACKENDS[0], pytest.param(*BACKENDS[2], marks=pytest.mark.slow),
    pytest.param(*BACKENDS[3], marks=pytest.mark.slow)],
    ids=["interpret", "pallas_triton-form", "triton"])
def test_group_offset_owns_a_slice_of_the_groups(impl, walk):
    """rhs holds groups [offset, offset + 3) of 8: rows of the other groups are 0, and the
    shards' outputs sum to the whole product (values and gradients)."""
    gsz = (3, 7, 0, 9, 5, 0, 6, 4)
    lhs, rhs, gs = normal((37, 20), 10), normal((8, 20, 24), 11), sizes(*gsz)
    cot = normal((37, 24), 12)

    def fn(a, b, o):
        return run(impl, a, b, gs, offset=o, walk=walk, blocks=blocks_for(impl))
    f = jax.jit(fn)
    grad = jax.jit(jax.grad(lambda a, b, o: jnp.sum(fn(a, b, o) * cot), (0, 1)))
    dense = jax.jit(dense_reference)
    total, dlhs, drhs = 0, 0, []
    for offset in (0, 3, 6):
        local = rhs[offset:offset + 3]
        out = f(lhs, local, jnp.int32(offset))
        want = dense(lhs, local, gs, jnp.int32(offset))
        assert_close(out, want, for_dtype(FORWARD, F32), f"offset {offset}")
        owned = np.zeros(37, bool)
        begin = sum(gsz[:offset])
        owned[begin:begin + sum(gsz[offset:offset + 3])] = True
        assert np.all(np.asarray(out)[~owned] == 0)
        total = total + out
        g = grad(lhs, local, jnp.int32(offset))
        dlhs, drhs = dlhs + g[0], drhs + [g[1]]
    assert_close(total, lax_ragged_dot(lhs, rhs, gs), for_dtype(FORWARD, F32), "sum over shards")
    want = jax.grad(lambda a, b: jnp.sum(lax_ragged_dot(a, b, gs) * cot), (0, 1))(lhs, rhs)
    assert_close(dlhs, want[0], for_dtype(BACKWARD, F32), "dlhs")
    assert_close(jnp.concatenate(drhs)[:8], want[1], for_dtype(BACKWARD, F32), "drhs")


def test_xla_reference_with_group_offset_and_edge_offsets():
    """The XLA implementation against the dense one-matmul-per-group reference, offsets
    before, inside and past the groups, as a scalar and as [1]."""
    gsz = (3, 7, 0, 9, 5)
    lhs, rhs, gs = normal((30, 6), 13), normal((2, 6, 5), 14), sizes(*gsz)
    xla = jax.jit(lambda a, b, g, o: ops.ragged_dot(a, b, g, group_offset=o, implementation="xla"))
    dense = jax.jit(dense_reference)
    for offset in (-1, 0, 2, 3, 4, 6):
        for form in (jnp.int32(offset), jnp.asarray([offset], jnp.int32)):
            assert_close(xla(lhs, rhs, gs, form), dense(lhs, rhs, gs, jnp.int32(offset)), 2e-6,
                         f"offset {offset}")


def test_vmap():
    """vmapped over lhs and group_sizes (jit is in every other test)."""
    lhs, rhs = normal((2, 24, 16), 15), normal((3, 16, 16), 16)
    gs = jnp.asarray([[5, 0, 19], [10, 10, 2]], jnp.int32)
    got = jax.jit(jax.vmap(lambda a, g: ops.ragged_dot(a, rhs, g, implementation="interpret")))(
        lhs, gs)
    want = jnp.stack([lax_ragged_dot(lhs[i], rhs, gs[i]) for i in range(2)])
    assert_close(got, want, 2e-6, "vmap")


@pytest.mark.slow
def test_matches_megablox_gmm_on_pallas_core():
    """JAX's megablox gmm (its own source, run on pallas_core's interpreter) on the same
    inputs: values and both gradients."""
    from benchmarks.jax_pallas_tests import load_on_pallas_core
    megablox = load_on_pallas_core("jax.experimental.pallas.ops.tpu.megablox.ops")
    lhs, rhs, gs = normal((128, 128), 17), normal((4, 128, 128), 18), sizes(30, 0, 70, 28)
    cot = normal((128, 128), 19)
    results = []
    for f in (lambda a, b: megablox.gmm(a, b, gs, preferred_element_type=F32, tiling=(64, 64, 64),
                                        interpret=True),
              lambda a, b: ops.ragged_dot(a, b, gs, implementation="interpret",
                                          block_sizes=(64, 64, 64))):
        out, vjp = jax.vjp(f, lhs, rhs)
        results.append((out, *vjp(cot)))
    for name, got, want in zip(("out", "dlhs", "drhs"), *results):
        assert_close(got, want, for_dtype(BACKWARD, F32), name)


@pytest.mark.parametrize("case,error,match", [
    ("lhs_rank", ValueError, "lhs must have rank 2"),
    ("rhs_rank", ValueError, "rhs must have rank 3"),
    ("k_mismatch", ValueError, "lhs's K"),
    ("sizes_float", TypeError, "group_sizes must have an integer dtype"),
    ("sizes_shape", ValueError, "group_sizes must have shape"),
    ("sizes_short_with_offset", ValueError, "group_sizes must list every group"),
    ("offset_shape", ValueError, "group_offset must be a scalar"),
    ("offset_float", TypeError, "group_offset must be an integer"),
    ("dtype_mix", TypeError, "rhs has dtype"),
    ("int_lhs", TypeError, "lhs has dtype"),
    ("preferred_int", TypeError, "preferred_element_type"),
    ("precision", TypeError, "precision"),
    ("block_sizes", ValueError, "block_sizes"),
    ("implementation", ValueError, "implementation"),
    ("mosaic_gpu", NotImplementedError, "mosaic_gpu"),
])
def test_bad_input_is_named_before_tracing(case, error, match):
    lhs, rhs, gs = np.ones((8, 4), np.float32), np.ones((2, 4, 3), np.float32), np.array([4, 4])
    kw = {}
    if case == "lhs_rank":
        lhs = lhs[None]
    elif case == "rhs_rank":
        rhs = rhs[0]
    elif case == "k_mismatch":
        rhs = np.ones((2, 5, 3), np.float32)
    elif case == "sizes_float":
        gs = gs.astype(np.float32)
    elif case == "sizes_shape":
        gs = np.array([8])
    elif case == "sizes_short_with_offset":
        gs, kw = np.array([8]), dict(group_offset=0)
    elif case == "offset_shape":
        kw = dict(group_offset=np.array([0, 1], np.int32))
    elif case == "offset_float":
        kw = dict(group_offset=np.float32(0))
    elif case == "dtype_mix":
        rhs = rhs.astype(np.float16)
    elif case == "int_lhs":
        lhs = lhs.astype(np.int32)
    elif case == "preferred_int":
        kw = dict(preferred_element_type=jnp.int32)
    elif case == "precision":
        kw = dict(precision="fast-ish")
    elif case == "block_sizes":
        kw = dict(block_sizes=(8, 0, 8))
    elif case == "implementation":
        kw = dict(implementation="cuda")
    elif case == "mosaic_gpu":
        kw = dict(implementation="mosaic_gpu")
    with pytest.raises(error, match=match):
        ops.ragged_dot(lhs, rhs, gs, **kw)


def test_degenerate_shapes():
    """M, K, N or G of zero: XLA's exact answer on every implementation."""
    for m, k, n, g in ((0, 4, 3, 2), (5, 0, 3, 2), (5, 4, 0, 2)):
        lhs, rhs = jnp.ones((m, k)), jnp.ones((g, k, n))
        gs = sizes(*([m // g] * (g - 1) + [m - m // g * (g - 1)]))
        out = ops.ragged_dot(lhs, rhs, gs, implementation="interpret")
        assert out.shape == (m, n) and np.all(np.asarray(out) == 0)


@pytest.mark.parametrize("impl,platform,marker", [
    ("mosaic_tpu", "tpu", "tpu_custom_call"), ("pallas_triton", "cuda", "__gpu$xla.gpu.triton")])
def test_lowers_for_other_platforms(impl, platform, marker):
    """Forward, dlhs and drhs kernels lower through Mosaic for a TPU and through JAX's
    Triton lowering for a GPU from this host."""
    def fwd_bwd(a, b, g):
        out, vjp = jax.vjp(lambda a, b: ops.ragged_dot(a, b, g, implementation=impl), a, b)
        return out, vjp(out)
    args = (jax.ShapeDtypeStruct((300, 256), BF16), jax.ShapeDtypeStruct((3, 256, 640), BF16),
            jax.ShapeDtypeStruct((3,), jnp.int32))
    text = jax.jit(fwd_bwd).trace(*args).lower(lowering_platforms=(platform,)).as_text()
    assert text.count(marker) == 3


def test_row_visits_cover_every_row_once():
    """The visit table over random group sizes (empty groups, sum < M, offsets): each row
    of [0, M) in exactly one visit inside the visit's tile, owned rows active."""
    rng = np.random.default_rng(22)
    for g, local, m, bm in ((8, 3, 37, 8), (3, 1, 9, 4)):
        table = jax.jit(lambda gs, off: group_table.row_visits(gs, local, off, m, bm).tables())
        for trial in range(10):
            cuts = np.sort(rng.integers(0, m + 1, g))
            gsz = np.diff(np.concatenate([[0], cuts]))
            offset = int(rng.integers(0, g - local + 1))
            tile, group, lo, hi, active = (np.asarray(t) for t in table(
                jnp.asarray(gsz, jnp.int32), jnp.int32(offset)))
            covered = np.zeros(m, int)
            for t, l, h in zip(tile, lo, hi):
                if l < h:
                    assert t * bm <= l < h <= (t + 1) * bm
                    covered[l:h] += 1
            assert np.all(covered == 1), (gsz, offset, local)
            begin = int(gsz[:offset].sum())
            for a, gr, l, h in zip(active, group, lo, hi):
                if a:
                    assert begin + gsz[offset:offset + gr].sum() <= l
                    assert h <= begin + gsz[offset:offset + gr + 1].sum()


def test_heuristic_follows_tokens_per_group():
    from ops._op import Device
    from ops.moe.ragged_dot import OP as op
    gpu = Device("triton")
    big = RaggedDotConfig.heuristic(op.problem((32768, 4096, 14336, 8), BF16), gpu)
    assert big.blocks == (128, 128, 64)
    fine = RaggedDotConfig.heuristic(op.problem((2048, 2048, 1024, 64), BF16), gpu)
    assert fine.block_m == 32  # 32 rows per group
    tpu = RaggedDotConfig.heuristic(op.problem((300, 256, 640, 3), BF16), Device("mosaic_tpu"))
    assert tpu.block_m % 8 == 0 and tpu.block_n in (512, 640)


# --------------------------------------------------------------------------
# The op battery (tests/op_battery.py): every implementation registered for a GPU
# --------------------------------------------------------------------------

def _battery_inputs(rng, dtype, m=300, k=200, n=136, sizes=(50, 0, 120, 3, 97, 20), offset=None,
                    local=None):
    """lhs [m, k], rhs [local or G, k, n] (entries of order 1 in the product), group sizes
    (an empty group; their sum below m, so the last rows belong to none), the group offset."""
    lhs = jnp.asarray(rng.standard_normal((m, k), np.float32), dtype)
    rhs = jnp.asarray(rng.standard_normal((local or len(sizes), k, n), np.float32) / np.sqrt(k), dtype)
    group_offset = None if offset is None else jnp.asarray([offset], jnp.int32)
    return lhs, rhs, jnp.asarray(sizes, jnp.int32), group_offset


def _battery_ragged_dot(lhs, rhs, group_sizes, group_offset=None, **kwargs):
    return ops.ragged_dot(lhs, rhs, group_sizes, group_offset=group_offset, **kwargs)


def _battery_reference(lhs, rhs, group_sizes, group_offset=None):
    """jax.lax.ragged_dot over every group in float32; with an offset, the groups the call
    does not own get zero matrices (their rows are zero in the op's output)."""
    if group_offset is not None:
        every = jnp.zeros((group_sizes.shape[0],) + rhs.shape[1:], rhs.dtype)
        rhs = jax.lax.dynamic_update_slice(every, rhs, (group_offset[0], 0, 0))
    return jax.lax.ragged_dot(lhs, rhs, group_sizes, precision=HIGHEST, preferred_element_type=F32)


# On this host only XLA runs these (the kernels' CPU runs are the tests above); test_on_gpu
# runs them on every implementation registered for a GPU, with gradients. M = 300, K = 200
# and N = 136 divide no tile.
RAGGED_DOT = OpSpec(
    name="ragged_dot", op=_battery_ragged_dot, reference=_battery_reference,
    make_inputs=_battery_inputs, grad_argnums=(0, 1), implementations=("xla",),
    cases=[Case("groups", dtypes=(BF16, F32)),
           Case("group_offset", dict(offset=2, local=3), dtypes=(F16,))],
    dtypes=(BF16,), xla_is_reference=False, unavailable=None)


class TestRaggedDotBattery(OpBattery):
    """ragged_dot against jax.lax.ragged_dot, outputs and gradients."""
    spec = RAGGED_DOT
