"""``pltpu.roll``, ``store``, ``bitcast`` and the TPU's stateful PRNG, ``prng_seed`` /
``prng_random_bits``.

* ``roll(x, shift, axis, *, stride=None, stride_axis=None)``: ``jnp.roll`` of
  ``x`` by ``shift`` along ``axis`` (element ``i`` moves to ``i + shift``,
  wrapping); with a ``stride``, slice ``k`` along ``stride_axis`` is rolled by
  ``shift + k * stride`` (the TPU's strided lane rotate).
* ``store(ref, val, *, mask=None)``: ``ref[...] = val`` where ``mask`` is True,
  memory unchanged elsewhere (the TPU's masked vector store); ``load(ref, *,
  mask=None)``: ``ref[...]``, unspecified where ``mask`` is False.
* ``bitcast(x, ty)``: ``x``'s bits seen as ``ty``; between widths the
  second-minor dim scales by the width ratio (packed rows, as in a TPU
  vreg: row ``r`` of a 16-bit result from a 32-bit ``x`` is the low half of
  row ``r // 2`` when ``r`` is even and the high half when odd).
* ``prng_seed(*seeds)`` seeds the kernel's generator; ``prng_random_bits(shape)``
  returns int32 random bits and advances it. The TPU's hardware generator is
  not reproduced bit for bit: the interpreter draws from JAX's threefry,
  keyed by the seeds (the first as the key, the others folded in) and by the
  number of draws since the last seed, so the bits depend on the seeds and
  on the order of draws only (seed with ``pl.program_id`` for different bits
  per program). Drawing before any seed uses seed 0.

``mosaic_tpu`` gets JAX's own primitives. Our ``triton`` backend rolls with
``tl.gather`` at the rolled positions, stores with a mask (``tl.store``) and
bitcasts between equal widths; there is no PRNG there (Triton's random
numbers are a counter-based generator of another design), and the other GPU
lowerings have none of these: NotImplementedError.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_core import context, registry
from pallas_core.rolling import rolled
from pallas_core.primitives import _backend


def jax_tpu_or_none(what, also=()):
    """JAX's ``pallas.tpu`` on mosaic_tpu (forward to it), None on the interpreter and
    the backends ``also`` (compute here), else NotImplementedError naming the backend."""
    backend = _backend()
    if backend == "mosaic_tpu":
        from jax.experimental.pallas import tpu as jpltpu
        return jpltpu
    if backend not in ("interpret", *also):
        where = f"on the {backend!r} backend" if backend else "outside a kernel"
        raise NotImplementedError(f"{what}: implemented in kernels on the "
                                  f"{', '.join(('interpret', *also))} and mosaic_tpu backends, "
                                  f"not {where}.")
    return None


def _static_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def roll(x, shift, axis: int, *, stride: int | None = None, stride_axis: int | None = None):
    """``x`` rolled by ``shift`` along ``axis`` (as ``jnp.roll``), optionally strided.

    Args:
      x: an array of rank >= 1.
      shift: a non-negative int or a traced int32 scalar.
      axis: the (non-negative) dim to roll along.
      stride / stride_axis: both or neither; slice ``k`` along ``stride_axis``
        is rolled by ``shift + k * stride``. ``stride`` non-negative,
        ``stride_axis != axis``.

    Raises:
      ValueError: a negative static shift or stride, axes out of range, only
        one of stride / stride_axis, or ``stride_axis == axis`` (JAX's checks).
    """
    x = jnp.asarray(x)
    if _static_int(shift) and shift < 0:
        raise ValueError(f"roll: shift must be non-negative, got {shift}.")
    if not _static_int(axis) or not 0 <= axis < x.ndim:
        raise ValueError(f"roll: axis must be an int in [0, {x.ndim}), got {axis!r}.")
    if (stride is None) != (stride_axis is None):
        raise ValueError("roll: give both stride and stride_axis, or neither.")
    if stride is not None:
        if not _static_int(stride) or stride < 0:
            raise ValueError(f"roll: stride must be a non-negative int, got {stride!r}.")
        if not _static_int(stride_axis) or not 0 <= stride_axis < x.ndim:
            raise ValueError(f"roll: stride_axis must be an int in [0, {x.ndim}), "
                             f"got {stride_axis!r}.")
        if stride_axis == axis:
            raise ValueError(f"roll: stride_axis and axis must differ, both are {axis}.")
    native = jax_tpu_or_none("roll", also=("triton",))
    if native is not None:
        return native.roll(x, shift, axis, stride=stride, stride_axis=stride_axis)
    rule = registry.rule("roll", _backend())
    if rule is not None:
        return rule(x, shift, axis, stride, stride_axis)
    return rolled(x, shift, axis, stride, stride_axis)


def load(ref, *, mask=None):
    """``ref[...]``; where ``mask`` (booleans of the Ref's shape) is False the value is
    unspecified (0 here, as ``pl.load`` gives without ``other``)."""
    native = jax_tpu_or_none("load", also=("triton",))
    if native is not None:
        return native.load(ref, mask=mask)
    from pallas_core.primitives import load as masked_load
    return masked_load(ref, (), mask=mask)


def store(ref, val, *, mask=None) -> None:
    """``ref[...] = val`` where ``mask`` is True; elsewhere memory keeps its value.

    Args:
      ref: a Ref (narrow it with ``ref.at[...]`` first).
      val: an array of the Ref's shape (broadcast as for ``ref[...] = val``).
      mask: None (every element), or booleans of the Ref's shape.
    """
    native = jax_tpu_or_none("store", also=("triton",))
    if native is not None:
        native.store(ref, val, mask=mask)
        return
    from pallas_core.primitives import store as masked_store
    masked_store(ref, (), val, mask=mask)


def _bits(dtype) -> int:
    return jnp.dtype(dtype).itemsize * 8


def bitcast(x, ty):
    """``x``'s bits as dtype ``ty``; the second-minor dim is scaled by the ratio of
    the widths (rows are packed: see the module doc), the other dims kept.

    Raises:
      ValueError: ``x`` of rank < 2, or a second-minor dim that does not pack
        evenly into ``ty`` (JAX's checks).
      NotImplementedError: widths that differ, on the triton backend.
    """
    x = jnp.asarray(x)
    ty = jnp.dtype(ty)
    if x.ndim < 2:
        raise ValueError(f"bitcast: x must have rank >= 2, got shape {x.shape}.")
    src, dst = _bits(x.dtype), _bits(ty)
    if x.shape[-2] * src % dst:
        raise ValueError(f"bitcast: the second-minor dim of {x.dtype}{list(x.shape)} does not "
                         f"pack evenly into {ty} ({src} -> {dst} bits).")
    native = jax_tpu_or_none("bitcast", also=("triton",))
    if native is not None:
        return native.bitcast(x, ty)
    if src != dst and _backend() == "triton":
        raise NotImplementedError(f"bitcast: {x.dtype} -> {ty} changes the element width, which "
                                  "the triton backend does not do (equal widths only).")
    return bitcast_rows(x, ty)


def bitcast_rows(x, ty):
    """:func:`bitcast` in ``jax.numpy`` (arguments already checked)."""
    src, dst = _bits(x.dtype), _bits(ty)
    *lead, m, n = x.shape
    if src < dst:  # ``packing`` consecutive rows make one row
        packing = dst // src
        x = jnp.swapaxes(x.reshape(*lead, m // packing, packing, n), -1, -2)
        return lax.bitcast_convert_type(x, ty)
    if src > dst:  # each row unpacks into ``packing`` rows
        y = lax.bitcast_convert_type(x, ty)
        return jnp.swapaxes(y, -1, -2).reshape(*lead, m * (src // dst), n)
    return lax.bitcast_convert_type(x, ty)


_IMPL = "threefry2x32"  # two uint32 words of key, whatever jax_default_prng_impl says


def _state():
    ctx = context.current()
    return ctx.prng_state


def prng_seed(*seeds) -> None:
    """Seeds the kernel's random generator with one or more int scalars (maybe traced).

    Raises:
      ValueError: no seed.
      TypeError: a seed that is not an integer scalar.
    """
    if not seeds:
        raise ValueError("prng_seed: give at least one seed.")
    values = []
    for k, s in enumerate(seeds):
        s = jnp.asarray(s)
        if s.ndim or not jnp.issubdtype(s.dtype, jnp.integer):
            raise TypeError(f"prng_seed: seed {k} must be an integer scalar, got "
                            f"{s.dtype}{list(s.shape)}.")
        values.append(s)
    native = jax_tpu_or_none("prng_seed")
    if native is not None:
        native.prng_seed(*values)
        return
    key = jax.random.key(values[0].astype(jnp.uint32), impl=_IMPL)
    for s in values[1:]:
        key = jax.random.fold_in(key, s.astype(jnp.uint32))
    state = _state()
    state[...] = jnp.concatenate([jax.random.key_data(key).astype(jnp.uint32),
                                  jnp.zeros((1,), jnp.uint32)])


def prng_random_bits(shape) -> jax.Array:
    """``shape`` int32 random bits from the kernel's generator, which then advances.

    Raises:
      TypeError: a shape that is not a tuple of non-negative ints.
    """
    shape = (shape,) if _static_int(shape) else shape
    if not isinstance(shape, (tuple, list)) or not all(_static_int(d) and d >= 0
                                                       for d in shape):
        raise TypeError(f"prng_random_bits: shape must be a tuple of non-negative ints, "
                        f"got {shape!r}.")
    shape = tuple(int(d) for d in shape)
    native = jax_tpu_or_none("prng_random_bits")
    if native is not None:
        return native.prng_random_bits(shape)
    state = _state()
    words = state[...]
    key = jax.random.fold_in(jax.random.wrap_key_data(words[:2], impl=_IMPL), words[2])
    state[2] = words[2] + 1
    return lax.bitcast_convert_type(jax.random.bits(key, shape, jnp.uint32), jnp.int32)
