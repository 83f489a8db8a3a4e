"""What pallas_core reads from JAX's jaxprs in the form JAX 0.10.2 gives and in the
form JAX 0.11 gives (docs/pallas_core.md section 15): the tests run on the installed
JAX and, where they can, build the other version's form by hand."""
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import pallas_core as pl
from pallas_core import _jax_internals

REPO = pathlib.Path(__file__).resolve().parents[1]
# What ``jax.core`` still exports in JAX 0.11 (it removed its other deprecated names,
# e.g. jaxprs_in_params and new_jaxpr_eqn, which live on in jax.extend.core).
JAX_CORE_IN_0_11 = {"AbstractValue", "Atom", "ParamDict", "ShapedArray", "Trace", "Tracer", "Value",
                    "ensure_compile_time_eval", "eval_context", "eval_jaxpr", "max_dim", "min_dim"}


def _scan_eqn(jaxpr):
    return next(e for e in jaxpr.eqns if e.primitive.name == "scan")


def test_scan_sizes_of_a_traced_scan():
    w = np.arange(3, dtype=np.float32)  # a closed-over array: one const of the scan

    def f(c0, c1, xs):
        def step(carry, x):
            a, b = carry
            return (a + x * w, b * 2), a.sum()
        return lax.scan(step, (c0, c1), xs)

    jaxpr = jax.make_jaxpr(f)(np.zeros(3, np.float32), np.float32(1), np.ones((4, 3), np.float32))
    eqn = _scan_eqn(jaxpr.jaxpr)
    consts, carry = _jax_internals.scan_sizes(eqn.params)
    assert (consts, carry) == (len(eqn.invars) - 3, 2)


class _Groups:
    """Stands in for JAX 0.11's ``ft_in``: the scan operands' groups (consts, carry, xs)."""

    def __init__(self, *sizes):
        self.sizes = sizes

    def unpack(self):
        return [list(range(n)) for n in self.sizes]


def test_scan_sizes_of_jax_0_11_params():
    params = dict(ft_in=_Groups(2, 3, 1), jaxpr=None, length=4, reverse=False, unroll=1)
    assert _jax_internals.scan_sizes(params) == (2, 3)


def test_axis_index_inside_a_scan_with_consts():
    """The interpreter rewrites ``lax.axis_index`` inside a scan (its consts and carry
    counts read through ``scan_sizes``)."""
    x = np.arange(3 * 8, dtype=np.float32).reshape(3, 8)

    def kernel(x_ref, o_ref):
        row = x_ref[...]

        def step(c, _):
            return c + row * lax.axis_index("i").astype(jnp.float32), None

        o_ref[...] = lax.scan(step, jnp.zeros_like(row), None, length=2)[0]

    out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                         in_specs=[pl.BlockSpec((None, 8), lambda i: (i, 0))],
                         out_specs=pl.BlockSpec((None, 8), lambda i: (i, 0)),
                         grid=(("i", 3),), interpret=True)(x)
    np.testing.assert_array_equal(out, x * 2 * np.arange(3, dtype=np.float32)[:, None])


def test_only_names_jax_core_keeps_in_0_11():
    """``jax.core`` attributes the code uses: only those JAX 0.11 still exports."""
    used = set()
    for folder in ("pallas_core", "ops", "layers", "benchmarks", "tests"):
        for path in (REPO / folder).rglob("*.py"):
            text = path.read_text()
            used |= {(str(path.relative_to(REPO)), n) for n in re.findall(r"\bjax\.core\.(\w+)", text)}
            used |= {(str(path.relative_to(REPO)), n.strip())
                     for names in re.findall(r"from jax\.core import ([\w, ]+)", text)
                     for n in names.split(",")}
    assert used, "the search found nothing: is the pattern right?"
    assert sorted((p, n) for p, n in used if n not in JAX_CORE_IN_0_11) == []


def test_a_called_jaxpr_under_either_name(monkeypatch):
    """JAX 0.10 and 0.11.0 stage a call of a jaxpr as ``closed_call``, later JAX as
    ``eval_jaxpr`` (same ``call_jaxpr`` param): the Triton source is the same."""
    from jax._src.lax.eval_jaxpr import eval_jaxpr_p  # staged as closed_call here
    from jax.extend import core as jex_core
    from pallas_core.triton import codegen

    inner = jax.make_jaxpr(lambda v: jnp.sin(v) * 2)(jax.ShapeDtypeStruct((8, 128), jnp.float32))

    def kernel(x_ref, o_ref):
        try:
            (o_ref[...],) = eval_jaxpr_p.bind(x_ref[...], jaxpr=inner)
        except TypeError:  # JAX after 0.11.0 names the param call_jaxpr
            (o_ref[...],) = eval_jaxpr_p.bind(x_ref[...], call_jaxpr=inner)

    def f(x):
        return pl.pallas_call(kernel, out_shape=x, backend="triton")(x)

    x = jax.ShapeDtypeStruct((8, 128), jnp.float32)
    (as_closed_call,) = pl.triton.source(f, x)
    assert "tl.sin" in as_closed_call
    renamed = jex_core.Primitive("eval_jaxpr")
    renamed.multiple_results = True
    traced = codegen.trace_kernel

    def with_eval_jaxpr(call):
        closed = traced(call)
        eqns = [e.replace(primitive=renamed) if e.primitive.name == "closed_call" else e
                for e in closed.jaxpr.eqns]
        assert any(e.primitive.name == "eval_jaxpr" for e in eqns), "the kernel calls no jaxpr"
        return closed.replace(jaxpr=closed.jaxpr.replace(eqns=eqns))

    monkeypatch.setattr(codegen, "trace_kernel", with_eval_jaxpr)
    assert pl.triton.source(f, x) == [as_closed_call]
