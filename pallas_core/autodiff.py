"""Forward-mode autodiff of a ``pallas_call``: the JVP is itself a kernel (docs/pallas_core.md section 10).

``jax.jvp`` of a call runs one kernel over the same grid that computes primal
and tangent outputs together. Its operands are the primal inputs followed by
the tangents of the inputs that have one; its outputs are the primal outputs
followed by their tangents. Every tangent has the BlockSpec of its primal
(the mappings are duplicated), so it is blocked, revisited and cropped
exactly as the primal is. The kernel body is JAX's own JVP of the kernel's
jaxpr over Refs: a read of an input Ref also reads its tangent Ref, a write
to an output Ref also writes the tangent (``_jax_internals``). Float scratch
buffers get tangent scratch too, so kernels that accumulate in scratch are
differentiated. Being a kernel, the JVP runs on every backend, and it is
differentiable again (second-order forward mode gives the JVP of the JVP).
``jax.jacfwd`` fails as it does on JAX's Pallas: under its vmap the JVP
kernel's primal outputs come out batched along with the tangents.

Integer and boolean operands have no tangent (their tangents are float0
zeros), and integer outputs get float0 zero tangents.

Reverse mode (``jax.grad``, ``jax.vjp``, ``jax.linearize``) is refused with a
TypeError that points to ``jax.custom_vjp``: JAX would have to transpose the
JVP kernel, which mixes primal and tangent work and is not a linear function
JAX can see into, so JAX's own Pallas refuses it too (with a less direct
message). Every op in ``ops/`` supplies its own backward kernels.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pallas_core import _jax_internals, backends


def _has_tangent(dtype) -> bool:
    """Floating and complex buffers have tangents (not ints, bools or semaphores)."""
    try:
        return bool(jnp.issubdtype(dtype, jnp.inexact))
    except TypeError:  # a dtype numpy does not know, such as a semaphore's
        return False


def _is_zero(tangent) -> bool:
    return isinstance(tangent, jax.custom_derivatives.SymbolicZero)


def run(call, args):
    """``backends.run(call, args)``, differentiable in forward mode (see the module doc)."""

    @jax.custom_jvp
    def apply(*operands):
        return tuple(backends.run(call, list(operands)))

    def rule(primals, tangents):
        if any(_jax_internals.is_being_linearized(t) for t in tangents):
            raise TypeError(
                f"pallas_call (kernel {call.name}) is not differentiable in reverse mode (jax.grad, "
                "jax.vjp, jax.linearize): its JVP is a "
                "kernel computing primal and tangent outputs together, which JAX cannot "
                "transpose. Wrap the call in jax.custom_vjp and supply a backward pass (every "
                "op in `ops` does); jax.jvp works on a raw pallas_call.")
        aliased_inputs = set(call.input_output_aliases)
        with_tangent = [
            _has_tangent(m.dtype) and (not _is_zero(t) or i in aliased_inputs)
            for i, (m, t) in enumerate(zip(call.in_mappings, tangents))]
        tangents_in = [jnp.zeros(p.shape, p.dtype) if _is_zero(t) else t
                       for p, t, keep in zip(primals, tangents, with_tangent) if keep]
        jvp = jvp_call(call, with_tangent)
        outs = run(jvp, [*primals, *tangents_in])
        n_out = len(call.out_mappings)
        primal_outs, tangent_outs = iter(outs[:n_out]), iter(outs[n_out:])
        primal_outs = list(primal_outs)
        tangent_outs = [next(tangent_outs) if _has_tangent(m.dtype)
                        else np.zeros(m.array_shape, jax.dtypes.float0)
                        for m in call.out_mappings]
        return tuple(primal_outs), tuple(tangent_outs)

    apply.defjvp(rule, symbolic_zeros=True)
    return list(apply(*args))


def jvp_call(call, with_tangent):
    """The resolved call of the JVP kernel of ``call``.

    Args:
      call: a ``pallas_core.call.ResolvedCall``.
      with_tangent: per input, whether a tangent operand follows the primals.
    """
    outs_t = [_has_tangent(m.dtype) for m in call.out_mappings]
    scratch_t = [_has_tangent(s.dtype) for s in call.scratch_shapes]
    tangent = lambda m: dataclasses.replace(m, origin=f"{m.origin} (tangent)")
    in_maps = call.in_mappings + tuple(tangent(m) for m, t in zip(call.in_mappings, with_tangent) if t)
    out_maps = call.out_mappings + tuple(tangent(m) for m, t in zip(call.out_mappings, outs_t) if t)
    scratch = call.scratch_shapes + tuple(s for s, t in zip(call.scratch_shapes, scratch_t) if t)
    aliases = dict(call.input_output_aliases)
    n_in, n_out = len(call.in_mappings), len(call.out_mappings)
    tangent_index = lambda flags, i: int(np.sum(flags[:i]))
    for i, o in call.input_output_aliases.items():
        if outs_t[o]:  # the tangent output starts as the tangent of the input
            aliases[n_in + tangent_index(with_tangent, i)] = n_out + tangent_index(outs_t, o)
    # A named grid's axes, bound while the JVP runs (its jaxpr keeps lax.axis_index).
    named = tuple(zip(call.grid_names, call.grid[call.num_batch_axes:])) if call.grid_names else ()
    kernel = _jvp_kernel(call.kernel, call.name, (n_in, n_out, len(call.scratch_shapes)),
                         (tuple(with_tangent), tuple(outs_t), tuple(scratch_t)), named)
    return dataclasses.replace(call, kernel=kernel, name=f"{call.name}_jvp", in_mappings=in_maps,
                               out_mappings=out_maps, scratch_shapes=scratch,
                               input_output_aliases=aliases,
                               cost_estimate=_doubled(call.cost_estimate))


def _jvp_kernel(kernel, name, counts, flags, named=()):
    """``jvp_kernel(*ins, *in_tangents, *outs, *out_tangents, *scratch, *scratch_tangents)``."""
    n_in, n_out, n_scratch = counts
    in_t, out_t, scratch_t = flags

    def jvp_kernel(*refs):
        sizes = [n_in, sum(in_t), n_out, sum(out_t), n_scratch, sum(scratch_t)]
        parts, start = [], 0
        for size in sizes:
            parts.append(list(refs[start:start + size]))
            start += size
        ins, tins, outs, touts, scratch, tscratch = parts
        primals = ins + outs + scratch
        avals = [jax.typeof(r) for r in primals]
        if not all(_jax_internals.is_ref_aval(a) for a in avals):
            raise NotImplementedError(
                f"pallas_call (kernel {name}): the JVP needs plain Refs, and this backend "
                "hands the kernel masked views of its overhanging edge blocks.")
        closed = _jax_internals.trace_ref_function(kernel, avals, name)
        with _jax_internals.named_axes(named):
            jvp = _jax_internals.jvp_of_ref_jaxpr(closed, [*in_t, *out_t, *scratch_t])
            _jax_internals.eval_jaxpr(jvp, *primals, *tins, *touts, *tscratch)

    jvp_kernel.__name__ = f"{name}_jvp"
    return jvp_kernel


def _doubled(cost):
    """A cost estimate for primal plus tangent work: twice the primal's."""
    if cost is None:
        return None
    if isinstance(cost, dict):
        return {k: 2 * v for k, v in cost.items()}
    fields = ("flops", "transcendentals", "bytes_accessed")
    if all(hasattr(cost, f) for f in fields):
        return type(cost)(**{f: 2 * getattr(cost, f) for f in fields})
    return cost
