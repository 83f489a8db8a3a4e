"""The private JAX APIs pallas_core relies on, kept in one place.

``discharge_state`` turns a jaxpr that allocates and mutates Refs into a
pure one (JAX itself runs it on every jitted program that holds Refs). The
interpreter applies it to each kernel body so that the programs it builds
contain no Refs at all, which is what lets ``vmap`` batch a ``pl.when``
(JAX cannot batch a stateful ``cond``) and keeps every transformation usable.

Written for JAX 0.10.2 and 0.11: where the two differ (a primitive's params,
the jaxpr classes) the helpers here read both forms; docs/pallas_core.md
section 15 lists every private API used and what changed in 0.11.
"""
from __future__ import annotations

import jax
import numpy as np

try:
    from jax._src.state.discharge import discharge_state as _discharge_state
except ImportError as e:  # pragma: no cover - only on an incompatible JAX
    raise ImportError(
        "pallas_core needs jax._src.state.discharge.discharge_state (present in "
        f"jax 0.10.2 and 0.11); this JAX ({jax.__version__}) does not provide it.") from e


def discharge_refs(closed_jaxpr: jax.extend.core.ClosedJaxpr):
    """A pure ClosedJaxpr equivalent to ``closed_jaxpr`` (Ref effects threaded through;
    hijax primitives expanded first, :func:`without_hijax`)."""
    return _discharge_state(without_hijax(closed_jaxpr))


def without_hijax(closed):
    """``closed`` with every hijax primitive expanded into JAX's own primitives.

    A hijax primitive (``call_hi_primitive``) keeps its jaxpr inside a Python object
    that neither state discharge nor a code generator reads; ``lax.scan`` stages one
    under JAX's ``jax_scan3`` flag (in 0.10.2 and 0.11: off by default), with its
    carry in Refs. JAX expands them before its own lowering (``lower_jaxpr2``); so
    does pallas_core. A jaxpr without one is returned as it is.

    Raises:
      NotImplementedError: hijax typed inputs or outputs (the expansion would change
        the jaxpr's signature).
    """
    if not getattr(closed.jaxpr, "is_high", False):
        return closed
    from jax._src.interpreters import partial_eval as pe
    lowered = pe.lower_jaxpr2(closed)
    if [v.aval for v in lowered.jaxpr.outvars] != [v.aval for v in closed.jaxpr.outvars]:
        raise NotImplementedError("a kernel with hijax typed inputs or outputs (e.g. a mutable "
                                  "hijax type) is not supported; only hijax primitives such as "
                                  "call_hi_primitive (lax.scan under jax_scan3) are expanded.")
    return lowered


# --- Forward-mode autodiff of kernels (pallas_core.autodiff) -------------------
# A kernel is a function of Refs; JAX's jaxpr-level JVP differentiates the
# Ref reads and writes of its jaxpr (a tangent Ref beside each primal Ref),
# so the JVP of a kernel is JAX's own JVP, not one of ours. The public API has no
# way to trace a function of Refs or to JVP a jaxpr, so these stay here.
from jax._src import api_util as _api_util  # noqa: E402
from jax._src import core as _core  # noqa: E402
from jax._src import linear_util as _lu  # noqa: E402
from jax._src.interpreters import ad as _ad  # noqa: E402
from jax._src.interpreters import partial_eval as _pe  # noqa: E402
from jax._src.state.types import AbstractRef as _AbstractRef  # noqa: E402


def is_ref_aval(aval) -> bool:
    return isinstance(aval, _AbstractRef)


def trace_ref_function(fn, ref_avals, name: str) -> jax.extend.core.ClosedJaxpr:
    """``fn(*refs)`` traced over abstract Refs; its return value is dropped."""
    def body(*refs):
        fn(*refs)
        return []

    debug = _api_util.debug_info(name, fn, tuple(ref_avals), {})
    jaxpr, _, consts = _pe.trace_to_jaxpr_dynamic(_lu.wrap_init(body, debug_info=debug),
                                                  list(ref_avals))
    return close(jaxpr, consts)


def jvp_of_ref_jaxpr(closed, nonzeros):
    """The JVP of a jaxpr over Refs: it takes the primal Refs, then one tangent Ref
    for each ``nonzeros`` entry that is True, and updates both."""
    jvp, _ = _ad.jvp_jaxpr(closed, list(nonzeros), [])
    return jvp


def eval_jaxpr(closed, *args):
    return _core.eval_jaxpr(closed.jaxpr, closed.consts, *args)


def is_being_linearized(tangent) -> bool:
    """Whether a custom_jvp rule's tangent is an unknown of JAX's partial evaluation:
    the rule runs under ``jax.linearize`` / ``jax.grad`` / ``jax.vjp``, not ``jax.jvp``."""
    return isinstance(tangent, _pe.JaxprTracer) and not tangent.pval.is_known()


def named_axes(names_and_sizes):
    """A context in which ``lax.axis_size(name)`` / ``lax.psum(1, name)`` know the
    given named axes (a named pallas_call grid, seen from its kernel)."""
    return _core.extend_axis_env_nd(tuple(names_and_sizes))


def pytree_differences(tree1, tree2):
    """``(key path, what tree1 has, what tree2 has, why)`` for each place two
    PyTreeDefs differ structurally (JAX's own description of a mismatch)."""
    from jax._src import tree_util
    return list(tree_util.equality_errors_pytreedef(tree1, tree2))


# --- Searching a jaxpr (pallas_core.call, pallas_core.named_axes, ops._partitioning) --

# Primitives that call a jaxpr (``jaxpr`` / ``call_jaxpr`` param) with the same
# meaning as inlining it. ``eval_jaxpr`` is ``closed_call``'s name in JAX after 0.11.0.
JAXPR_CALLS = frozenset({"pjit", "jit", "closed_call", "core_call", "eval_jaxpr"})


def as_closed(jaxpr):
    """``jaxpr`` as a closed jaxpr (``.jaxpr`` and ``.consts``): a closed one as it is,
    an open one (``remat2``'s body in JAX 0.10) with no consts."""
    return jaxpr if hasattr(jaxpr, "consts") else close(jaxpr, [])


def close(jaxpr, consts):
    """The closed jaxpr of ``jaxpr`` with ``consts`` for its constvars.

    JAX 0.11 merged ClosedJaxpr into Jaxpr (consts attached with ``with_consts``)
    and keeps ``ClosedJaxpr(jaxpr, consts)`` only as a legacy spelling marked for
    removal; JAX 0.10 has only the latter."""
    if hasattr(jaxpr, "with_consts"):
        return jaxpr.with_consts(consts)
    return _core.ClosedJaxpr(jaxpr, consts)


def scan_sizes(params) -> tuple[int, int]:
    """``(number of consts, number of carried values)`` of a ``scan`` equation.

    JAX 0.10 names them in the params (``num_consts``, ``num_carry``); JAX 0.11
    replaced both by ``ft_in``, the operands' groups (consts, carry, xs)."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)


# --- Element-wise primitives of later JAX, as JAX 0.10.2 spells them ----------
# JAX 0.11.2 binds ``jnp.log2`` as a primitive of its own (``log2``); 0.10.2 and
# 0.11.0 trace it to ``log(x) / log(2)``. The Triton code generator writes such a
# primitive as that spelling (so its numerics, and the generated source, stay
# those of 0.10.2) and the elementwise check takes it as elementwise. Each entry:
# the function of the primitive's operands and params that 0.10.2 traces.
def _log2_as_in_0_10(x, **params):
    # jnp.log2 of JAX 0.10.2 for real dtypes: both logarithms in x's dtype, then
    # their quotient (the ``accuracy`` param of later JAX has no 0.10.2 meaning).
    return jax.lax.div(jax.lax.log(x), jax.lax.log(np.array(2, dtype=x.dtype)))


LATER_ELEMENTWISE = {"log2": _log2_as_in_0_10}


def spelled_as_in_0_10(eqn):
    """The closed jaxpr of ``eqn`` (a :data:`LATER_ELEMENTWISE` primitive) as JAX
    0.10.2 spells it, traced at the types of the equation's operands.

    Raises:
      NotImplementedError: a complex operand (0.10.2 spells those otherwise; no
        backend that writes these spellings has complex numbers).
    """
    name = eqn.primitive.name
    avals = [v.aval for v in eqn.invars]
    if any(np.issubdtype(a.dtype, np.complexfloating) for a in avals):
        raise NotImplementedError(f"the {name!r} primitive of complex operands has no spelling here.")
    fn = LATER_ELEMENTWISE[name]
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]
    return jax.make_jaxpr(lambda *xs: fn(*xs, **eqn.params))(*specs)


def find_eqn(jaxpr, predicate):
    """The first equation of ``jaxpr``, or of a jaxpr nested in an equation's
    params (cond branches, loop bodies, calls), for which ``predicate(eqn)``
    holds; None if there is none."""
    for eqn in jaxpr.eqns:
        if predicate(eqn):
            return eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found = find_eqn(sub, predicate)
            if found is not None:
                return found
    return None


# --- Manual-axis types inside shard_map (interpret, ops._partitioning) -------
# Under shard_map's check_vma every value's type says which manual mesh axes it
# varies over, and a primitive's operands must agree. JAX's own functions (jnp,
# lax) cast an operand that varies over fewer axes (pvary, a no-op cast) before
# binding; a Ref store does not, so a kernel that stores a constant into a varying
# Ref (an accumulator's zero init) leaves the discharged program with cond
# branches of mismatched types. The interpreter inserts those casts itself.
from jax._src.state import primitives as _state_primitives  # noqa: E402

_STORES = (_state_primitives.swap_p, _state_primitives.addupdate_p)
# JAX 0.11 merged ClosedJaxpr into Jaxpr (one class, its consts attached), so a
# param's jaxpr is rewritten in place of unwrapping ``.jaxpr`` first.
_MERGED_JAXPR = _core.ClosedJaxpr is _core.Jaxpr


def varying_axes(*values) -> tuple:
    """The manual mesh axes any of ``values``' types vary over (inside a
    ``shard_map`` with ``check_vma``), in the mesh's order; () elsewhere."""
    varying = set()
    for x in values:
        varying |= getattr(getattr(jax.typeof(x), "mat", None), "varying", frozenset())
    if not varying:
        return ()
    return tuple(a for a in jax.sharding.get_abstract_mesh().axis_names if a in varying)


def vary(x, axes):
    """``x`` cast to vary over ``axes`` too (a no-op cast for each axis it did not vary over)."""
    if not axes:
        return x
    have = varying_axes(x)
    missing = tuple(a for a in axes if a not in have)
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def vary_stored_values(closed: jax.extend.core.ClosedJaxpr, mesh_axes) -> jax.extend.core.ClosedJaxpr:
    """``closed`` with every value stored into a Ref (``swap``, ``addupdate``, in
    nested jaxprs too) cast to vary over the Ref's manual axes, named in
    ``mesh_axes`` order. A no-op where the types already agree."""

    def fix_param(v):
        if isinstance(v, _core.ClosedJaxpr) and not _MERGED_JAXPR:
            return v.replace(jaxpr=fix(v.jaxpr))
        if isinstance(v, _core.Jaxpr):
            return fix(v)
        if isinstance(v, tuple) and any(isinstance(x, (_core.ClosedJaxpr, _core.Jaxpr)) for x in v):
            return tuple(fix_param(x) for x in v)
        return v

    def fix(jaxpr):
        eqns = []
        for eqn in jaxpr.eqns:
            params = {k: fix_param(v) for k, v in eqn.params.items()}
            if any(params[k] is not eqn.params[k] for k in params):
                eqn = eqn.replace(params=params)
            if eqn.primitive in _STORES:
                ref, value = eqn.invars[:2]
                missing = ref.aval.inner_aval.mat.varying - value.aval.mat.varying
                if missing:
                    axes = tuple(a for a in mesh_axes if a in missing)
                    aval, _ = _core.pvary_p.abstract_eval(value.aval, axes=axes)
                    cast = _core.Var(aval)
                    eqns.append(_core.new_jaxpr_eqn([value], [cast], _core.pvary_p, {"axes": axes},
                                                    set(), eqn.source_info, eqn.ctx))
                    eqn = eqn.replace(invars=[ref, cast, *eqn.invars[2:]])
            eqns.append(eqn)
        return jaxpr.replace(eqns=eqns)

    return closed.replace(jaxpr=fix(closed.jaxpr))


# --- Source locations of code traced late (ops._partitioning) -----------------
# custom_partitioning traces an op's per-device body while XLA compiles, so
# each equation's location is the traceback at that moment. These let the op
# give that body its own call site instead.
from jax._src import source_info_util as _source_info_util  # noqa: E402


def current_traceback():
    """The traceback JAX would record for an equation traced here."""
    return _source_info_util.current().traceback


def traced_at(traceback):
    """Context manager: equations traced inside record ``traceback`` as their location."""
    return _source_info_util.user_context(traceback)
