"""Every op partitions over a device mesh (docs/design.md §5.6), on 8 fake CPU devices
(tests/conftest.py).

Each case runs one jitted function returning the op's output and its
gradients on sharded operands, and checks (against the XLA reference on one
device, float32 tolerances of tests/tolerances.py):

* the output and gradients equal the single-device values;
* the output sharding is what the op's rule says (ops._partitioning);
* the compiled HLO has no ``maximal`` sharding, no all-gather where the rule
  keeps every sharded dim local, and the collective the math needs where it
  needs one (``all-reduce`` for a split contraction, vocabulary or reduced axis).

Both sharding mechanisms are covered: explicit mesh axes (jax.make_mesh's
default; shard_map at trace time) and automatic ones (custom_partitioning
with a Shardy rule).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import ops
from tests.tolerances import BACKWARD, FORWARD, assert_close

EXPLICIT, AUTO = AxisType.Explicit, AxisType.Auto
TOL_F, TOL_B = FORWARD[jnp.float32], BACKWARD[jnp.float32]


def _mesh(mode):
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(mode, mode))


def _normal(i, shape, scale=1.0):
    return jax.random.normal(jax.random.key(i), shape, jnp.float32) * scale


def check(op, args, specs, *, mode, argnums, out_spec, gathers=False, collective=None):
    """``op(impl)`` is the function under test; ``args[i]`` is placed with ``specs[i]``."""
    mesh = _mesh(mode)
    cot = None

    def run(f):
        def loss(*a):
            return jnp.sum(f(*a).astype(jnp.float32) * cot)
        return lambda *a: (f(*a), jax.grad(loss, argnums)(*a))

    expected = op("xla")(*args)
    cot = _normal(99, expected.shape)
    want_out, want_grads = jax.jit(run(op("xla")))(*args)
    placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]
    compiled = jax.jit(run(op("interpret"))).lower(*placed).compile()
    out, grads = compiled(*placed)
    assert_close(out, want_out, TOL_F, "output")
    for i, (g, w) in enumerate(zip(grads, want_grads)):
        assert_close(g, w, TOL_B, f"gradient {argnums[i]}")
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, out_spec), out.ndim), out.sharding
    hlo = compiled.as_text()
    assert "maximal" not in hlo
    if not gathers:
        assert "all-gather" not in hlo, [ln for ln in hlo.splitlines() if "all-gather(" in ln]
    if collective:
        assert collective in hlo


@pytest.mark.parametrize("mode", [pytest.param(EXPLICIT, marks=pytest.mark.slow), AUTO],
                         ids=["explicit", "auto"])
def test_layer_norm_rows_sharded_run_locally(mode):
    # dscale / dbias sum over rows: one all-reduce; nothing gathered.
    x, scale, bias = _normal(0, (16, 6, 40)), 1 + _normal(1, (40,), 0.5), _normal(2, (40,))
    check(lambda impl: lambda x, s, b: ops.layer_norm(x, s, b, implementation=impl),
          (x, scale, bias), (P("data"), P(), P()), mode=mode, argnums=(0, 1, 2),
          out_spec=P("data"), collective="all-reduce")


def test_norm_with_sharded_features_gathers_them_and_stays_correct():
    # The kernel sees whole rows (a documented gather); the output returns to x's layout.
    x, scale = _normal(0, (16, 40)), 1 + _normal(1, (40,), 0.5)
    check(lambda impl: lambda x, s: ops.rms_norm(x, s, implementation=impl),
          (x, scale), (P("data", "model"), P("model")), mode=EXPLICIT, argnums=(0, 1),
          out_spec=P("data", "model"), gathers=True)


@pytest.mark.slow  # the row-wise rule is covered in CI by the norm tests
@pytest.mark.parametrize("name", ["cross_entropy", "softmax", "log_softmax", "logsumexp"])
def test_row_wise_ops_rows_sharded(name):
    x = _normal(0, (16, 6, 40), 3.0)
    labels = jax.random.randint(jax.random.key(5), (16, 6), 0, 40)

    def op(impl):
        if name == "cross_entropy":
            return lambda x: ops.cross_entropy(x, labels, implementation=impl)
        return lambda x: getattr(ops, name)(x, axis=-1, implementation=impl)

    rows = P(("data", "model"))
    check(op, (x,), (rows,), mode=EXPLICIT, argnums=(0,), out_spec=rows)


@pytest.mark.parametrize("kind, axis, out_spec", [
    ("max", -1, P("data")), pytest.param("sum", -1, P("data"), marks=pytest.mark.slow),
    pytest.param("mean", 0, P("model"), marks=pytest.mark.slow)])
def test_reductions_over_a_sharded_axis_end_in_a_collective(kind, axis, out_spec):
    x = _normal(3, (8, 64))
    check(lambda impl: lambda x: getattr(ops, kind)(x, axis, implementation=impl), (x,),
          (P("data", "model"),), mode=AUTO, argnums=(0,), out_spec=out_spec,
          collective="all-reduce")


@pytest.mark.parametrize("mode", [EXPLICIT, AUTO], ids=["explicit", "auto"])
def test_fused_matmul_megatron_mlp(mode):
    # Column-parallel w1 (gelu epilogue runs locally), row-parallel w2: its
    # contraction is split, so partial products + one all-reduce, then the bias.
    # Under automatic axes this compile once never ended from pytest's deep stack
    # (see ops._partitioning._partitioned_call: the kernels' source locations).
    x = _normal(0, (8, 6, 32))
    w1, b1 = _normal(1, (32, 48), 0.2), _normal(2, (48,))
    w2, b2 = _normal(3, (48, 32), 0.2), _normal(4, (32,))

    def op(impl):
        def mlp(x, w1, b1, w2, b2):
            h = ops.fused_matmul(x, w1, b1, activation="gelu", implementation=impl)
            return ops.fused_matmul(h, w2, b2, activation="tanh", implementation=impl)
        return mlp

    check(op, (x, w1, b1, w2, b2), (P("data"), P(None, "model"), P("model"), P("model"), P()),
          mode=mode, argnums=(0, 1, 2, 3, 4), out_spec=P("data"), collective="all-reduce")


def test_linear_cross_entropy_vocab_parallel_never_gathers_w():
    x, w = _normal(0, (4, 6, 32)), _normal(1, (32, 200), 0.25)
    labels = jax.random.randint(jax.random.key(2), (4, 6), 0, 200)
    check(lambda impl: lambda x, w: ops.linear_cross_entropy(x, w, labels, implementation=impl),
          (x, w), (P("data"), P(None, "model")), mode=AUTO, argnums=(0, 1),
          out_spec=P("data"), collective="all-reduce")


def test_attention_batch_and_gqa_heads_sharded():
    q = _normal(0, (4, 12, 4, 16))
    k, v = _normal(1, (4, 12, 2, 16)), _normal(2, (4, 12, 2, 16))
    bias = _normal(3, (1, 4, 12, 12))
    heads = P("data", None, "model")
    check(lambda impl: lambda q, k, v, b: ops.dot_product_attention(
              q, k, v, b, is_causal=True, implementation=impl),
          (q, k, v, bias), (heads, heads, heads, P(None, "model")), mode=EXPLICIT,
          argnums=(0, 1, 2, 3), out_spec=heads)


def test_ops_inside_shard_map_work_on_local_shards():
    # shard_map's default check_vma=True: x varies over "data", w over "model". The
    # interpreter types its kernels' values over both; a gradient whose primal varies
    # over fewer axes is summed over the others, as JAX's own ops do (the XLA run).
    mesh = _mesh(EXPLICIT)
    x, w = _normal(0, (16, 32)), _normal(1, (32, 24), 0.2)
    specs = (P("data"), P(None, "model"))

    def run(impl):
        def local(x, w):
            h = ops.fused_matmul(x, w, activation="relu", implementation=impl)
            return ops.layer_norm(h, implementation=impl)

        def both(x, w):
            return local(x, w), jax.grad(lambda x, w: jnp.sum(jnp.sin(local(x, w))), (0, 1))(x, w)
        return jax.jit(jax.shard_map(both, mesh=mesh, in_specs=specs,
                                     out_specs=(P("data", "model"), specs)))

    placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((x, w), specs)]
    got, (dx, dw) = run("interpret")(*placed)
    want, (want_dx, want_dw) = run("xla")(*placed)
    # Each device normalised its own 12-column block of h.
    h = ops.fused_matmul(x, w, activation="relu", implementation="xla")
    blocks = [ops.layer_norm(b, implementation="xla") for b in jnp.split(h, 2, axis=1)]
    assert_close(want, jnp.concatenate(blocks, axis=1), TOL_F, "per-block reference")
    assert_close(got, want, TOL_F, "shard_map")
    assert_close(dx, want_dx, TOL_B, "dx")
    assert_close(dw, want_dw, TOL_B, "dw")


def test_triton_partitions_over_explicit_axes():
    # Triton's CPU interpreter on the local blocks of each fake device (tiny shapes:
    # it runs every program in Python): values and gradients equal one device.
    mesh = _mesh(EXPLICIT)
    x, w = _normal(0, (16, 32)), _normal(1, (32, 16), 0.2)

    def f(x, w):
        return ops.layer_norm(ops.fused_matmul(x, w, activation="gelu", implementation="triton"),
                              implementation="triton")

    def both(x, w):
        return f(x, w), jax.grad(lambda x, w: jnp.sum(jnp.sin(f(x, w))), (0, 1))(x, w)

    want = jax.jit(both)(x, w)
    placed = [jax.device_put(a, NamedSharding(mesh, s))
              for a, s in zip((x, w), (P("data"), P(None, "model")))]
    got = jax.jit(both)(*placed)
    assert_close(got[0], want[0], TOL_F, "output")
    assert_close(got[1][0], want[1][0], TOL_B, "dx")
    assert_close(got[1][1], want[1][1], TOL_B, "dw")
    assert got[1][0].sharding.spec == P("data", None) and got[1][1].sharding.spec == P(None, "model")


def test_triton_on_cpu_under_automatic_axes_raises_a_clear_error():
    # Triton's CPU interpreter runs as a pure_callback, which JAX cannot put inside a
    # custom_partitioning body (the process crashed): a clear error instead.
    mesh = _mesh(AUTO)
    x = jax.device_put(_normal(0, (16, 32)), NamedSharding(mesh, P("data")))
    with pytest.raises(Exception, match="host callback"):
        jax.jit(lambda x: ops.layer_norm(x, implementation="triton"))(x)


def test_signature_rule_drops_axes_it_cannot_use():
    from ops._partitioning import Rule, _parse
    rule = Rule(op="t", operands=(_parse("m k"), _parse("k n")), results=(_parse("m n"),),
                sizes={"m": 8, "k": 6, "n": 4, "one": 1}, gather=frozenset(), reduce=frozenset())
    # k is absent from the result and not reduced: gathered. data (4) does not divide n on w.
    got = rule.assign({"data": 4, "model": 2}, [P("data", "model"), P(None, "data")])
    assert got == {"m": ("data",)}
    assert rule.result_specs(got) == (P("data", None),)
    np.testing.assert_equal(rule.operand_specs(got), (P("data", None), P(None, None)))


@pytest.mark.slow
def test_lm_mesh_run_matches_one_device(tmp_path):
    """``python -m benchmarks.lm --mesh data=4,model=2``: the data- and tensor-parallel
    curve equals the one-device ops curve (about 2 minutes on a 2-core host)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "lm.json"
    cmd = [sys.executable, "-m", "benchmarks.lm", "--steps", "4", "--width", "64", "--layers", "1",
           "--seq-len", "32", "--batch-size", "8", "--implementation", "interpret",
           "--no-learning-check", "--data-bytes", "300000", "--mesh", "data=4,model=2",
           "--json", str(out)]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    proc = subprocess.run(cmd, cwd=Path(__file__).resolve().parents[1], capture_output=True,
                          text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    mesh, one = np.array(result["mesh"]["losses"]), np.array(result["ops"]["losses"])
    assert mesh.shape == one.shape == (4,) and np.all(np.isfinite(mesh))
    assert np.max(np.abs(mesh - one)) <= 1e-4
