"""The warp-specialized Mosaic GPU matmul core (ops/matmul/mosaic_gpu_core.py) and the ops on it,
``implementation="mosaic_gpu"``, on a host without a GPU.

Every kernel here runs in JAX's GPU interpret mode with race detection on (a race
fails the call: pallas_core.gpu's default off a GPU) and is lowered for ``cuda``
before it runs (pallas_core.gpu.runner), against float64 references on fresh random
inputs whose shapes divide no tile; the lowered Mosaic GPU modules are read back
(``plgpu.mosaic_modules``) for the instructions the design promises. About 4 s per
kernel here (tracing, the cuda lowering and the interpreter): the sweeps are
``@pytest.mark.slow``.
"""
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ops
from ops import _op
from ops.activations import ACTIVATIONS, resolve_activation
from ops.matmul import mosaic_gpu_core as core
from ops.matmul.mosaic_gpu_config import MosaicMatmulConfig
from pallas_core import gpu as plgpu
from pallas_core.gpu import target
from tests.tolerances import BACKWARD, FORWARD, assert_close, for_dtype

f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731


def _normal(key, shape, dtype, scale=1.0):
    return (jax.random.normal(jax.random.key(key), shape, jnp.float32) * scale).astype(dtype)


def _operands(m, n, k, dtype, seed=0):
    x = _normal(seed, (m, k), dtype)
    w = _normal(seed + 1, (k, n), dtype, 1 / np.sqrt(k))
    b = _normal(seed + 2, (n,), dtype)
    return x, w, b


def _act64(name):
    """The activation in float64 numpy (JAX's meaning of the name)."""
    from scipy.special import erf
    return {None: lambda z: z, "relu": lambda z: np.maximum(z, 0), "silu": lambda z: z / (1 + np.exp(-z)),
            "gelu": lambda z: 0.5 * z * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z ** 3))),
            "gelu_exact": lambda z: 0.5 * z * (1 + erf(z / np.sqrt(2))),
            "softplus": lambda z: np.logaddexp(z, 0), "sigmoid": lambda z: 1 / (1 + np.exp(-z)),
            "tanh": np.tanh, "relu6": lambda z: np.clip(z, 0, 6)}[name]


# --- the core ----------------------------------------------------------------------------------

@pytest.mark.parametrize("lhs_t, rhs_t, wgm", [
    pytest.param(False, False, 1, marks=pytest.mark.slow), (True, False, 2),
    pytest.param(False, True, 2, marks=pytest.mark.slow)])
def test_core_transposed_operands_on_edge_tiles(lhs_t, rhs_t, wgm):
    """A @ B with either operand read in place transposed, the consumers split both ways, on
    136 x 200 x 130 (no dim divides the 128 x 128 x 64 block; K = 130 is padded to 192 for
    TMA's tiling, M = 136 and N = 200 run past the arrays' edges), two persistent programs."""
    m, n, k = 136, 200, 130
    a, b = _normal(0, (m, k), jnp.bfloat16), _normal(1, (k, n), jnp.bfloat16)
    lhs = core.Operand(a.T, transposed=True) if lhs_t else core.Operand(a)
    rhs = core.Operand(b.T, transposed=True) if rhs_t else core.Operand(b)
    (out,), _ = core.matmul([lhs], [rhs], m=m, n=n, k=k,
                            config=MosaicMatmulConfig(128, 128, 64, warpgroups_m=wgm))
    assert out.shape == (m, n) and out.dtype == jnp.bfloat16
    assert_close(out, f64(a) @ f64(b), for_dtype(FORWARD, jnp.bfloat16), "core")


def test_core_vectors_and_row_outputs():
    """Column vectors into the tile epilogue (two outputs), a row epilogue reducing each
    warpgroup tile to per-row maxima ([column blocks, M]), float16."""
    m, n, k = 72, 200, 64
    a, b, c = _normal(2, (m, k), jnp.float16), _normal(3, (k, n), jnp.float16), _normal(4, (n,), jnp.float16)

    def epilogue(tile):
        z = tile.accs[0] + tile.col(0).astype(jnp.float32)
        return jnp.maximum(z, 0.0), z

    def row_max(tile):
        return (jnp.where(tile.col_ids() < n, tile.accs[0], -jnp.inf).max(axis=1),)

    (out, z), (mx,) = core.matmul([core.Operand(a)], [core.Operand(b)], m=m, n=n, k=k,
                                  config=MosaicMatmulConfig(64, 128, 64), num_tile_outputs=2,
                                  epilogue=epilogue, cols=[c], num_row_outputs=1,
                                  row_epilogue=row_max)
    ref = f64(a) @ f64(b)
    tol = for_dtype(FORWARD, jnp.float16)
    assert_close(z, ref + f64(c), tol, "z")
    assert_close(out, np.maximum(ref + f64(c), 0), tol, "relu")
    assert mx.shape == (4, m)
    expected = np.stack([ref[:, j * 64:(j + 1) * 64].max(axis=1) for j in range(4)])
    np.testing.assert_allclose(f64(mx), expected, rtol=1e-5, atol=1e-5)


def test_lowered_module_is_the_warp_specialized_design():
    """What the cuda lowering emits for the forward at 256 x 512 x 256 on 128 x 256 x 64
    blocks: per K step and consumer 8 wgmma m64n128k16 (one wait), TMA loads and stores,
    mbarriers, register reallocation."""
    x = jax.ShapeDtypeStruct((256, 256), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16)
    config = MosaicMatmulConfig(128, 256, 64, num_stages=4)
    (module,) = plgpu.mosaic_modules(
        lambda x, w: ops.fused_matmul(x, w, activation="gelu", implementation="mosaic_gpu",
                                      block_sizes=config), x, w)
    count = lambda op: len(re.findall(re.escape(op), module))  # noqa: E731
    assert count("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16") == 8
    assert count("nvvm.cp.async.bulk.tensor.shared.cluster.global") >= 2  # the two operand loads
    assert count("nvvm.cp.async.bulk.tensor.global.shared.cta") == 4  # 64 x 64 epilogue stores
    assert count("nvvm.setmaxregister") == 2
    for op in ("nvvm.wgmma.wait.group.sync.aligned", "nvvm.mbarrier.arrive.expect_tx",
               "nvvm.mbarrier.try_wait.parity", "nvvm.cp.async.bulk.wait_group"):
        assert op in module, op


# --- fused_matmul ------------------------------------------------------------------------------

def _fused_ref(x, w, b, act):
    z = f64(x) @ f64(w) + (0 if b is None else f64(b))
    return _act64(act)(z)


@pytest.mark.parametrize("act, dtype", [("gelu", jnp.bfloat16), ("softplus", jnp.float16)])
def test_fused_matmul_forward(act, dtype):
    x, w, b = _operands(131, 200, 130, dtype, seed=5)  # M = 131: rows padded to 136 for TMA
    out = jax.jit(lambda x, w, b: ops.fused_matmul(x, w, b, activation=act,
                                                   implementation="mosaic_gpu"))(x, w, b)
    assert out.dtype == dtype
    assert_close(out, _fused_ref(x, w, b, act), for_dtype(FORWARD, dtype), f"fused {act}")


@pytest.mark.slow
@pytest.mark.parametrize("act", sorted(ACTIVATIONS))
def test_fused_matmul_every_activation(act):
    x, w, b = _operands(72, 136, 64, jnp.bfloat16, seed=6)
    out = ops.fused_matmul(x, w, b, activation=act, implementation="mosaic_gpu")
    assert_close(out, _fused_ref(x, w, b, act if act != "swish" else "silu"),
                 for_dtype(FORWARD, jnp.bfloat16), act)


def _grads(fn, x, w, b, g):
    out, pullback = jax.vjp(fn, x, w, b)
    return out, pullback(g)


@pytest.mark.parametrize("act, dtype, bias, config", [
    ("gelu_exact", jnp.bfloat16, True, None),
    pytest.param(None, jnp.float16, False,
                 MosaicMatmulConfig(128, 64, 64, warpgroups_m=2, num_stages=2), marks=pytest.mark.slow),
])
def test_fused_matmul_gradients(act, dtype, bias, config):
    """dx and dw on the core (w and x read transposed), dbias, against jax.grad of the float32
    reference; 136 x 200 x 130 divides no block."""
    x, w, b = _operands(136, 200, 130, dtype, seed=7)
    b = b if bias else None
    g = _normal(10, (136, 200), dtype)
    fn = lambda x, w, b: ops.fused_matmul(x, w, b, activation=act, implementation="mosaic_gpu",  # noqa: E731
                                          block_sizes=config)
    out, grads = _grads(fn, x, w, b, g)
    up = lambda a: None if a is None else a.astype(jnp.float32)  # noqa: E731
    ref = lambda x, w, b: ops.matmul.reference(x, w, b, resolve_activation(act, "t"))  # noqa: E731
    want, want_grads = _grads(ref, up(x), up(w), up(b), up(g))
    assert_close(out, want, for_dtype(FORWARD, dtype), "out")
    for name, got, exp in zip(("dx", "dw", "dbias"), grads, want_grads):
        if exp is None:
            assert got is None
            continue
        assert got.dtype == dtype
        assert_close(got, exp, for_dtype(BACKWARD, dtype), name)


# --- what the op refuses, and falls back from -----------------------------------------------

def _reason(call_fn, *args, platform="cpu"):
    call = _op_call(call_fn, *args)
    if platform != "cpu":
        call = type(call)(call.op, call.args, _op.Target(platform, "NVIDIA A100-SXM4-80GB"), call.pass_)
    return call.op.implementations["mosaic_gpu"].why_not(call)


def _op_call(fn, *args):
    from ops import _resolve
    return _resolve.capture_call(fn, args)


def test_supported_says_why_before_tracing(monkeypatch):
    x, w, b = _operands(16, 64, 64, jnp.bfloat16)
    plain = lambda **kw: (lambda x, w: ops.fused_matmul(x, w, implementation="mosaic_gpu", **kw))  # noqa: E731
    assert _reason(plain(), x, w) is None
    assert "float32" in _reason(plain(), x.astype(jnp.float32), w.astype(jnp.float32))
    assert "'sqrt'" in _reason(plain(activation=lambda z: jnp.sqrt(jnp.abs(z))), x, w)
    assert "MatmulConfig" in _reason(plain(block_sizes=ops.matmul.config.MatmulConfig(64, 64, 64)), x, w)
    assert "multiple of 64" in _reason(plain(block_sizes=(64, 64, 32)), x, w)

    class A100:
        platform, device_kind, compute_capability = "gpu", "NVIDIA A100-SXM4-80GB", "8.0"

    monkeypatch.setattr(target, "default_device", lambda: A100())
    assert "sm_90" in _reason(plain(), x, w, platform="gpu")


@pytest.mark.parametrize("kind, refused", [("NVIDIA H200", False), ("NVIDIA H100 80GB HBM3", False),
                                           ("NVIDIA A100-SXM4-80GB", True)])
def test_a_call_resolved_for_another_gpu_is_judged_by_its_family(kind, refused):
    """From this host (no such GPU), the matmul family keeps mosaic_gpu for an sm_90 device
    kind and refuses it for an older one, as resolve_implementation(device_kind=) asks."""
    x, w, _ = _operands(16, 64, 64, jnp.bfloat16)
    for fn, args in ((ops.fused_matmul, (x, w)), (ops.gated_linear_unit, (x, (w, w))),
                     (ops.linear_cross_entropy, (x, w, jnp.zeros((16,), jnp.int32)))):
        call = dataclasses.replace(_op_call(fn, *args), target=_op.Target.of_kind(kind))
        why = call.op.implementations["mosaic_gpu"].why_not(call)
        assert (why is not None) == refused, (fn.__name__, kind, why)
        if refused:
            assert "sm_80" in why and kind in why


def test_options_not_built_fall_back():
    """float32 operands and an activation with no Mosaic GPU rule run on the next
    implementation of the sequence; alone, mosaic_gpu raises NotImplementedError."""
    x, w, b = _operands(16, 64, 64, jnp.float32)
    out = ops.fused_matmul(x, w, b, activation="relu", implementation=("mosaic_gpu", "xla"))
    np.testing.assert_allclose(f64(out), _fused_ref(x, w, b, "relu"), rtol=1e-5, atol=1e-5)
    with pytest.raises(NotImplementedError, match="mosaic_gpu.*float32"):
        ops.fused_matmul(x, w, implementation="mosaic_gpu")
    xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    odd = lambda z: jnp.sqrt(jnp.abs(z))  # noqa: E731
    out = ops.fused_matmul(xb, wb, activation=odd, implementation=("mosaic_gpu", "xla"))
    assert_close(out, np.sqrt(np.abs(f64(xb) @ f64(wb))), for_dtype(FORWARD, jnp.bfloat16), "sqrt")


@pytest.mark.parametrize("config, words", [
    (MosaicMatmulConfig(96, 128, 64), "multiple of 64"),
    (MosaicMatmulConfig(128, 512, 64, warpgroups_m=2), "up to 256"),
    (MosaicMatmulConfig(128, 128, 64, warpgroups_m=3), "warpgroups_m"),
    (MosaicMatmulConfig(128, 128, 64, epilogue_m=48), "epilogue tile"),
    (MosaicMatmulConfig(128, 128, 64, band_m=4, band_n=4), "at most one"),
    (MosaicMatmulConfig(128, 128, 64, num_stages=1), "num_stages"),
])
def test_bad_configs_are_named(config, words):
    x, w, _ = _operands(16, 64, 64, jnp.bfloat16)
    with pytest.raises(ValueError, match=f"block_sizes.*{words}|{words}.*"):
        ops.fused_matmul(x, w, implementation="mosaic_gpu", block_sizes=config)


def test_config_over_shared_memory_is_refused():
    x, w, _ = _operands(16, 64, 64, jnp.bfloat16)
    config = MosaicMatmulConfig(256, 256, 256, num_stages=4, warpgroups_m=2)
    with pytest.raises(ValueError, match="shared memory"):
        ops.fused_matmul(x, w, implementation="mosaic_gpu", block_sizes=config)


def test_registered_with_the_op_layer_and_the_tuner():
    impl = _op.get("fused_matmul").implementations["mosaic_gpu"]
    assert impl.config is MosaicMatmulConfig and impl.platforms == ("gpu",)
    problem = _op.get("fused_matmul").problem((8192, 8192, 8192), jnp.bfloat16)
    device = _op.Device("mosaic_gpu")
    assert MosaicMatmulConfig.heuristic(problem, device) == MosaicMatmulConfig(128, 256, 64)
    candidates = MosaicMatmulConfig.candidates(problem, device)
    assert len(set(candidates)) == len(candidates) > 4
    for c in candidates:
        c.check("candidates")


# --- gated_linear_unit --------------------------------------------------------------------------

def _glu_grads(weights_form, act, dtype, m, n, k, seed):
    x = _normal(seed, (m, k), dtype)
    gate, up = (_normal(seed + i, (k, n), dtype, 1 / np.sqrt(k)) for i in (1, 2))
    w = (gate, up) if weights_form == "pair" else jnp.stack([gate, up], axis=1)
    g = _normal(seed + 3, (m, n), dtype)
    fn = lambda x, w: ops.gated_linear_unit(x, w, activation=act, implementation="mosaic_gpu")  # noqa: E731
    out, pullback = jax.vjp(fn, x, w)
    grads = pullback(g)
    up32 = lambda t: jax.tree.map(lambda a: a.astype(jnp.float32), t)  # noqa: E731
    ref = lambda x, w: ops.gated_linear_unit(x, w, activation=act, implementation="xla")  # noqa: E731
    want, ref_pullback = jax.vjp(ref, up32(x), up32(w))
    want_grads = ref_pullback(up32(g))
    assert out.dtype == dtype
    assert_close(out, want, for_dtype(FORWARD, dtype), f"glu {weights_form}")
    for i, (got, exp) in enumerate(zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads))):
        assert got.dtype == dtype
        assert_close(got, exp, for_dtype(BACKWARD, dtype), f"glu {weights_form} grad {i}")


@pytest.mark.parametrize("form, act, dtype, n", [
    ("pair", "silu", jnp.bfloat16, 192),
    # N = 200 is no multiple of the 64-column epilogue tile: the stacked pre-activations are
    # stored as two arrays (stacked by XLA) instead of in place; gelu (tanh form).
    pytest.param("stacked", "gelu", jnp.float16, 200, marks=pytest.mark.slow),
    ("stacked", None, jnp.bfloat16, 192),
])
def test_gated_linear_unit_forward_and_gradients(form, act, dtype, n):
    """Two accumulators per consumer on a shared x tile (forward), the pair's dx with two
    products into one accumulator and (dgate, dup) with two, the stacked form's [M, 2N]
    views; 136 rows and K = 130 divide no tile, N = 192 leaves a consumer's columns past
    N (its stores skipped where the up half follows in the same array)."""
    _glu_grads(form, act, dtype, 136, n, 130, seed=20)


@pytest.mark.slow
def test_glu_backward_alone_on_mosaic_gpu():
    """ops.decoder.glu.glu_backward (the benchmarks' "bwd" pass) on the Mosaic GPU kernels."""
    from ops.decoder.glu import glu_backward
    from ops.decoder.reference import glu_preactivations
    m, n, k = 72, 128, 64
    x = _normal(30, (m, k), jnp.bfloat16)
    w = jnp.stack([_normal(31 + i, (k, n), jnp.bfloat16, 1 / np.sqrt(k)) for i in range(2)], axis=1)
    z = jnp.stack([a.astype(jnp.bfloat16) for a in glu_preactivations(x, w)], axis=1)
    g = _normal(33, (m, n), jnp.bfloat16)
    dx, dw = glu_backward(x, w, z, g, activation="silu", implementation="mosaic_gpu")
    want_dx, want_dw = glu_backward(x, w, z, g, activation="silu", implementation="xla")
    tol = for_dtype(BACKWARD, jnp.bfloat16)
    assert_close(dx, f64(want_dx), tol, "dx")
    assert_close(dw, f64(want_dw), tol, "dw")


# --- linear_cross_entropy ---------------------------------------------------------------------

@pytest.mark.parametrize("options, vocab_chunk", [
    (dict(logits_soft_cap=5.0, label_smoothing=0.1, z_loss=1e-3), None),
    # A full 256-column chunk in XLA's loop and a 74-column tail.
    pytest.param({}, 256, marks=pytest.mark.slow),
])
def test_linear_cross_entropy_forward_and_gradients(options, vocab_chunk):
    """Statistics by the row epilogue ([column blocks, N], merged by XLA), dz as the tile
    epilogue of the recomputed logits, dx / dw on the core; N = 136, D = 130, V = 330
    divide no tile (the last column block has 10 of its 64 columns inside V); an invalid label gives NaN."""
    n, d, v = 136, 130, 330
    x = _normal(40, (n, d), jnp.bfloat16)
    w = _normal(41, (d, v), jnp.bfloat16, 1 / np.sqrt(d))
    labels = jax.random.randint(jax.random.key(42), (n,), 0, v).at[3].set(v)
    fn = lambda x, w: ops.linear_cross_entropy(x, w, labels, implementation="mosaic_gpu",  # noqa: E731
                                               vocab_chunk=vocab_chunk, **options)
    ref = lambda x, w: ops.linear_cross_entropy(x, w, labels, implementation="xla", **options)  # noqa: E731
    g = _normal(43, (n,), jnp.bfloat16).at[3].set(0)
    out, pullback = jax.vjp(fn, x, w)
    dx, dw = pullback(g)
    want, ref_pullback = jax.vjp(ref, x.astype(jnp.float32), w.astype(jnp.float32))
    want_dx, want_dw = ref_pullback(g.astype(jnp.float32))
    assert np.isnan(f64(out)[3]) and np.isnan(f64(want)[3])
    keep = np.arange(n) != 3
    assert_close(f64(out)[keep], f64(want)[keep], for_dtype(FORWARD, jnp.bfloat16), "loss")
    tol = for_dtype(BACKWARD, jnp.bfloat16)
    assert_close(dx, f64(want_dx), tol, "dx")
    assert_close(dw, f64(want_dw), tol, "dw")


# --- ragged_dot ---------------------------------------------------------------------------------

@pytest.mark.parametrize("sizes, group_offset, dtype", [
    # Boundaries cut row tiles 0 and 1 (visited once per group, each storing its rows), an
    # empty group (no visit; its drhs stored as zeros), rows past the sum (zeros).
    ([70, 0, 90, 30], None, jnp.bfloat16),
    # Expert parallelism: this call owns groups 1..2 of 4 (the other rows zero).
    pytest.param([40, 50, 60, 40], 1, jnp.float16, marks=pytest.mark.slow),
])
def test_ragged_dot_forward_and_gradients(sizes, group_offset, dtype):
    m, k, n = 200, 130, 200
    g_local = len(sizes) if group_offset is None else 2
    lhs = _normal(50, (m, k), dtype)
    rhs = _normal(51, (g_local, k, n), dtype, 1 / np.sqrt(k))
    sizes = jnp.asarray(sizes, jnp.int32)
    offset = None if group_offset is None else jnp.int32(group_offset)
    g = _normal(52, (m, n), dtype)
    fn = lambda l, r: ops.ragged_dot(l, r, sizes, group_offset=offset,  # noqa: E731
                                     implementation="mosaic_gpu")
    ref = lambda l, r: ops.ragged_dot(l, r, sizes, group_offset=offset, precision="highest",  # noqa: E731
                                      implementation="xla")
    out, pullback = jax.vjp(fn, lhs, rhs)
    dlhs, drhs = pullback(g)
    want, ref_pullback = jax.vjp(ref, lhs.astype(jnp.float32), rhs.astype(jnp.float32))
    want_dlhs, want_drhs = ref_pullback(g.astype(jnp.float32))
    assert_close(out, f64(want), for_dtype(FORWARD, dtype), "ragged_dot")
    tol = for_dtype(BACKWARD, dtype)
    assert_close(dlhs, f64(want_dlhs), tol, "dlhs")
    assert_close(drhs, f64(want_drhs), tol, "drhs")


# --- the lease queue's Mosaic GPU experiments ----------------------------------------------

def test_queue_config_arms_reach_the_core():
    """Each mosaic_gpu config arm of benchmarks/lease_queue.json selects its block (the
    tuner's candidates the queue times), every one valid and among the candidates."""
    from benchmarks import lease_queue
    arms = [arm for e in lease_queue.load_queue() if e["name"].startswith("mosaic-gpu-matmul")
            for arm in e["arms"] if arm["implementation"] == "mosaic_gpu" and arm.get("config")]
    assert len(arms) >= 4
    op = _op.get("fused_matmul")
    for arm in arms:
        case = lease_queue.resolve_case(arm["case"], "gpu", quick=False)
        problem = op.problem(lease_queue.PROBLEM_DIMS["fused_matmul"](case.shape), case.dtype)
        with lease_queue.arm_settings(arm, case):
            chosen = op.select(problem, "mosaic_gpu")
        assert chosen == MosaicMatmulConfig(**arm["config"]["fields"]), arm["label"]
        chosen.check("queue")
        assert chosen in MosaicMatmulConfig.candidates(problem, _op.Device("mosaic_gpu"))
