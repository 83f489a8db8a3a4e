"""Mosaic GPU's in-kernel primitives under ``plgpu``'s names.

Most are JAX's own functions, re-exported by :mod:`pallas_core.gpu` as they
are: their meaning is JAX's Mosaic GPU lowering's, and they must reach that
lowering and JAX's GPU interpreter as themselves (``copy_gmem_to_smem``,
``copy_smem_to_gmem``, ``commit_smem``, ``wait_smem_to_gmem``,
``barrier_wait`` / ``barrier_arrive``, ``wgmma_wait``, ``set_max_registers``,
``transpose_ref``...).

The few below are ours: on the lowering path each calls JAX's function; in
the GPU interpret mode (:func:`pallas_core.gpu.kernel_context.interpreting`),
where JAX 0.10.2's interpreter has no rule for the primitive JAX binds, each
says the same thing in what the interpreter runs. A register layout is a
hint about how a value is spread over the warpgroup's threads, not part of
its value, so on the CPU it is dropped; a prefetch into L2 changes no value.
"""
from __future__ import annotations

from jax import lax

from pallas_core.gpu.kernel_context import interpreting


def _plgpu():
    from jax.experimental.pallas import mosaic_gpu as plgpu
    return plgpu


def load(src, idx, *, layout=None, optimized: bool = True):
    """``src[idx]`` into registers, in ``layout`` (``plgpu.load``)."""
    if interpreting():
        return src[idx]
    return _plgpu().load(src, idx, layout=layout, optimized=optimized)


def layout_cast(x, new_layout):
    """``x`` in register layout ``new_layout`` (``plgpu.layout_cast``)."""
    if interpreting():
        return x
    return _plgpu().layout_cast(x, new_layout)


def broadcasted_iota(dtype, shape, dimension: int, *, layout=None):
    """``lax.broadcasted_iota`` in register layout ``layout`` (``plgpu.broadcasted_iota``)."""
    if interpreting():
        return lax.broadcasted_iota(dtype, tuple(shape), dimension)
    return _plgpu().broadcasted_iota(dtype, shape, dimension, layout=layout)


def async_prefetch(ref, *, collective_axes=None, leader_tracked=None):
    """Starts loading GMEM ``ref`` into L2 (``plgpu.async_prefetch``); nothing on the CPU."""
    if interpreting():
        return None
    return _plgpu().async_prefetch(ref, collective_axes=collective_axes,
                                   leader_tracked=leader_tracked)


def _is_ref(x) -> bool:
    from jax._src.state import types as state_types
    if isinstance(x, state_types.TransformedRef):
        return True
    try:
        import jax
        return isinstance(jax.typeof(x), state_types.AbstractRef)
    except TypeError:
        return False


def _is_transposed(x) -> bool:
    from jax._src.state import types as state_types
    return isinstance(x, state_types.TransformedRef) and any(
        isinstance(t, state_types.TransposeTransform) for t in x.transforms)


def _value(x):
    """An operand's value: an array as it is, a Ref read (a transposed view read
    untransposed, then transposed in registers: the interpreter reads indexed and
    tiled / swizzled Refs only)."""
    from jax._src.state import types as state_types
    import jax.numpy as jnp
    if not _is_ref(x):
        return x
    if isinstance(x, state_types.TransformedRef) and x.transforms and isinstance(
            x.transforms[-1], state_types.TransposeTransform):
        rest = x.transforms[:-1]
        base = state_types.TransformedRef(x.ref, rest) if rest else x.ref
        return jnp.transpose(_value(base), x.transforms[-1].permutation)
    return x[...]


def wgmma(acc, a, b) -> None:
    """``acc += a @ b`` on the tensor cores, asynchronously (``plgpu.wgmma``).

    ``acc`` is an ``ACC`` Ref; ``b`` an SMEM Ref; ``a`` an SMEM Ref or an array in
    registers (its ``wgmma`` register layout); either may be a transposed view
    (``transpose_ref``). JAX 0.10.2's interpreter runs ``wgmma`` on untransposed
    SMEM operands only, so there any other form is computed from the operands'
    values (read from SMEM, race-checked) and added to the accumulator with
    plain loads and stores, accumulating in ``acc``'s dtype as ``wgmma`` does.
    """
    plgpu = _plgpu()
    if interpreting() and not (_is_ref(a) and _is_ref(b) and not _is_transposed(a)
                               and not _is_transposed(b)):
        import jax.numpy as jnp
        from jax._src.state import primitives as state_primitives
        product = jnp.dot(_value(a), _value(b), preferred_element_type=acc.dtype)
        state_primitives.ref_set(acc, (), acc[...] + product)
        return None
    return plgpu.wgmma(acc, a, b)
