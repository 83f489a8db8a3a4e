"""The kernels on a real GPU, ``pytest -m gpu`` (docs/design.md §7.6), skipped where there is none.

Every op runs through JAX's Pallas Triton lowering and through ours, on
shapes that do not divide the blocks (so edge blocks, and on pallas_triton
the edge-masked Refs, are exercised on hardware), against the float32 XLA
reference. Each test states the implementation's contract, as the CPU tests
do: where an implementation refuses a call by design (pallas_triton's
attention takes power-of-two head dims only: JAX's Triton lowering has no
padded blocks), the test expects that NotImplementedError, raised before
anything is traced. ``test_attention_contracts_hold_when_lowered_for_cuda``
checks those expectations without a GPU, lowering every attention case for
``cuda``.
"""
import functools

import jax
import jax.numpy as jnp
import pytest

import ops
from ops.matmul import reference
from tests.tolerances import BACKWARD, FORWARD, assert_close

gpu = pytest.mark.gpu
IMPLEMENTATIONS = ["pallas_triton", "triton"]
KEYS = jax.random.split(jax.random.key(0), 6)


def up(*arrays):
    return [a.astype(jnp.float32) for a in arrays]


@gpu
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_fused_matmul(impl, dtype):
    x = jax.random.normal(KEYS[0], (1000, 768), dtype)
    w = (jax.random.normal(KEYS[1], (768, 1537)) / 28).astype(dtype)
    b = jax.random.normal(KEYS[2], (1537,), dtype)
    act = ops.ACTIVATIONS["gelu_exact"]
    f = functools.partial(ops.fused_matmul, activation="gelu_exact", implementation=impl)
    assert_close(f(x, w, b), reference(*up(x, w, b), act), FORWARD[dtype])
    cot = jax.random.normal(KEYS[3], (1000, 1537))
    grads = jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32) * cot), (0, 1, 2))(x, w, b)
    want = jax.grad(lambda *a: jnp.sum(reference(*a, act) * cot), (0, 1, 2))(*up(x, w, b))
    for g, e in zip(grads, want):
        assert_close(g, e, BACKWARD[dtype])


ROW_OPS = {
    "layer_norm": (lambda x, **k: ops.layer_norm(x, **k), lambda x: ops.layer_norm(x, implementation="xla")),
    "rms_norm": (lambda x, **k: ops.rms_norm(x, **k), lambda x: ops.rms_norm(x, implementation="xla")),
    "softmax": (lambda x, **k: ops.softmax(x, **k), jax.nn.softmax),
    "logsumexp": (lambda x, **k: ops.logsumexp(x, axis=-1, **k), lambda x: jax.nn.logsumexp(x, axis=-1)),
    "sum": (lambda x, **k: ops.sum(x, axis=-1, **k), lambda x: jnp.sum(x, axis=-1)),
}


@gpu
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("name", sorted(ROW_OPS))
def test_row_ops(impl, name):
    ours, ref = ROW_OPS[name]
    x = jax.random.normal(KEYS[4], (1003, 5000), jnp.float32) * 2
    f = functools.partial(ours, implementation=impl)
    assert_close(f(x), ref(x), 1e-5)
    assert_close(jax.grad(lambda v: jnp.sum(jnp.sin(f(v))))(x),
                 jax.grad(lambda v: jnp.sum(jnp.sin(ref(v))))(x), 1e-4)


@gpu
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_cross_entropies(impl):
    logits = jax.random.normal(KEYS[5], (1003, 50257)) * 4
    labels = jax.random.randint(KEYS[0], (1003,), 0, 50257)
    assert_close(ops.cross_entropy(logits, labels, implementation=impl),
                 ops.cross_entropy(logits, labels, implementation="xla"), 1e-5)
    x = jax.random.normal(KEYS[1], (517, 256))
    w = jax.random.normal(KEYS[2], (256, 32003)) / 16
    lab = jax.random.randint(KEYS[3], (517,), 0, 32003)
    f = lambda x, w: ops.linear_cross_entropy(x, w, lab, implementation=impl).sum()
    r = lambda x, w: ops.linear_cross_entropy(x, w, lab, implementation="xla").sum()
    for g, e in zip(jax.grad(f, (0, 1))(x, w), jax.grad(r, (0, 1))(x, w)):
        assert_close(g, e, 1e-4)


ATTENTION_OPTIONS = {
    "causal_gqa": lambda b, t, s: dict(is_causal=True),
    "lengths_window_softcap": lambda b, t, s: dict(
        key_value_seq_lengths=jnp.array([s // 3, s], jnp.int32)[:b], local_window_size=(200, 17),
        logits_soft_cap=20.0),
    "bias_mask_dropout": lambda b, t, s: dict(
        bias=jax.random.normal(KEYS[0], (1, 8, t, s)), mask=jax.random.bernoulli(KEYS[1], 0.8, (b, 1, t, s)),
        dropout_rate=0.2, dropout_rng=jax.random.key(4)),
}


def attention_refusal(impl, head_dim):
    """The NotImplementedError message an implementation's contract gives for this head dim,
    or None where it takes the call: pallas_triton (JAX's Triton lowering) has no padded
    blocks, so the op refuses head dims that are not powers of two (``use 'triton'``)."""
    if impl == "pallas_triton" and head_dim & (head_dim - 1):
        return "power-of-two head dims"
    return None


def _attention_case(head_dim, option, dtype, b=2, t=1000, s=1537):
    kw = ATTENTION_OPTIONS[option](b, t, s)
    bias = kw.pop("bias", None)
    q = jax.random.normal(KEYS[2], (b, t, 8, head_dim), dtype)
    k = jax.random.normal(KEYS[3], (b, s, 2, head_dim), dtype)
    v = jax.random.normal(KEYS[4], (b, s, 2, head_dim), dtype)
    cot = jax.random.normal(KEYS[5], (b, t, 8, head_dim))
    args = (q, k, v) if bias is None else (q, k, v, bias)

    def loss(impl, *a):
        out = ops.dot_product_attention(*a[:3], *a[3:], implementation=impl, **kw)
        return jnp.sum(out.astype(jnp.float32) * cot)
    return args, kw, loss


@gpu
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("head_dim", [64, 96, 128])
@pytest.mark.parametrize("option", sorted(ATTENTION_OPTIONS))
def test_dot_product_attention(impl, dtype, head_dim, option):
    """Forward and q/k/v (and bias) gradients against the float32 reference, T and S not
    block multiples; where the implementation's contract refuses the head dim, its
    NotImplementedError (:func:`attention_refusal`)."""
    args, kw, loss = _attention_case(head_dim, option, dtype)
    refusal = attention_refusal(impl, head_dim)
    if refusal is not None:
        with pytest.raises(NotImplementedError, match=refusal):
            ops.dot_product_attention(*args, implementation=impl, **kw)
        return
    out = ops.dot_product_attention(*args, implementation=impl, **kw)
    assert_close(out, ops.dot_product_attention(*up(*args), implementation="xla", **kw), FORWARD[dtype])
    argnums = tuple(range(1, len(args) + 1))
    grads = jax.grad(loss, argnums)(impl, *args)
    want = jax.grad(loss, argnums)("xla", *up(*args))
    for g, e in zip(grads, want):
        assert_close(g, e, BACKWARD[dtype])


@pytest.mark.parametrize("head_dim", [64, 96, 128])
@pytest.mark.parametrize("option", sorted(ATTENTION_OPTIONS))
def test_attention_contracts_hold_when_lowered_for_cuda(head_dim, option):
    """No GPU needed: what test_dot_product_attention expects of pallas_triton is what the
    op does. Its forward and gradients lower for cuda through JAX's Pallas Triton lowering
    where the contract takes the call; elsewhere the op refuses it before building a kernel."""
    args, kw, loss = _attention_case(head_dim, option, jnp.bfloat16)
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
    grads = jax.grad(functools.partial(loss, "pallas_triton"), tuple(range(len(args))))
    refusal = attention_refusal("pallas_triton", head_dim)
    if refusal is not None:
        with pytest.raises(NotImplementedError, match=refusal):
            jax.eval_shape(grads, *specs)
        return
    text = jax.jit(grads).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("triton") >= 3  # the forward kernel and the backward's


@gpu
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_paged_attention_ops(impl, dtype):
    """Paged decode (splits, int8 pages with scales, sinks) and ragged attention, then the
    cache write, against the XLA references."""
    import numpy as np
    rng = np.random.default_rng(0)
    tol = 1e-5 if dtype == jnp.float32 else FORWARD[dtype]  # online softmax over 640 keys
    B, N, K, H, ps, pps = 5, 32, 4, 128, 16, 40
    P = B * pps
    q = jnp.asarray(rng.standard_normal((B, N, H)), dtype)
    kp, vp = (jnp.asarray(rng.standard_normal((K, P, ps, H)), dtype) for _ in range(2))
    tables = jnp.asarray(rng.permutation(P).reshape(B, pps), jnp.int32)
    lengths = jnp.asarray([0, 1, 300, 640, 17], jnp.int32)
    sinks = jnp.asarray(rng.standard_normal(N), jnp.float32)
    for kw in ({}, {"sinks": sinks, "local_window_size": 100, "logits_soft_cap": 20.0}):
        out = ops.paged_attention(q, kp, vp, tables, lengths, scale=H ** -0.5, implementation=impl,
                                  **kw)
        want = ops.paged_attention(*up(q, kp, vp), tables, lengths, scale=H ** -0.5,
                                   implementation="xla", **kw)
        assert_close(out, want, tol)
    i8 = [jnp.asarray(rng.integers(-127, 128, (K, P, ps, H)), jnp.int8) for _ in range(2)]
    scales = [jnp.asarray(rng.uniform(0.005, 0.02, (K, P, ps)), jnp.float32) for _ in range(2)]
    out = ops.paged_attention(q, *i8, tables, lengths, *scales, implementation=impl)
    # Both dequantize the pages to q's dtype (the rounding a bf16 kernel makes).
    assert_close(out, ops.paged_attention(q, *i8, tables, lengths, *scales, implementation="xla"),
                 tol)
    kv = jnp.asarray(rng.standard_normal((P, ps, 2 * K, H)), dtype)
    cu = jnp.asarray([0, 7, 8, 8, 40, 41], jnp.int32)
    meta = (jnp.asarray([300, 9, 0, 640, 1], jnp.int32), tables, cu, jnp.asarray([5], jnp.int32))
    q_tokens = jnp.asarray(rng.standard_normal((48, N, H)), dtype)
    out = ops.ragged_paged_attention(q_tokens, kv, *meta, sliding_window=128, implementation=impl)
    want = ops.ragged_paged_attention(*up(q_tokens, kv), *meta, sliding_window=128,
                                      implementation="xla")
    assert_close(out, want, tol)
    new = jnp.asarray(rng.standard_normal((6, K, H)), dtype)
    slots = jnp.asarray([0, 5, -1, 700, 3199, 16], jnp.int32)
    for cache in (kv, (kp, vp)):  # both layouts
        got = jax.jit(lambda *a: ops.update_kv_pages(*a, implementation=impl),
                      donate_argnums=0)(jax.tree.map(lambda x: x + 0, cache), new, new, slots)
        want = ops.update_kv_pages(cache, new, new, slots, implementation="xla")
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert_close(g, w, 0.0)
