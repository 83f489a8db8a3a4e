"""Mosaic GPU memory types: ``SMEM`` / ``GMEM`` (with transforms), ``ACC``, ``Barrier``, ``ClusterBarrier``.

These are the objects a kernel author writes in ``scratch_shapes``, in
``pl.run_scoped`` and in a ``BlockSpec``'s ``memory_space``, under the names
and signatures of ``jax.experimental.pallas.mosaic_gpu`` (JAX 0.10.2). They are
ours so that a mistake is a ``ValueError`` / ``TypeError`` naming the argument
when the object is made, before anything is traced (JAX's own types assert,
or fail inside its lowering). Each converts to JAX's type with ``to_jax()``,
which is what reaches JAX's lowering and its GPU interpreter; each also
answers ``get_ref_aval()`` as JAX's does, so JAX's own ``run_scoped`` and
pipeline helpers take them unchanged.

Hardware facts checked here (NVIDIA Hopper, sm_90):

* A ``TilingTransform((r, c))`` splits the trailing dims of an SMEM buffer
  into ``r x c`` tiles, so those dims must be multiples of the tile.
* A ``SwizzleTransform(s)`` (``s`` in 32, 64, 128 bytes) needs the minor tile
  dim to span exactly ``s`` bytes (the swizzle pattern repeats every ``s``
  bytes); :func:`pallas_core.gpu.find_swizzle` picks the largest that fits.
* A ``wgmma`` accumulator (``ACC``) lives in the registers of one warpgroup
  per 64 rows: rows a multiple of 64, columns a multiple of 8 up to 256 per
  instruction (PTX ISA, "Asynchronous Warpgroup Level Matrix Multiply-Accumulate
  Instructions": ``m64nNk*``, N in 8..256 step 8), float32 or float16 (int32
  for 8-bit integers).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_core.memory import MemorySpace, ScratchShape


def _plgpu():
    from jax.experimental.pallas import mosaic_gpu as plgpu
    return plgpu


def _shape(shape, what) -> tuple[int, ...]:
    if isinstance(shape, (int, np.integer)):
        shape = (shape,)
    try:
        dims = tuple(shape)
    except TypeError:
        raise TypeError(f"{what}: shape must be a tuple of ints, got {shape!r}.") from None
    if not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0 for d in dims):
        raise ValueError(f"{what}: shape must be non-negative ints, got {shape!r}.")
    return tuple(int(d) for d in dims)


def _dtype(dtype, what):
    try:
        return jnp.dtype(dtype)
    except TypeError:
        raise TypeError(f"{what}: {dtype!r} is not a dtype.") from None


def is_transform(t) -> bool:
    """Whether ``t`` is a Ref transform (JAX's ``Transform`` protocol: ``transform_type`` and
    ``undo``), as ``TilingTransform`` and ``SwizzleTransform`` are."""
    return callable(getattr(t, "transform_type", None)) and callable(getattr(t, "undo", None))


def check_transforms(shape: tuple[int, ...], dtype, transforms, what: str) -> tuple:
    """``transforms`` as a tuple after checking them against ``shape`` / ``dtype``.

    Raises:
      TypeError: an entry that is not a JAX ``Transform`` (``TilingTransform``,
        ``SwizzleTransform``, ...).
      ValueError: a tiling that does not divide the trailing dims, or a swizzle
        whose span is not the minor tile dim's bytes.
    """
    plgpu = _plgpu()
    if transforms is None:
        return ()
    if is_transform(transforms):
        transforms = (transforms,)
    transforms = tuple(transforms)
    aval = jax.core.ShapedArray(shape, dtype)
    for t in transforms:
        if not is_transform(t):
            raise TypeError(f"{what}: transforms must be plgpu transforms such as "
                            f"TilingTransform((8, 64)) or SwizzleTransform(128), got {t!r}.")
        if isinstance(t, plgpu.TilingTransform):
            tiling = tuple(t.tiling)
            trailing = aval.shape[len(aval.shape) - len(tiling):]
            if len(tiling) > len(aval.shape) or any(d % r for d, r in zip(trailing, tiling)):
                raise ValueError(f"{what}: {t} needs the last {len(tiling)} dims to be multiples "
                                 f"of {tiling}, got shape {aval.shape}.")
        elif isinstance(t, plgpu.SwizzleTransform):
            minor_bytes = aval.shape[-1] * jnp.dtype(dtype).itemsize if aval.shape else 0
            if minor_bytes != t.swizzle:
                raise ValueError(
                    f"{what}: {t} needs the minor tile dim to span {t.swizzle} bytes "
                    f"({t.swizzle // jnp.dtype(dtype).itemsize} x {jnp.dtype(dtype).name}), got "
                    f"{aval.shape[-1] if aval.shape else 0} elements (shape after the transforms "
                    f"before it: {aval.shape}); tile the minor dim with TilingTransform((r, "
                    f"{t.swizzle // jnp.dtype(dtype).itemsize})) first, or pick the swizzle with "
                    "find_swizzle.")
        try:
            aval = t.transform_type(aval)
        except (AssertionError, ValueError, TypeError, NotImplementedError) as e:
            raise ValueError(f"{what}: transform {t} does not apply to shape {aval.shape}: {e}") from None
    return transforms


@dataclasses.dataclass(frozen=True, repr=False)
class GPUMemorySpace(MemorySpace):
    """A Mosaic GPU memory space (``SMEM``: shared memory, ``GMEM``: global memory).

    ``SMEM(shape, dtype, transforms=())`` is a scratch buffer
    (:class:`GPUScratchShape`). ``transforms`` set on the space itself (as a
    ``BlockSpec``'s ``memory_space`` made by :class:`pallas_core.gpu.BlockSpec`)
    travel with a grid-form ``pallas_call``'s block to JAX's BlockSpec.
    """

    transforms: tuple = ()

    def __call__(self, shape, dtype, *, transforms: Sequence[Any] = ()) -> "GPUScratchShape":
        what = f"{self.name}({shape!r}, {getattr(dtype, '__name__', dtype)!s})"
        shape = _shape(shape, what)
        dtype = _dtype(dtype, what)
        transforms = check_transforms(shape, dtype, transforms, what)
        return GPUScratchShape(shape, dtype, dataclasses.replace(self, transforms=()), transforms)

    def like(self, shape_dtype):
        """``self(x.shape, x.dtype)`` (JAX's ``MemorySpace.like``)."""
        return self(shape_dtype.shape, shape_dtype.dtype)

    def with_transforms(self, transforms) -> "GPUMemorySpace":
        return dataclasses.replace(self, transforms=tuple(transforms))

    def to_jax(self):
        """JAX's ``plgpu.MemorySpace`` member of this space."""
        return getattr(_plgpu(), self.name)

    def __repr__(self):
        return f"gpu.{self.name}" + (f"(transforms={self.transforms})" if self.transforms else "")


SMEM = GPUMemorySpace("gpu", "SMEM")
GMEM = GPUMemorySpace("gpu", "GMEM")


@dataclasses.dataclass(frozen=True)
class GPUScratchShape(ScratchShape):
    """A buffer in SMEM or GMEM, with the layout transforms it is stored under."""

    transforms: tuple = ()

    def to_jax(self):
        """JAX's ``GPUMemoryRef`` for this buffer (``plgpu.SMEM(shape, dtype, transforms=...)``)."""
        return self.memory_space.to_jax()(self.shape, self.dtype, transforms=self.transforms)

    def get_ref_aval(self):
        return self.to_jax().get_ref_aval()

    def get_array_aval(self):
        return self.to_jax().get_array_aval()


_ACC_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float16), jnp.dtype(jnp.int32))


@dataclasses.dataclass(frozen=True, init=False, eq=False)
class ACC:
    """A ``wgmma`` accumulator in registers (``plgpu.ACC``, JAX's ``WGMMAAccumulatorRef``).

    ``ACC((m, n), dtype=jnp.float32)`` in ``pl.run_scoped`` starts at zero;
    ``ACC.init(array)`` in ``pl.run_state`` starts at ``array``. Reading
    ``acc_ref[...]`` waits for the warpgroup's outstanding ``wgmma``\\ s.

    Raises:
      ValueError: a shape that is not 2-D with m a multiple of 64 (one
        warpgroup's rows) and n a multiple of 8 up to 256, or a dtype other than
        float32, float16 or int32.
    """

    shape: tuple[int, int]
    dtype: Any
    init_value: Any

    def __init__(self, shape, dtype=jnp.float32, *, _init=None):
        what = f"ACC({shape!r}, {getattr(dtype, '__name__', dtype)!s})"
        shape = _shape(shape, what)
        dtype = _dtype(dtype, what)
        if len(shape) != 2 or shape[0] % 64 or shape[1] % 8 or not 8 <= shape[1] <= 256:
            raise ValueError(f"{what}: a wgmma accumulator is (m, n) with m a multiple of 64 "
                             f"(64 rows per warpgroup) and n a multiple of 8 in [8, 256], got {shape}.")
        if dtype not in _ACC_DTYPES:
            raise ValueError(f"{what}: wgmma accumulates in float32, float16 or int32, got {dtype}.")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "init_value", _init)

    @classmethod
    def init(cls, array) -> "ACC":
        """An accumulator that starts at ``array`` (for ``pl.run_state``)."""
        return cls(np.shape(array), array.dtype, _init=array)

    def to_jax(self):
        """JAX's ``WGMMAAccumulatorRef`` (``plgpu.ACC``)."""
        acc = _plgpu().ACC
        return acc(self.shape, self.dtype) if self.init_value is None else acc.init(self.init_value)

    def get_ref_aval(self):
        return self.to_jax().get_ref_aval()


def _count(value, what, name, minimum=1):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{what}: {name} must be an int >= {minimum}, got {value!r}.")
    return int(value)


def _num_barriers(value, what):
    if isinstance(value, (int, np.integer)):
        return (_count(value, what, "num_barriers"),)
    try:
        return tuple(_count(v, what, "num_barriers") for v in value)
    except TypeError:
        raise ValueError(f"{what}: num_barriers must be an int or a tuple of ints, got {value!r}.") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Barrier:
    """``num_barriers`` mbarriers in SMEM, each completing after ``num_arrivals`` arrivals.

    A TMA copy (``copy_gmem_to_smem``) arrives once when its bytes land; a
    warpgroup arrives with ``barrier_arrive``. ``orders_tensor_core=True`` also
    orders ``wgmma`` / tensor-core work around the barrier. Index the Ref
    (``bar.at[i]``) to pick one barrier.

    Raises:
      ValueError: ``num_arrivals`` or a ``num_barriers`` entry below 1.
    """

    num_arrivals: int = 1
    num_barriers: int | Sequence[int] = 1
    orders_tensor_core: bool = False

    def __post_init__(self):
        what = "Barrier"
        object.__setattr__(self, "num_arrivals", _count(self.num_arrivals, what, "num_arrivals"))
        object.__setattr__(self, "num_barriers", _num_barriers(self.num_barriers, what))
        if not isinstance(self.orders_tensor_core, bool):
            raise TypeError(f"{what}: orders_tensor_core must be a bool, got {self.orders_tensor_core!r}.")

    def to_jax(self):
        return _plgpu().Barrier(num_arrivals=self.num_arrivals, num_barriers=self.num_barriers,
                                orders_tensor_core=self.orders_tensor_core)

    def get_ref_aval(self):
        return self.to_jax().get_ref_aval()


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClusterBarrier:
    """A barrier shared by the blocks of a cluster along ``collective_axes``.

    Raises:
      ValueError: no collective axis, or counts below 1.
    """

    collective_axes: tuple
    num_barriers: int | Sequence[int] = 1
    num_arrivals: int = 1
    orders_tensor_core: bool = False
    leader_tracked: bool = False

    def __post_init__(self):
        what = "ClusterBarrier"
        axes = self.collective_axes
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        if not axes:
            raise ValueError(f"{what}: collective_axes must name at least one cluster axis.")
        object.__setattr__(self, "collective_axes", axes)
        object.__setattr__(self, "num_arrivals", _count(self.num_arrivals, what, "num_arrivals"))
        object.__setattr__(self, "num_barriers", _num_barriers(self.num_barriers, what))

    def to_jax(self):
        return _plgpu().ClusterBarrier(
            collective_axes=self.collective_axes, num_barriers=self.num_barriers,
            num_arrivals=self.num_arrivals, orders_tensor_core=self.orders_tensor_core,
            leader_tracked=self.leader_tracked)

    def get_ref_aval(self):
        return self.to_jax().get_ref_aval()


def to_jax_type(t, what: str = "scratch_shapes"):
    """One scratch type as JAX's Mosaic GPU lowering takes it.

    Ours (:class:`GPUScratchShape`, :class:`ACC`, :class:`Barrier`,
    :class:`ClusterBarrier`) convert; JAX's own types and ``None`` pass as
    they are.

    Raises:
      TypeError: a scratch type of another backend (``pallas_core.tpu.VMEM``...)
        or anything that is not a type.
    """
    if t is None:
        return None
    if isinstance(t, (GPUScratchShape, ACC, Barrier, ClusterBarrier)):
        return t.to_jax()
    if isinstance(t, ScratchShape):
        raise TypeError(f"{what}: {t.memory_space!r} is not a Mosaic GPU memory space; use "
                        "pallas_core.gpu.SMEM / GMEM, ACC or Barrier.")
    if hasattr(t, "get_ref_aval"):  # JAX's own types (GPUMemoryRef, Barrier, ACC...)
        return t
    raise TypeError(f"{what}: expected pallas_core.gpu.SMEM(...) / GMEM(...), ACC(...), "
                    f"Barrier(...), ClusterBarrier(...) or None, got {t!r}.")


def to_jax_types(tree, what: str = "scratch_shapes"):
    """:func:`to_jax_type` over a pytree of scratch types (lists, tuples, dicts)."""
    leaf = lambda x: x is None or not isinstance(x, (list, tuple, dict))
    return jax.tree.map(lambda t: to_jax_type(t, what), tree, is_leaf=leaf)
