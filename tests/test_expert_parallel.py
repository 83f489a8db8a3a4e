"""Expert parallelism (ops/moe/expert_parallel.py, layers.MoE(expert_axis=...)) on 8 fake CPU devices
(tests/conftest.py).

* the exchange: ``ragged_exchange(method="dense")`` (the emulation XLA:CPU runs) against a
  numpy transcription of ``jax.lax.ragged_all_to_all``'s documented semantics, several slices
  per device with gaps in the output; the ``"ragged"`` method lowers to the real collective;
* ``layers.MoE`` with its experts sharded over an ``expert`` axis (8 devices; and 4 with tokens
  also sharded over a 2-way ``data`` axis) against the same layer on one device: outputs, the
  load-balancing loss and the gradients of x and every parameter; the compiled HLO gathers no
  floating-point array (the experts' weights stay where they are: the only all-gather is the
  int32 per-expert counts) and the weights' gradients keep the experts' sharding.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import layers
from ops.moe.expert_parallel import ragged_exchange
from tests.test_moe_layer import loss_and_grads
from tests.tolerances import BACKWARD, FORWARD, assert_close

D, H, E, K = 16, 24, 8, 2


def _simulate(operand, output, in_off, send, out_off, recv):
    """``ragged_all_to_all`` as its docstring defines it, on per-device numpy arrays."""
    devices, slices = send.shape
    per = slices // devices
    result = output.copy()
    for src in range(devices):
        for i in range(slices):
            dst = i // per
            chunk = operand[src, in_off[src, i]:in_off[src, i] + send[src, i]]
            result[dst, out_off[src, i]:out_off[src, i] + len(chunk)] = chunk
            assert recv[dst, src * per + i % per] == len(chunk)
    return result


def test_dense_exchange_matches_ragged_all_to_all_semantics():
    devices, per, n, m = 8, 2, 48, 56
    rng = np.random.default_rng(0)
    send = rng.integers(0, 3, size=(devices, devices * per)).astype(np.int32)
    in_off = np.zeros_like(send)
    for s in range(devices):  # slices anywhere in the operand, in a shuffled order
        order = rng.permutation(devices * per)
        pos = 0
        for i in order:
            in_off[s, i] = pos
            pos += send[s, i] + rng.integers(0, 2)  # at most 3 rows per slice: < n
    recv = np.zeros_like(send)
    out_off = np.zeros_like(send)
    for dst in range(devices):  # receivers place each (source, slice) with a gap after it
        pos = 1
        for src in range(devices):
            for j in range(per):
                i = dst * per + j
                recv[dst, src * per + j] = send[src, i]
                out_off[src, i] = pos
                pos += send[src, i] + 1
    operand = rng.normal(size=(devices, n, 3)).astype(np.float32)
    output = np.full((devices, m, 3), -1.0, np.float32)
    want = _simulate(operand, output, in_off, send, out_off, recv)

    mesh = jax.make_mesh((devices,), ("x",), axis_types=(AxisType.Auto,))
    spec = P("x")

    def per_device(op, out, a, b, c, d):
        return ragged_exchange(op[0], out[0], a[0], b[0], c[0], d[0], axis_name="x",
                               method="dense")[None]

    run = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(spec,) * 6, out_specs=spec))
    got = run(operand, output, in_off, send, out_off, recv)
    np.testing.assert_array_equal(np.asarray(got), want)
    ragged = jax.jit(jax.shard_map(
        lambda *a: ragged_exchange(*(v[0] for v in a), axis_name="x", method="ragged")[None],
        mesh=mesh, in_specs=(spec,) * 6, out_specs=spec))
    assert "ragged_all_to_all" in ragged.lower(operand, output, in_off, send, out_off,
                                               recv).as_text()


def _weights(seed=0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(D, E)).astype(np.float32),
            (rng.normal(size=(E, D, 2 * H)) / 4).astype(np.float32),
            (rng.normal(size=(E, H, D)) / 5).astype(np.float32))


def _grads_fn(make_layer, weights, cot):
    layer = make_layer()
    layer.router.kernel[...], layer.gate_up_proj[...], layer.down_proj[...] = map(jnp.asarray,
                                                                                weights)
    return loss_and_grads(layer, cot)


@pytest.mark.parametrize("impl,shape,names", [
    pytest.param("xla", (8,), ("expert",), marks=pytest.mark.slow),
    ("interpret", (2, 4), ("data", "expert"))], ids=["xla-8", "interpret-2x4"])
def test_experts_sharded_over_devices_match_one_device(impl, shape, names):
    weights = _weights()
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(8, 5, D)), jnp.float32)  # 40 tokens, 5 per device
    cot = jnp.asarray(rng.normal(size=x.shape), jnp.float32)
    one, params = _grads_fn(lambda: layers.MoE(D, H, E, K, implementation=impl,
                                               rngs=nnx.Rngs(0)), weights, cot)
    (_, (want_y, want_aux)), (want_p, want_dx) = jax.jit(one)(params, x)

    mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(shape))
    token_axes = names if len(names) > 1 else None
    sharded, params = _grads_fn(
        lambda: layers.MoE(D, H, E, K, expert_axis="expert", token_axes=token_axes,
                           implementation=impl, rngs=nnx.Rngs(0)), weights, cot)
    with jax.set_mesh(mesh):
        put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
        params = jax.tree.map(lambda a: put(a, P("expert") if a.ndim == 3 else P()), params)
        xs = put(x, P(names))
        fn = jax.jit(sharded)
        (_, (y, aux)), (grads, dx) = fn(params, xs)
        hlo = fn.lower(params, xs).compile().as_text()
    assert_close(y, want_y, FORWARD[jnp.float32], "output")
    np.testing.assert_allclose(float(aux), float(want_aux), rtol=1e-6)
    assert_close(dx, want_dx, BACKWARD[jnp.float32], "dx")
    for name in ("gate_up_proj", "down_proj"):
        assert_close(grads[name][...], want_p[name][...], BACKWARD[jnp.float32], name)
        assert grads[name][...].sharding.spec[0] == "expert"
    assert_close(grads["router"]["kernel"][...], want_p["router"]["kernel"][...],
                 BACKWARD[jnp.float32], "router")
    gathers = [ln for ln in hlo.splitlines() if " all-gather(" in ln]
    assert gathers and all(ln.split("=")[1].split()[0].startswith("s32") for ln in gathers), gathers
    assert "all-to-all" in hlo


def test_expert_axis_errors():
    layer = layers.MoE(D, H, E, K, expert_axis="expert", rngs=nnx.Rngs(0))
    x = jnp.ones((8, D))
    with pytest.raises(ValueError, match="jax.set_mesh"):
        layer(x)
    with jax.set_mesh(jax.make_mesh((8,), ("expert",), axis_types=(AxisType.Explicit,))):
        with pytest.raises(ValueError, match="divide evenly"):
            layer(jnp.ones((12, D)))
    with pytest.raises(NotImplementedError, match="capacity_factor"):
        with jax.set_mesh(jax.make_mesh((8,), ("expert",), axis_types=(AxisType.Explicit,))):
            layers.MoE(D, H, E, K, expert_axis="expert", capacity_factor=1.0,
                       rngs=nnx.Rngs(0))(x)
