"""layers.MoE / layers.linen.MoE against transformers' Mixtral block and a per-token loop.

* Mixtral's sparse MoE block (``MixtralSparseMoeBlock``, torch) with the same
  weights: outputs and the gradients of every parameter and of x (torch
  autograd), and ``load_balancing_loss_func`` over one and two layers' router
  logits against :func:`layers.moe.load_balancing_loss`, on ``xla`` and
  ``interpret``;
* softmax-then-top-k and the capacity factor against a per-token float64 loop
  (dropping later assignments past each expert's capacity);
* the Linen twin equals the NNX module on the same variables; bad arguments.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import layers
from layers.moe import collect_router_stats, load_balancing_loss
from tests.tolerances import BACKWARD, FORWARD, assert_close

D, H, E, K, T = 16, 24, 4, 2, 13  # T divides no tile


def _params(seed=0):
    rng = np.random.default_rng(seed)
    return dict(router=rng.normal(size=(D, E)).astype(np.float32),
                gate_up=(rng.normal(size=(E, D, 2 * H)) / 4).astype(np.float32),
                down=(rng.normal(size=(E, H, D)) / 5).astype(np.float32))


def _layer(p, **kw):
    m = layers.MoE(D, H, E, K, rngs=nnx.Rngs(0), **kw)
    m.router.kernel[...] = jnp.asarray(p["router"])
    m.gate_up_proj[...] = jnp.asarray(p["gate_up"])
    m.down_proj[...] = jnp.asarray(p["down"])
    return m


def loss_and_grads(layer, cot):
    """``(fn, params)``: ``fn(params, x)`` is the value and gradients (params, x) of
    ``sum(y * cot) + load-balancing loss``, with ``(y, loss)`` as aux."""
    graphdef, params = nnx.split(layer, nnx.Param)

    def f(params, x):
        m = nnx.merge(graphdef, params)
        y = m(x)
        aux = load_balancing_loss(collect_router_stats(nnx.pop(m, nnx.Intermediate)))
        return jnp.sum(y * cot) + aux, (y, aux)

    return jax.value_and_grad(f, argnums=(0, 1), has_aux=True), params


def _ours(m, x, cot):
    """Output, the load-balancing loss, and the gradients of sum(y * cot) + aux."""
    fn, params = loss_and_grads(m, cot)
    (_, (y, aux)), grads = jax.jit(fn)(params, x)
    return y, aux, grads


def _reference_loop(x, p, *, softmax_before_topk=False, capacity=None):
    """Per token, in float64: routing, each chosen expert's SwiGLU, the weighted sum."""
    x = np.asarray(x, np.float64)
    logits = x @ p["router"].astype(np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    if softmax_before_topk:
        idx = np.argsort(-probs, axis=-1, kind="stable")[:, :K]
        w = np.take_along_axis(probs, idx, -1)
    else:
        idx = np.argsort(-logits, axis=-1, kind="stable")[:, :K]
        top = np.take_along_axis(logits, idx, -1)
        w = np.exp(top - top.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
    taken = np.zeros(E, int)
    out = np.zeros((x.shape[0], D))
    for t in range(x.shape[0]):
        for s in range(K):
            e = idx[t, s]
            taken[e] += 1
            if capacity is not None and taken[e] > capacity:
                continue
            g = x[t] @ p["gate_up"][e].astype(np.float64)
            a = g[:H] / (1 + np.exp(-g[:H])) * g[H:]
            out[t] += w[t, s] * (a @ p["down"][e].astype(np.float64))
    return out


def _torch_block(p, tokens):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.models.mixtral import modeling_mixtral as mm
    cfg = transformers.MixtralConfig(hidden_size=D, intermediate_size=H, num_local_experts=E,
                                     num_experts_per_tok=K)
    block = mm.MixtralSparseMoeBlock(cfg).float().eval()
    with torch.no_grad():
        block.gate.weight.copy_(torch.from_numpy(p["router"].T.copy()))
        block.experts.gate_up_proj.copy_(torch.from_numpy(p["gate_up"].transpose(0, 2, 1).copy()))
        block.experts.down_proj.copy_(torch.from_numpy(p["down"].transpose(0, 2, 1).copy()))
    return torch, mm, block


@pytest.mark.parametrize("impl", [pytest.param("xla", marks=pytest.mark.slow), "interpret"])
def test_matches_transformers_mixtral_block(impl):
    p = _params()
    rng = np.random.default_rng(1)
    x = rng.normal(size=(1, T, D)).astype(np.float32)
    cot = rng.normal(size=(1, T, D)).astype(np.float32)
    torch, mm, block = _torch_block(p, T)
    xt = torch.from_numpy(x).requires_grad_()
    yt = block(xt)
    logits = torch.nn.functional.linear(xt.reshape(-1, D), block.gate.weight)
    aux_t = mm.load_balancing_loss_func((logits,), E, K)
    (torch.sum(yt * torch.from_numpy(cot)) + aux_t).backward()

    y, aux, (grads, dx) = _ours(_layer(p, implementation=impl), jnp.asarray(x), jnp.asarray(cot))
    assert_close(y, yt.detach().numpy(), FORWARD[jnp.float32], "output")
    np.testing.assert_allclose(float(aux), aux_t.item(), rtol=1e-6)
    assert_close(dx, xt.grad.numpy(), BACKWARD[jnp.float32], "dx")
    assert_close(grads["router"]["kernel"][...], block.gate.weight.grad.numpy().T,
                 BACKWARD[jnp.float32], "drouter")
    assert_close(grads["gate_up_proj"][...],
                 block.experts.gate_up_proj.grad.numpy().transpose(0, 2, 1),
                 BACKWARD[jnp.float32], "dgate_up")
    assert_close(grads["down_proj"][...], block.experts.down_proj.grad.numpy().transpose(0, 2, 1),
                 BACKWARD[jnp.float32], "ddown")


def test_load_balancing_loss_pools_layers_as_transformers():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers.models.mixtral import modeling_mixtral as mm

    from ops.moe.routing import route
    rng = np.random.default_rng(2)
    logits = [rng.normal(size=(T, E)).astype(np.float32) * s for s in (1.0, 3.0)]
    stats = [route(jnp.asarray(lg), K)[2] for lg in logits]
    want = mm.load_balancing_loss_func(tuple(torch.from_numpy(lg) for lg in logits), E, K)
    np.testing.assert_allclose(float(load_balancing_loss(stats)), float(want), rtol=1e-6)
    # Pooled over the layers, not the mean of per-layer losses (the two differ here).
    per_layer = np.mean([float(load_balancing_loss(s)) for s in stats])
    assert abs(per_layer - float(want)) > 1e-3
    # Balanced routing gives k: every expert a share k/E of assignments, mean probability 1/E.
    even = [route(jnp.zeros((E, E)).at[jnp.arange(E), jnp.arange(E)].set(1.0)
                  .at[jnp.arange(E), (jnp.arange(E) + 1) % E].set(1.0), K)[2]]
    np.testing.assert_allclose(float(load_balancing_loss(even)), K, rtol=1e-6)


@pytest.mark.parametrize("impl,kw", [
    ("xla", dict(softmax_before_topk=True)), ("xla", dict(capacity_factor=0.5)),
    ("xla", dict(capacity_factor=8.0)), ("interpret", dict(capacity_factor=0.5)),
    pytest.param("interpret", dict(softmax_before_topk=True), marks=pytest.mark.slow),
    pytest.param("interpret", dict(capacity_factor=8.0), marks=pytest.mark.slow)],
    ids=["xla-softmax_topk", "xla-cap0.5", "xla-cap8", "interpret-cap0.5",
         "interpret-softmax_topk", "interpret-cap8"])
def test_routing_options_match_per_token_loop(impl, kw):
    p = _params(3)
    x = np.random.default_rng(4).normal(size=(T, D)).astype(np.float32)
    capacity = None
    if "capacity_factor" in kw:
        capacity = int(np.ceil(kw["capacity_factor"] * T * K / E))
    want = _reference_loop(x, p, softmax_before_topk=kw.get("softmax_before_topk", False),
                           capacity=capacity)
    y = _layer(p, implementation=impl, **kw)(jnp.asarray(x))
    assert_close(y, want, FORWARD[jnp.float32], "output")
    if kw.get("capacity_factor") == 0.5:  # 4 rows per expert of 26 assignments: some dropped
        full = _reference_loop(x, p)
        assert np.abs(full - want).max() > 1e-2


def _x_and_params():
    return jnp.asarray(np.random.default_rng(6).normal(size=(2, 7, D)), jnp.float32), _params(5)


def test_linen_twin_equals_nnx_module():
    x, p = _x_and_params()
    want = _layer(p, implementation="xla")(x)
    twin = layers.linen.MoE(H, E, K, implementation="xla")
    variables = {"params": {"router": {"kernel": p["router"]}, "gate_up_proj": p["gate_up"],
                            "down_proj": p["down"]}}
    shapes = jax.tree.map(jnp.shape, twin.init(jax.random.key(0), x)["params"])
    assert shapes == jax.tree.map(jnp.shape, variables["params"])
    got, state = twin.apply(variables, x, mutable=["intermediates"])
    np.testing.assert_array_equal(got, want)
    (stats,) = state["intermediates"]["router_stats"]
    assert float(stats.tokens) == 14 and float(jnp.sum(stats.counts)) == 14 * K


@pytest.mark.slow
def test_bfloat16_on_kernels():
    x, p = _x_and_params()
    want = _layer(p, implementation="xla")(x)
    y16 = _layer(p, implementation="interpret", dtype=jnp.bfloat16)(x)
    assert y16.dtype == jnp.bfloat16
    assert_close(y16, want, FORWARD[jnp.bfloat16], "bfloat16 output")


def test_bad_arguments_name_themselves():
    rngs = nnx.Rngs(0)
    with pytest.raises(ValueError, match="num_experts_per_token=3 exceeds"):
        layers.MoE(D, H, 2, 3, rngs=rngs)
    with pytest.raises(ValueError, match="capacity_factor"):
        layers.MoE(D, H, E, K, capacity_factor=0, rngs=rngs)
    with pytest.raises(ValueError, match="num_experts"):
        layers.MoE(D, H, 0, 1, rngs=rngs)
    with pytest.raises(ValueError, match="token_axes"):
        layers.MoE(D, H, E, K, token_axes="data", rngs=rngs)
    with pytest.raises(ValueError, match="implementation"):
        layers.MoE(D, H, E, K, implementation="cuda", rngs=rngs)
    with pytest.raises(ValueError, match="num_experts_per_token"):
        layers.linen.MoE(H, E, 0)
    with pytest.raises(ValueError, match="in_features=16"):
        layers.MoE(D, H, E, K, rngs=rngs)(jnp.ones((3, 8)))
