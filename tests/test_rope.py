"""ops.rope_frequencies and ops.apply_rotary_embedding.

Checked against transformers (its rope initialisers and the
``apply_rotary_pos_emb`` of Llama, GPT-NeoX (partial rotary) and GPT-J
(interleaved pairs), run in torch), against a float64 NumPy reference, and
the kernels' gradients against ``jax.grad`` of the XLA reference; the kernels
run on ``interpret`` and on ``triton`` (Triton's CPU interpreter) and lower for
``mosaic_tpu`` and ``pallas_triton`` from this host.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import ops
from ops.decoder.reference import rotary_embedding_reference
from tests.op_battery import BadInput, Case, OpBattery, OpSpec
from tests.op_test_case import weights_like
from tests.tolerances import FORWARD, assert_close

KERNELS = ("interpret", "triton")


# --------------------------------------------------------------------------
# References
# --------------------------------------------------------------------------

def numpy_rope(x, positions, inv_freq, interleaved=False, scaling=1.0):
    """float64 rotation of float32 angles (the float32 product every implementation forms)."""
    x = np.asarray(x, np.float64)
    angles = (np.asarray(positions).astype(np.float32)[..., None]
              * np.asarray(inv_freq, np.float32)).astype(np.float64)
    cos, sin = np.cos(angles)[..., None, :] * scaling, np.sin(angles)[..., None, :] * scaling
    r = 2 * angles.shape[-1]
    out = x.copy()
    i1 = np.arange(0, r, 2) if interleaved else np.arange(r // 2)
    i2 = i1 + 1 if interleaved else i1 + r // 2
    x1, x2 = x[..., i1], x[..., i2]
    out[..., i1] = x1 * cos - x2 * sin
    out[..., i2] = x2 * cos + x1 * sin
    return out


def _inputs(shape, rotary_dim, dtype, seed=0, max_position=5000, theta=10000.0, scaling=None):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
    positions = jnp.asarray(rng.integers(0, max_position, shape[:-2]), jnp.int32)
    inv_freq, attention_scaling = ops.rope_frequencies(rotary_dim, theta=theta, scaling=scaling)
    return x, positions, inv_freq, attention_scaling


# --------------------------------------------------------------------------
# rope_frequencies against transformers
# --------------------------------------------------------------------------

ROPE_TYPES = [
    ("default", 128, 10000.0, {"rope_type": "default"}, {}),
    ("linear", 64, 500000.0, {"rope_type": "linear", "factor": 4.0}, {}),
    ("dynamic", 128, 10000.0, {"rope_type": "dynamic", "factor": 2.0}, {"sequence_length": 5000}),
    ("dynamic_short", 64, 10000.0, {"rope_type": "dynamic", "factor": 2.0}, {"sequence_length": 100}),
    ("llama3", 128, 500000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, {}),
    ("yarn", 128, 1000000.0, {"rope_type": "yarn", "factor": 4.0,
                              "original_max_position_embeddings": 1024}, {}),
    ("yarn_mscale", 64, 10000.0, {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0,
                                  "mscale_all_dim": 0.707, "beta_fast": 16, "beta_slow": 2,
                                  "original_max_position_embeddings": 512}, {}),
    ("yarn_untruncated", 32, 10000.0, {"rope_type": "yarn", "factor": 8.0, "truncate": False,
                                       "original_max_position_embeddings": 512}, {}),
    ("partial_linear", 24, 10000.0, {"rope_type": "linear", "factor": 2.0}, {"partial": 0.25}),
]


def transformers_frequencies(head_dim, theta, params, *, sequence_length=None, partial=1.0):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    # Configuration and rope utilities only: importing a modeling module costs ~7 s.
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.configuration_llama import LlamaConfig

    rope_parameters = dict(params, rope_theta=theta)
    if partial != 1.0:
        rope_parameters["partial_rotary_factor"] = partial
    config = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                         max_position_embeddings=2048, rope_parameters=rope_parameters)
    kind = params["rope_type"]
    with torch.no_grad():
        if kind == "default":  # LlamaRotaryEmbedding.compute_default_rope_parameters' formula
            inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
            scaling = 1.0
        else:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[kind](config, None, seq_len=sequence_length)
    return inv_freq.numpy(), float(scaling)


def _ulps(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return int(np.abs(a.view(np.int32).astype(np.int64) - b.view(np.int32).astype(np.int64)).max())


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("name, head_dim, theta, params, extra", ROPE_TYPES,
                         ids=[c[0] for c in ROPE_TYPES])
def test_rope_frequencies_match_transformers(name, head_dim, theta, params, extra):
    partial = extra.get("partial", 1.0)
    seq = extra.get("sequence_length")
    want, want_scaling = transformers_frequencies(head_dim * int(1 / partial) if partial != 1 else head_dim,
                                                  theta, params, sequence_length=seq, partial=partial)
    scaling = dict(params)
    if params["rope_type"] in ("dynamic", "yarn"):
        scaling["max_position_embeddings"] = 2048
    if seq is not None:
        scaling["sequence_length"] = seq
    inv_freq, attention_scaling = ops.rope_frequencies(head_dim, theta=theta, scaling=scaling)
    assert inv_freq.dtype == jnp.float32 and inv_freq.shape == want.shape
    # float32 step by step as transformers computes it: at most one ulp apart (the power).
    assert _ulps(inv_freq, want) <= 1, (name, _ulps(inv_freq, want))
    assert attention_scaling == pytest.approx(want_scaling, rel=1e-12)


def test_rope_frequencies_default_is_the_roformer_formula():
    inv_freq, scaling = ops.rope_frequencies(8, theta=100.0)
    np.testing.assert_allclose(inv_freq, 100.0 ** (-np.arange(0, 8, 2) / 8), rtol=2e-7)
    assert scaling == 1.0
    same, _ = ops.rope_frequencies(8, theta=100.0, scaling={"type": "default", "rope_theta": 100.0})
    np.testing.assert_array_equal(same, inv_freq)
    # yarn without a factor takes max_position_embeddings / original_max_position_embeddings.
    implicit = ops.rope_frequencies(8, scaling={"rope_type": "yarn", "max_position_embeddings": 2048,
                                                "original_max_position_embeddings": 512})
    explicit = ops.rope_frequencies(8, scaling={"rope_type": "yarn", "factor": 4.0,
                                                "original_max_position_embeddings": 512})
    np.testing.assert_array_equal(implicit[0], explicit[0])
    assert implicit[1] == explicit[1] == pytest.approx(0.1 * np.log(4.0) + 1)


@pytest.mark.parametrize("kwargs, error, argument", [
    (dict(rotary_dim=7), ValueError, "rotary_dim"),
    (dict(rotary_dim=8.0), TypeError, "rotary_dim"),
    (dict(rotary_dim=8, theta=-1.0), ValueError, "theta"),
    (dict(rotary_dim=8, scaling="llama3"), TypeError, "scaling"),
    (dict(rotary_dim=8, scaling={"rope_type": "ntk"}), ValueError, "rope_type"),
    (dict(rotary_dim=8, scaling={"rope_type": "linear"}), ValueError, "factor"),
    (dict(rotary_dim=8, scaling={"rope_type": "linear", "factor": 0.0}), ValueError, "factor"),
    (dict(rotary_dim=8, scaling={"rope_type": "linear", "factor": 2.0, "beta_fast": 3}),
     ValueError, "beta_fast"),
    (dict(rotary_dim=8, scaling={"rope_type": "linear", "factor": 2.0, "rope_theta": 5.0}),
     ValueError, "rope_theta"),
    (dict(rotary_dim=8, scaling={"rope_type": "yarn", "original_max_position_embeddings": 64}),
     ValueError, "max_position_embeddings"),
    (dict(rotary_dim=8, scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                                 "high_freq_factor": 1.0, "original_max_position_embeddings": 64}),
     ValueError, "high_freq_factor"),
])
def test_rope_frequencies_bad_input(kwargs, error, argument):
    with pytest.raises(error, match=argument):
        ops.rope_frequencies(**kwargs)


# --------------------------------------------------------------------------
# apply_rotary_embedding: kernels against float64 and the XLA reference's gradients
# --------------------------------------------------------------------------

def _battery_inputs(rng, dtype, shape, rotary_dim, shared_positions=False):
    x = jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
    tokens = shape[-3:-2] if shared_positions else shape[:-2]
    positions = jnp.asarray(rng.integers(0, 5000, tokens), jnp.int32)
    return x, positions, ops.rope_frequencies(rotary_dim)[0]


def _battery_op(x, positions, inv_freq, **kwargs):
    return ops.apply_rotary_embedding(x, positions, inv_freq, **kwargs)


def _battery_reference(x, positions, inv_freq, **options):
    return rotary_embedding_reference(x, jnp.broadcast_to(positions, x.shape[:-2]), inv_freq,
                                      **options)


_X, _P, _F = jnp.zeros((4, 2, 8), jnp.float32), jnp.arange(4, dtype=jnp.int32), jnp.ones((4,), jnp.float32)

ROPE = OpSpec(
    name="apply_rotary_embedding", op=_battery_op, reference=_battery_reference,
    make_inputs=_battery_inputs,
    cases=[
        # Tokens and heads that divide no block; partial rotary with non-power-of-two
        # halves (GPT-NeoX-20B's 24 of 96); interleaved pairs; attention scaling. Every
        # case on triton (its interpreter compiles fast; the eager run uses it too), the
        # float32 ones on interpret as well.
        Case("tiny", dict(shape=(3, 2, 8), rotary_dim=8), implementations=KERNELS),  # the eager run
        Case("btnh_full", dict(shape=(2, 13, 3, 16), rotary_dim=16), implementations=KERNELS),
        Case("tnh_interleaved_partial", dict(shape=(13, 3, 20), rotary_dim=12),
             dict(interleaved=True), implementations=KERNELS),
        Case("btnh_partial_neox_scaled", dict(shape=(2, 5, 2, 96), rotary_dim=24),
             dict(attention_scaling=1.25)),
        Case("shared_positions_interleaved_scaled", dict(shape=(2, 11, 5, 8), rotary_dim=8,
                                                         shared_positions=True),
             dict(interleaved=True, attention_scaling=0.8)),
        Case("btnh_full_16bit", dict(shape=(2, 13, 3, 16), rotary_dim=16),
             dtypes=(jnp.bfloat16, jnp.float16)),
        Case("tnh_interleaved_partial_16bit", dict(shape=(13, 3, 20), rotary_dim=12),
             dict(interleaved=True), dtypes=(jnp.bfloat16,)),
    ],
    implementations=("triton",),
    bad_inputs=[
        BadInput("x_rank_2", (np.zeros((4, 8), np.float32), _P, _F), {}, ValueError, "x"),
        BadInput("x_int", (_X.astype(jnp.int32), _P, _F), {}, TypeError, "x"),
        BadInput("x_not_array", ("x", _P, _F), {}, TypeError, "x"),
        BadInput("positions_float", (_X, _P.astype(jnp.float32), _F), {}, TypeError, "positions"),
        BadInput("positions_length", (_X, jnp.arange(5), _F), {}, ValueError, "positions"),
        BadInput("inv_freq_int", (_X, _P, _F.astype(jnp.int32)), {}, TypeError, "inv_freq"),
        BadInput("rotary_dim_over_head_dim", (_X, _P, jnp.ones((5,))), {}, ValueError, "inv_freq"),
        BadInput("inv_freq_empty", (_X, _P, jnp.ones((0,))), {}, ValueError, "inv_freq"),
        BadInput("inv_freq_rank_2", (_X, _P, jnp.ones((2, 2))), {}, ValueError, "inv_freq"),
        BadInput("interleaved_int", (_X, _P, _F), {"interleaved": 1}, TypeError, "interleaved"),
        BadInput("scaling_array", (_X, _P, _F), {"attention_scaling": jnp.float32(1)}, TypeError,
                 "attention_scaling"),
        BadInput("scaling_nan", (_X, _P, _F), {"attention_scaling": float("nan")}, ValueError,
                 "attention_scaling"),
        BadInput("block_sizes", (_X, _P, _F), {"block_sizes": (8,)}, ValueError, "block_sizes"),
    ])


class TestApplyRotaryEmbedding(OpBattery):
    spec = ROPE


def test_kernels_match_float64_and_copy_the_pass_through():
    """Against the float64 NumPy rotation (not the float32 reference the battery uses),
    and the features past R copied bit for bit."""
    x, positions, inv_freq, _ = _inputs((2, 5, 2, 40), 24, jnp.bfloat16)
    for impl in KERNELS:
        out = ops.apply_rotary_embedding(x, positions, inv_freq, attention_scaling=1.25,
                                         implementation=impl)
        want = numpy_rope(np.asarray(x, np.float64), positions, inv_freq, scaling=1.25)
        assert_close(out, want, FORWARD[jnp.bfloat16], f"{impl} vs float64")
        np.testing.assert_array_equal(np.asarray(out[..., 24:]), np.asarray(x[..., 24:]))


def _loss_grad(fn, x):
    w = weights_like(x)
    return jax.grad(lambda x: jnp.sum(fn(x).astype(jnp.float32) * w))(x)


def test_gradient_is_the_inverse_rotation():
    """Rotations are orthogonal: the backward kernel undoes the forward one."""
    x, positions, inv_freq, _ = _inputs((9, 2, 16), 16, jnp.float32)
    rotate = lambda x: ops.apply_rotary_embedding(x, positions, inv_freq, implementation="interpret")
    back = jax.jit(lambda x: jax.vjp(rotate, x)[1](rotate(x))[0])(x)
    np.testing.assert_allclose(back, x, rtol=0, atol=2e-6)


def test_inv_freq_gradient_and_vmap():
    x, positions, inv_freq, _ = _inputs((7, 2, 8), 8, jnp.float32, max_position=30)

    def loss(f, impl):
        y = ops.apply_rotary_embedding(x, positions, f, implementation=impl)
        return jnp.sum(y * weights_like(y))

    grads = [jax.jit(jax.grad(loss), static_argnums=1)(inv_freq, impl) for impl in ("interpret", "xla")]
    assert_close(grads[0], grads[1], 1e-5, "dfreq")
    batch = jnp.stack([x, 2 * x])
    got = jax.jit(jax.vmap(lambda x: ops.apply_rotary_embedding(x, positions, inv_freq,
                                                                 implementation="interpret")))(batch)
    assert_close(got, numpy_rope(np.asarray(batch), positions, inv_freq), 2e-6, "vmap")


@settings(max_examples=3, deadline=None)
@given(tokens=st.integers(1, 40), heads=st.integers(1, 6), half=st.integers(1, 12),
       extra=st.integers(0, 9), interleaved=st.booleans())
def test_apply_rotary_embedding_any_shape(tokens, heads, half, extra, interleaved):
    x, positions, inv_freq, _ = _inputs((tokens, heads, 2 * half + extra), 2 * half, jnp.float32,
                                        seed=tokens * 7 + heads)
    out = ops.apply_rotary_embedding(x, positions, inv_freq, interleaved=interleaved,
                                     implementation="triton")
    assert_close(out, numpy_rope(x, positions, inv_freq, interleaved), FORWARD[jnp.float32], "out")


# --------------------------------------------------------------------------
# Against transformers' apply_rotary_pos_emb (torch)
# --------------------------------------------------------------------------

def _torch():
    return pytest.importorskip("torch")


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("dtype", [jnp.float32, pytest.param(jnp.bfloat16, marks=pytest.mark.slow)])
def test_matches_transformers_llama_yarn(dtype):
    """Llama's rotary module with yarn scaling (attention_scaling != 1), x as [B, T, N, H]."""
    torch = _torch()
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama import modeling_llama

    head_dim, theta = 32, 10000.0
    params = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
              "rope_theta": theta}
    config = transformers.LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                                      max_position_embeddings=1024, rope_parameters=params)
    x, positions, _, _ = _inputs((2, 9, 3, head_dim), head_dim, dtype, max_position=1024)
    inv_freq, scaling = ops.rope_frequencies(head_dim, theta=theta, scaling=params)
    assert scaling > 1
    torch_dtype = {jnp.dtype(jnp.float32): torch.float32, jnp.dtype(jnp.bfloat16): torch.bfloat16}[x.dtype]
    q = torch.from_numpy(np.asarray(x, np.float32)).to(torch_dtype).transpose(1, 2)  # [B, N, T, H]
    with torch.no_grad():
        rotary = modeling_llama.LlamaRotaryEmbedding(config)
        cos, sin = rotary(q, torch.from_numpy(np.asarray(positions, np.int64)))
        want, _ = modeling_llama.apply_rotary_pos_emb(q, q, cos, sin)
    want = want.transpose(1, 2).float().numpy()
    for impl in ("xla", "triton"):
        got = ops.apply_rotary_embedding(x, positions, inv_freq, attention_scaling=scaling,
                                         implementation=impl)
        # float32: rounding only. bfloat16: transformers rounds cos, sin and each
        # product to bfloat16, we only the result: a few bfloat16 ulps apart.
        assert_close(got, want, 4e-6 if dtype == jnp.float32 else 3e-2, f"{impl} vs transformers")


@pytest.mark.filterwarnings("ignore")
def test_matches_transformers_neox_partial_and_gptj_interleaved():
    torch = _torch()
    pytest.importorskip("transformers")
    from transformers.models.gpt_neox import modeling_gpt_neox
    from transformers.models.gptj import modeling_gptj

    x, positions, _, _ = _inputs((2, 7, 3, 40), 16, jnp.float32, max_position=64)
    inv_freq, _ = ops.rope_frequencies(16)
    tx = torch.from_numpy(np.asarray(x))
    freqs = torch.from_numpy(np.asarray(positions, np.int64)).float()[..., None] * torch.from_numpy(
        np.asarray(inv_freq))
    emb = torch.cat((freqs, freqs), dim=-1)
    with torch.no_grad():
        neox, _ = modeling_gpt_neox.apply_rotary_pos_emb(tx, tx, emb.cos(), emb.sin(), unsqueeze_dim=2)
        gptj = modeling_gptj.apply_rotary_pos_emb(tx[..., :16], freqs.sin(), freqs.cos())
    gptj = torch.cat([gptj, tx[..., 16:]], dim=-1)
    for impl in KERNELS:
        got = ops.apply_rotary_embedding(x, positions, inv_freq, implementation=impl)
        assert_close(got, neox.numpy(), 4e-6, f"{impl} vs GPT-NeoX")
        got = ops.apply_rotary_embedding(x, positions, inv_freq, interleaved=True, implementation=impl)
        assert_close(got, gptj.numpy(), 4e-6, f"{impl} vs GPT-J")


# --------------------------------------------------------------------------
# Bad input, other backends, partitioning
# --------------------------------------------------------------------------

def test_pallas_triton_refuses_padded_blocks_and_falls_back():
    x, positions, inv_freq, _ = _inputs((5, 2, 20), 12, jnp.float32)
    with pytest.raises(NotImplementedError, match="power-of-two"):
        ops.apply_rotary_embedding(x, positions, inv_freq, implementation="pallas_triton")
    got = ops.apply_rotary_embedding(x, positions, inv_freq, implementation=("pallas_triton", "interpret"))
    assert_close(got, numpy_rope(x, positions, inv_freq), 2e-6, "fallback")


PLATFORMS = {"mosaic_tpu": ("tpu", "tpu_custom_call"), "pallas_triton": ("cuda", "__gpu$xla.gpu.triton")}


@pytest.mark.parametrize("impl", list(PLATFORMS))
@pytest.mark.parametrize("interleaved, head_dim, rotary_dim", [(False, 128, 128), (True, 64, 32)])
def test_forward_and_backward_lower_for_other_platforms(impl, interleaved, head_dim, rotary_dim):
    platform, marker = PLATFORMS[impl]

    def grads(x, positions, inv_freq):
        def f(x):
            return ops.apply_rotary_embedding(x, positions, inv_freq, interleaved=interleaved,
                                              implementation=impl)
        return f(x), _loss_grad(f, x)

    args = (jax.ShapeDtypeStruct((2, 64, 4, head_dim), jnp.bfloat16),
            jax.ShapeDtypeStruct((2, 64), jnp.int32), jax.ShapeDtypeStruct((rotary_dim // 2,), jnp.float32))
    text = jax.jit(grads).trace(*args).lower(lowering_platforms=(platform,)).as_text()
    assert text.count(marker) >= 2  # the forward and the backward kernel


@pytest.mark.parametrize("mode", [pytest.param("explicit", marks=pytest.mark.slow), "auto"])
def test_tokens_and_heads_sharded_run_locally(mode):
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    axis_type = AxisType.Explicit if mode == "explicit" else AxisType.Auto
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_type,) * 2)
    x, positions, inv_freq, _ = _inputs((4, 6, 2, 16), 16, jnp.float32)
    w = weights_like(x)

    def run(impl):
        def f(x):
            return ops.apply_rotary_embedding(x, positions, inv_freq, implementation=impl)
        return lambda x: (f(x), jax.grad(lambda x: jnp.sum(f(x) * w))(x))

    want = jax.jit(run("xla"))(x)
    placed = jax.device_put(x, NamedSharding(mesh, P("data", None, "model")))
    positions = jax.device_put(positions, NamedSharding(mesh, P("data")))
    compiled = jax.jit(run("interpret")).lower(placed).compile()
    out, grad = compiled(placed)
    assert_close(out, want[0], 2e-6, "out")
    assert_close(grad, want[1], 2e-6, "dx")
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, P("data", None, "model")), 4)
    hlo = compiled.as_text()
    assert "all-gather" not in hlo and "maximal" not in hlo
