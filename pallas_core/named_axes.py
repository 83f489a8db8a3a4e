"""``lax.axis_index`` of a named grid axis inside a kernel.

With a named grid, ``grid=(("i", 4), ("j", 2))``, the kernel runs where the
axis names are bound (``pallas_core.call``), so ``lax.axis_size("i")`` is 4
and ``lax.axis_index("i")`` is this program's index along ``"i"``: the same as
``pl.program_id(0)``. Tracing leaves an ``axis_index`` equation in the
kernel's jaxpr, which nothing outside ``shard_map`` / ``vmap`` can evaluate.
Each backend replaces it by the program id: our Triton code generator writes
the id's expression; the interpreter rewrites the traced body with
:func:`without_axis_index` (JAX's own interpreter raises ``NameError`` there).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping

import jax
from jax import lax
from jax.extend import core as jex_core

from pallas_core import _jax_internals

AXIS_INDEX = "axis_index"


def _sub_jaxprs(eqn):
    return list(jex_core.jaxprs_in_params(eqn.params))


def uses_axis_index(jaxpr) -> bool:
    """Whether ``jaxpr`` (or a jaxpr inside one of its equations) asks for an axis index."""
    return _jax_internals.find_eqn(jaxpr, lambda e: e.primitive.name == AXIS_INDEX) is not None


def without_axis_index(closed: jex_core.ClosedJaxpr, axis_of: Mapping) -> jex_core.ClosedJaxpr:
    """``closed`` with each ``axis_index(name)`` replaced by its input ``axis_of[name]``.

    Args:
      closed: a jaxpr whose inputs include the program ids.
      axis_of: axis name -> position of that axis's program id among the inputs.

    Raises:
      NotImplementedError: an axis index inside a primitive this rewrite does not
        enter (anything but cond, while, scan and calls such as jit).
    """
    if not uses_axis_index(closed.jaxpr):
        return closed

    def run(*args):
        return _eval(closed.jaxpr, closed.consts, args, lambda name: args[axis_of[name]])

    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in closed.jaxpr.invars]
    return jax.make_jaxpr(run)(*avals)


def _eval(jaxpr, consts, args, index: Callable) -> list:
    """Evaluates ``jaxpr`` with ``index(name)`` for ``axis_index(name)``: the equations that
    do not need it are bound as they are, the others rebuilt through ``lax``."""
    env: dict = {}

    def read(v):
        return v.val if isinstance(v, jex_core.Literal) else env[v]

    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        if eqn.primitive.name == AXIS_INDEX:
            outs = [lax.convert_element_type(index(eqn.params["axis_name"]), eqn.outvars[0].aval.dtype)]
        elif any(uses_axis_index(j) for j in _sub_jaxprs(eqn)):
            outs = _rebuild(eqn, ins, index)
        else:
            outs = eqn.primitive.bind(*ins, **eqn.params)
            outs = outs if eqn.primitive.multiple_results else [outs]
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def _closed(j):
    """``(jaxpr, consts)`` of a ClosedJaxpr or an open Jaxpr."""
    return (j.jaxpr, j.consts) if hasattr(j, "consts") else (j, ())


def _rebuild(eqn, ins, index) -> list:
    p, name = eqn.params, eqn.primitive.name

    def call(j, values):
        return _eval(*_closed(j), list(values), index)

    if name == "cond":
        branches = [lambda *ops, b=b: call(b, ops) for b in p["branches"]]
        return list(lax.switch(ins[0], branches, *ins[1:]))
    if name == "while":
        nc, nb = p["cond_nconsts"], p["body_nconsts"]
        cc, bc, init = ins[:nc], ins[nc:nc + nb], ins[nc + nb:]
        return list(lax.while_loop(lambda c: call(p["cond_jaxpr"], [*cc, *c])[0],
                                   lambda c: call(p["body_jaxpr"], [*bc, *c]), list(init)))
    if name == "scan":
        nc, ncarry = _jax_internals.scan_sizes(p)
        consts, init, xs = ins[:nc], ins[nc:nc + ncarry], ins[nc + ncarry:]

        def step(carry, x):
            outs = call(p["jaxpr"], [*consts, *carry, *x])
            return outs[:ncarry], outs[ncarry:]

        carry, ys = lax.scan(step, list(init), list(xs), length=p["length"], reverse=p["reverse"],
                             unroll=p["unroll"])
        return [*carry, *ys]
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):  # jit, closed_call, custom_jvp/vjp, remat
        if key in p:
            return call(p[key], ins)
    raise NotImplementedError(f"lax.axis_index inside {name!r} is not supported in a kernel; "
                              "use pl.program_id there.")
