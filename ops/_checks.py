"""Input checks shared by every op: clear errors before anything is traced."""
from __future__ import annotations

import weakref

import jax
import jax.numpy as jnp
import numpy as np

from pallas_core._jax_internals import JAXPR_CALLS, LATER_ELEMENTWISE, find_eqn

FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def check_array(x, name: str, op: str):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{op}: {name} must be a JAX or NumPy array, got {type(x).__name__}.")
    return x


def check_float_dtype(x, name: str, op: str) -> None:
    if np.dtype(x.dtype) not in [np.dtype(d) for d in FLOAT_DTYPES]:
        raise TypeError(f"{op}: {name} has dtype {np.dtype(x.dtype).name}; expected one of "
                        "float32, bfloat16, float16.")


def check_same_dtype(x, ref, name: str, ref_name: str, op: str) -> None:
    if np.dtype(x.dtype) != np.dtype(ref.dtype):
        raise TypeError(f"{op}: {name} has dtype {np.dtype(x.dtype).name} but {ref_name} has "
                        f"{np.dtype(ref.dtype).name}; cast them to one dtype first.")


def check_matmul_operands(x, w, op: str, *, contract: str = "K", out: str = "N") -> None:
    """``x [..., contract]`` and ``w [contract, out]`` of one float dtype.

    Raises:
      TypeError: non-arrays, integer or mismatched dtypes.
      ValueError: w not rank 2, x a scalar, or the contracted dims differ.
    """
    check_array(x, "x", op)
    check_array(w, "w", op)
    check_float_dtype(x, "x", op)
    check_same_dtype(w, x, "w", "x", op)
    if w.ndim != 2:
        raise ValueError(f"{op}: w must have rank 2 [{contract}, {out}], got shape {tuple(w.shape)}.")
    if x.ndim < 1:
        raise ValueError(f"{op}: x must have rank >= 1 [..., {contract}], got a scalar.")
    if x.shape[-1] != w.shape[0]:
        raise ValueError(f"{op}: x's last dim ({x.shape[-1]}) must equal w's first dim "
                         f"({w.shape[0]}); got x {tuple(x.shape)} and w {tuple(w.shape)}.")


# --------------------------------------------------------------------------
# Elementwise callables (fused epilogues): traced once on a small block
# --------------------------------------------------------------------------

# Primitives that act on each element independently (or on scalars).
_ELEMENTWISE_PRIMITIVES = frozenset("""
    neg sign floor ceil round is_finite exp exp2 log expm1 log1p tanh logistic sin cos tan
    asin acos atan sinh cosh asinh acosh atanh lgamma digamma erf erfc erf_inv abs sqrt rsqrt
    cbrt not integer_pow square real imag conj population_count clz reduce_precision copy
    copy_p convert_element_type bessel_i0e bessel_i1e
    add sub mul div rem pow max min nextafter atan2 and or xor eq ne lt le gt ge shift_left
    shift_right_logical shift_right_arithmetic igamma igammac polygamma zeta complex add_any
    select_n clamp bitcast_convert_type
    empty
""".split()) | frozenset(LATER_ELEMENTWISE)  # later JAX's log2; empty: jnp.empty in JAX 0.11
# Calls whose bodies are checked in turn (``remat2``: jax.checkpoint / jax.remat).
_CALL_PRIMITIVES = JAXPR_CALLS | frozenset("""
    custom_jvp_call custom_vjp_call custom_vjp_call_jaxpr remat2 custom_lin
""".split())
_PROBE_SHAPE = (2, 3)
_elementwise_verdicts: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def check_elementwise(fn, name: str, op: str) -> None:
    """Raises unless ``fn`` acts on every element of its input independently.

    ``fn`` is traced once on a float32 ``[2, 3]`` block (the verdict is cached per
    callable): its jaxpr (nested calls included) may hold only elementwise
    primitives whose operands and results are scalars or the whole block (a
    scalar constant may be broadcast), no array constants, and it must return one
    array of the block's shape. A kernel epilogue applies ``fn`` to each output
    tile separately, so anything that mixes positions (softmax, a normalisation, a
    reshape, a reduction, ``iota``) would give tile-dependent numbers.

    Raises:
      ValueError: ``fn`` is not elementwise (the message names the primitive),
        or cannot be traced on a float32 block.
    """
    try:
        verdict = _elementwise_verdicts.get(fn, _UNSEEN)
    except TypeError:  # not weakly referenceable or hashable: no caching
        verdict = _UNSEEN
    if verdict is _UNSEEN:
        verdict = _why_not_elementwise(fn)
        try:
            _elementwise_verdicts[fn] = verdict
        except TypeError:
            pass
    if verdict is not None:
        label = getattr(fn, "__name__", type(fn).__name__)
        raise ValueError(
            f"{op}: {name} {label!r} is not elementwise: {verdict}. The kernel applies it to "
            "each output tile on its own, so it must act on every element independently "
            "(apply softmax, normalisations and other functions of a whole row to the "
            "result instead).")


_UNSEEN = object()


def _why_not_elementwise(fn) -> str | None:
    probe = jax.ShapeDtypeStruct(_PROBE_SHAPE, jnp.float32)
    try:
        closed = jax.make_jaxpr(fn)(probe)
    except Exception as e:  # noqa: BLE001 - any failure to trace is the user's to see
        return f"calling it on a float32 {list(_PROBE_SHAPE)} block failed ({type(e).__name__}: {e})"
    outs = closed.out_avals
    if len(outs) != 1 or tuple(outs[0].shape) != _PROBE_SHAPE:
        got = ", ".join(str(tuple(a.shape)) for a in outs)
        return f"on a {list(_PROBE_SHAPE)} block it returns shape(s) {got}, not the block's shape"
    if any(np.shape(c) != () for c in closed.consts):
        return "it closes over an array constant, which does not follow the tile"
    return _first_non_elementwise(closed.jaxpr)


def _first_non_elementwise(jaxpr) -> str | None:
    """Why the first offending equation (calls' bodies searched in turn) is not
    elementwise; None if every equation is."""
    found = find_eqn(jaxpr, lambda eqn: _why_not_elementwise_eqn(eqn) is not None)
    return None if found is None else _why_not_elementwise_eqn(found)


def _why_not_elementwise_eqn(eqn) -> str | None:
    prim = eqn.primitive.name
    if prim in _CALL_PRIMITIVES:
        return None  # find_eqn checks the body
    if prim == "broadcast_in_dim" and all(np.shape(v.aval) == () for v in eqn.invars):
        return None  # a scalar constant spread over the block
    if prim not in _ELEMENTWISE_PRIMITIVES:
        return f"it uses the primitive {prim!r}, which is not elementwise"
    shapes = [tuple(getattr(v.aval, "shape", ())) for v in (*eqn.invars, *eqn.outvars)]
    if any(s not in ((), _PROBE_SHAPE) for s in shapes):
        return f"its {prim!r} works on shapes {shapes}, not element by element"
    return None


def check_where(where, x, op: str) -> None:
    """``where`` (the jnp / jax.nn reductions' mask): a boolean array broadcastable to x.

    Raises:
      TypeError: not a boolean array.
      ValueError: a shape that does not broadcast to x's.
    """
    if not hasattr(where, "dtype") or np.dtype(where.dtype) != np.bool_:
        raise TypeError(f"{op}: where must be a boolean array, got "
                        f"{getattr(where, 'dtype', type(where).__name__)}.")
    check_broadcasts_to(where, "where", x, op)


def check_broadcasts_to(a, name: str, x, op: str) -> None:
    """Raises ValueError naming ``name`` unless ``a``'s shape broadcasts to x's."""
    try:
        shape = np.broadcast_shapes(np.shape(a), tuple(x.shape))
    except ValueError:
        shape = None
    if shape != tuple(x.shape):
        raise ValueError(f"{op}: {name} of shape {tuple(np.shape(a))} does not broadcast to "
                         f"x's shape {tuple(x.shape)}.")
