"""Kernel-side primitives with the names of the Pallas API (docs/pallas_core.md sections 1-8).

Refs are JAX's own (``jax.Ref``): kernels read with ``ref[idx]``, write with
``ref[idx] = value`` and narrow with ``ref.at[idx]``. What is here adds grid
queries, masked ``load``/``store``, dynamic slices and control flow.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.pallas import Slice as _RefSlice  # the indexer jax.Ref understands

from pallas_core import context, indexing, registry


def program_id(axis: int) -> jax.Array:
    """Index of the current program along grid ``axis`` (an int32 scalar)."""
    return context.current().program_id(_check_axis(axis))


def num_programs(axis: int) -> Any:
    """Grid size along ``axis``."""
    return context.current().num_programs(_check_axis(axis))


def _check_axis(axis):
    if not isinstance(axis, int) or isinstance(axis, bool):
        raise TypeError(f"axis must be a static int, got {axis!r}.")
    return axis


def cdiv(a, b):
    """Ceiling division for ints or integer arrays: ``cdiv(500, 128) == 4``."""
    if isinstance(a, int) and isinstance(b, int):
        return -(-a // b)
    return lax.div(a + b - 1, b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``): Triton tile sizes."""
    return 1 << max(0, int(n) - 1).bit_length()


def ds(start, size: int, stride: int = 1):
    """A dynamic slice ``[start, start + size * stride)`` for Ref indexing.

    ``start`` may be traced; ``size`` and ``stride`` are static ints, except
    that the index map of a ``BoundedSlice`` block dim may give a traced
    integer scalar ``size`` (at most the block size).
    """
    if not (isinstance(size, int) and size >= 0) and not _is_traced_int_scalar(size):
        raise TypeError(f"ds: size must be a static non-negative int, got {size!r}.")
    return _RefSlice(start, size, stride)


def _is_traced_int_scalar(x) -> bool:
    return (isinstance(x, jax.Array) and x.ndim == 0 and jnp.issubdtype(x.dtype, jnp.integer)
            and not isinstance(x, bool))


dslice = ds


def when(condition):
    """Decorator: run the body only where ``condition`` holds (``lax.cond``).

    A Python bool is resolved at trace time.
    """
    def decorator(body):
        if isinstance(condition, bool):
            if condition:
                body()
            return None
        lax.cond(condition, lambda: (body(), None)[1], lambda: None)
        return None
    return decorator


def loop(lower, upper, *, step: int = 1):
    """Decorator: ``body(i)`` for ``i`` in ``range(lower, upper, step)``, as a loop op.

    Unlike a Python ``for``, the body is traced once (``lax.fori_loop``).
    """
    if not isinstance(step, int) or step == 0:
        raise ValueError(f"loop: step must be a non-zero static int, got {step!r}.")

    def decorator(body):
        trips = cdiv(upper - lower, step) if step > 0 else cdiv(lower - upper, -step)
        if isinstance(trips, int):
            trips = max(trips, 0)
        else:
            trips = jnp.maximum(trips, 0)

        def run(t, carry):
            body(lower + t * step)
            return carry

        lax.fori_loop(0, trips, run, None)
        return None
    return decorator


def load(ref, idx=(), *, mask=None, other=None, cache_modifier=None, eviction_policy=None,
         volatile=False):
    """Reads ``ref[idx]``; where ``mask`` is False the result is ``other`` (or 0).

    Masked-off lanes are never read, so they may run past the Ref's edge: the
    GPU idiom ``pl.load(x_ref, (pl.ds(0, 128),), mask=col < n)`` on a block of
    ``n < 128`` is legal (lanes the mask keeps must be inside). Without a mask,
    an index that static values show past the edge raises IndexError.

    Args:
      idx: as for ``ref[idx]``: ints, slices, ``pl.ds``, integer arrays (a gather).
      mask: a boolean array broadcastable to the result.
      other: the value of masked-off lanes (a scalar or broadcastable array).
      cache_modifier: ``".ca"``, ``".cg"``, ``".cv"`` or None; eviction_policy:
        ``"evict_first"``, ``"evict_last"``, ``"evict_normal"`` or None; volatile:
        a bool. Hints: passed to ``tl.load`` by our triton backend, no-ops on the
        interpreter. At most one of the three (PTX cannot combine them).
    """
    hints = load_hints(cache_modifier, eviction_policy, volatile)
    return _read(ref, _as_index(idx), mask, other, hints, "load")


def store(ref, idx, value, *, mask=None, eviction_policy=None):
    """Writes ``value`` to ``ref[idx]``; where ``mask`` is False memory is unchanged.

    Masked-off lanes are never written and may run past the Ref's edge (see
    :func:`load`). ``eviction_policy`` is a hint, as for :func:`load`.
    """
    hints = load_hints(None, eviction_policy, False, what="store")
    _write(ref, _as_index(idx), value, mask, hints, "store")


_CACHE_MODIFIERS = (".ca", ".cg", ".cv")
_EVICTION_POLICIES = ("evict_first", "evict_last", "evict_normal")


def load_hints(cache_modifier, eviction_policy, volatile, what="load") -> tuple[tuple[str, Any], ...]:
    """Validated memory hints as ``((name, value), ...)``, the defaults left out."""
    hints = []
    if cache_modifier not in (None, ""):
        if cache_modifier not in _CACHE_MODIFIERS:
            raise ValueError(f"{what}: cache_modifier must be one of {_CACHE_MODIFIERS} or None, "
                             f"got {cache_modifier!r}.")
        hints.append(("cache_modifier", cache_modifier))
    if eviction_policy not in (None, ""):
        if eviction_policy not in _EVICTION_POLICIES:
            raise ValueError(f"{what}: eviction_policy must be one of {_EVICTION_POLICIES} or "
                             f"None, got {eviction_policy!r}.")
        if eviction_policy != "evict_normal":
            hints.append(("eviction_policy", eviction_policy))
    if not isinstance(volatile, (bool, np.bool_)):
        raise TypeError(f"{what}: volatile must be a bool, got {volatile!r}.")
    if volatile:
        hints.append(("volatile", True))
    if len(hints) > 1:  # PTX has one form of ld / st with a cache operator, one with an
        # eviction priority and a volatile one: ptxas refuses any two together.
        raise ValueError(f"{what}: give at most one of cache_modifier, eviction_policy and "
                         f"volatile (PTX cannot combine them), got {dict(hints)}.")
    return tuple(hints)


def _backend() -> str:
    return context.backend()


def _read(ref, idx, mask, other, hints, what):
    """A (masked) read on the current backend; see :func:`load`."""
    backend = _backend()
    if backend == "pallas_triton":
        return _jax_triton_access(ref, idx, None, mask, other, hints)
    rule = registry.rule("load", backend)  # a backend that carries masks and hints itself
    if mask is None:
        if not _is_edge_masked(ref):
            indexing.check_no_overhang(ref, idx, what)
        if rule is not None and hints:
            return rule(ref, idx, None, None, hints)
        return ref[idx]
    if rule is not None:
        return rule(ref, idx, mask, other, hints)
    if backend == "interpret" and not indexing.statically_in_bounds(ref, idx):
        access = indexing.access(ref, idx)
        if access is not None:
            return indexing.masked_read(access, mask, other, what)
    value = ref[idx]
    keep = indexing.broadcast_mask(mask, value.shape, what)
    fill = jnp.zeros((), value.dtype) if other is None else jnp.asarray(other, value.dtype)
    return jnp.where(keep, value, fill)


def _write(ref, idx, value, mask, hints, what):
    """A (masked) write on the current backend; see :func:`store`."""
    backend = _backend()
    if backend == "pallas_triton":
        _jax_triton_access(ref, idx, value, mask, None, hints)
        return
    rule = registry.rule("store", backend)  # a backend that carries masks and hints itself
    if mask is None:
        if not _is_edge_masked(ref):
            indexing.check_no_overhang(ref, idx, what)
        if rule is not None and hints:
            rule(ref, idx, value, None, hints)
            return
        ref[idx] = value
        return
    if rule is not None:
        rule(ref, idx, value, mask, hints)
        return
    if backend == "interpret" and not indexing.statically_in_bounds(ref, idx):
        access = indexing.access(ref, idx)
        if access is not None:
            indexing.masked_write(access, indexing.value_for(value, access.shape, ref.dtype, what),
                                  mask, what)
            return
    old = ref[idx]
    keep = indexing.broadcast_mask(mask, old.shape, what)
    ref[idx] = jnp.where(keep, indexing.value_for(value, old.shape, old.dtype, what), old)


def _is_edge_masked(ref) -> bool:
    from pallas_core.backends.edge_masks import MaskedRef
    return isinstance(ref, MaskedRef)


def _jax_triton_access(ref, idx, value, mask, other, hints):
    """JAX's ``pallas.triton`` load / store on the pallas_triton backend, with our
    edge masks folded into the mask. JAX 0.10.2's lowering cannot take a
    cache modifier (it looks ".cg" up under "cg"), so that hint is dropped there."""
    from jax.experimental.pallas import triton as pltriton
    # JAX's Triton lowering takes one indexer: ``ref.at[()]`` would add a second one.
    view = ref if isinstance(idx, tuple) and not idx else ref.at[idx]
    if _is_edge_masked(view):
        edges = view._mask()
        mask = edges if mask is None else edges & mask
        view = view._jax_view()
    kw = {k: v for k, v in hints if k != "cache_modifier"}
    if value is None:
        return pltriton.load(view, mask=mask, other=None if mask is None else other, **kw)
    value = indexing.value_for(value, view.shape, view.dtype, "store")
    pltriton.store(view, value, mask=mask, **kw)
    return None


def multiple_of(x, values):
    """A compiler hint: every element of ``x`` is a multiple of ``values``.

    ``values`` is an int or one positive int per dim of ``x`` (one for a
    scalar; an int is used for every dim). Returns ``x``. Our triton backend
    emits ``tl.multiple_of``, JAX's lowerings get JAX's ``multiple_of``, the
    interpreter ignores it. A false hint is undefined behaviour on a GPU.
    """
    values = _hint_values(values, max(1, np.ndim(x)), "multiple_of", "max(1, x.ndim)")
    backend = _backend()
    rule = registry.rule("multiple_of", backend)
    if rule is not None:
        return rule(x, values)
    if backend in ("mosaic_tpu", "mosaic_gpu", "pallas_triton"):
        from jax.experimental import pallas as jpl
        return jpl.multiple_of(x, values)
    return x


def _hint_values(values, rank, what, expected):
    if isinstance(values, (int, np.integer)) and not isinstance(values, bool):
        values = (int(values),) * rank
    try:
        values = tuple(values)
    except TypeError:
        raise TypeError(f"{what}: values must be an int or a sequence of ints, got {values!r}.") from None
    if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v > 0 for v in values):
        raise ValueError(f"{what}: values must be positive ints, got {values!r}.")
    if len(values) != rank:
        raise ValueError(f"{what}: {len(values)} value(s) given for an array that needs "
                         f"{expected} = {rank}.")
    return tuple(int(v) for v in values)


def dot(a, b, trans_a: bool = False, trans_b: bool = False, allow_tf32: bool | None = None,
        precision=None):
    """``a @ b`` of two 2-D arrays, optionally transposed first, accumulated in
    float32 (int32 for integers, float64 for float64), as Pallas's ``dot``.

    ``allow_tf32=True`` allows TF32 (``Precision.HIGH``), ``False`` asks for
    full float32 (``HIGHEST``); it and ``precision`` are exclusive.
    """
    a, b = jnp.asarray(a), jnp.asarray(b)
    for name, x in (("a", a), ("b", b)):
        if x.ndim != 2:
            raise ValueError(f"dot: {name} must be a 2-D array, got shape {x.shape}.")
    if allow_tf32 is not None:
        if precision is not None:
            raise ValueError("dot: give allow_tf32 or precision, not both.")
        precision = lax.Precision.HIGH if allow_tf32 else lax.Precision.HIGHEST
    ka, kb = a.shape[0 if trans_a else 1], b.shape[1 if trans_b else 0]
    if ka != kb:
        raise ValueError(f"dot: contraction sizes differ: a {a.shape} (trans_a={trans_a}) and "
                         f"b {b.shape} (trans_b={trans_b}).")
    dtype = jnp.promote_types(a.dtype, b.dtype)
    if jnp.issubdtype(dtype, jnp.integer) or dtype == jnp.bool_:
        out = jnp.int32
    elif dtype == jnp.float64:
        out = jnp.float64
    else:
        out = jnp.float32
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=out)


def _as_index(idx):
    if isinstance(idx, list):
        return tuple(idx)
    if idx is None:
        return ()
    return idx


def run_scoped(body, *scratch_shapes, collective_axes=(), **named_scratch_shapes):
    """Calls ``body(*refs, **named_refs)`` with fresh scratch Refs that live only inside it.

    Args:
      scratch_shapes: e.g. ``pallas_core.tpu.VMEM((8, 128), jnp.float32)``,
        ``pallas_core.gpu.SMEM(...)`` / ``ACC(...)`` / ``Barrier(...)``.
      collective_axes: Mosaic GPU only (JAX's keyword): one allocation shared
        by the warpgroups along these axes (e.g. ``"wg"``); elsewhere
        NotImplementedError.
      named_scratch_shapes: scratch passed to ``body`` by keyword.
    Returns:
      Whatever ``body`` returns.
    """
    ctx = context.current()
    if not collective_axes and not named_scratch_shapes:
        return ctx.run_scoped(body, scratch_shapes)
    return ctx.run_scoped_named(body, scratch_shapes, named_scratch_shapes, collective_axes)


def run_state(fn):
    """JAX's ``pl.run_state``: ``run_state(fn)(init)`` runs ``fn`` on Refs holding
    ``init`` (a pytree) and returns their final values.

    Inside a Mosaic GPU kernel, ``pallas_core.gpu.ACC.init(x)`` makes a ``wgmma``
    accumulator starting at ``x`` (waited for before the values are returned);
    in the GPU interpret mode this is what runs there (docs/pallas_core.md
    section 16). Elsewhere JAX's own, which the interpreter discharges.
    """
    def run(init):
        ctx = context._CURRENT.get()
        if ctx is None:
            from jax.experimental import pallas as jpl
            return jpl.run_state(fn)(init)
        return ctx.run_state(fn, init)
    return run
