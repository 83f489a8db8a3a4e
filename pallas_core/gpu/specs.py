"""``pallas_core.gpu.BlockSpec``: a BlockSpec with Mosaic GPU's ``transforms``,
``delay_release`` and ``collective_axes`` (JAX 0.10.2's ``plgpu.BlockSpec``).

It is a :class:`pallas_core.BlockSpec`, so a grid-form ``pallas_call`` takes
it (its transforms ride on the memory space to JAX's BlockSpec:
:meth:`pallas_core.gpu.memory.GPUMemorySpace.with_transforms`), and
:func:`pallas_core.gpu.emit_pipeline` / ``emit_pipeline_warp_specialized``
turn it into JAX's (:func:`to_jax_spec`).
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import jax

from pallas_core import specs
from pallas_core.gpu import memory


class BlockSpec(specs.BlockSpec):
    """``BlockSpec(block_shape=None, index_map=None, *, memory_space=None,
    pipeline_mode=None, transforms=(), delay_release=0, collective_axes=())``.

    Args:
      block_shape, index_map, memory_space, pipeline_mode: as
        :class:`pallas_core.BlockSpec`; ``memory_space`` ``pallas_core.gpu.SMEM``
        (the default inside pipelines: blocks are copied there by TMA) or
        ``GMEM`` (the operand stays in global memory).
      transforms: the SMEM layout of each block (``TilingTransform``,
        ``SwizzleTransform``), checked against the block shape when the
        block shape is known here.
      delay_release: pipeline steps a block's slot stays reserved after its
        step (1 when the body leaves its ``wgmma`` in flight); must be below the
        pipeline's ``max_concurrent_steps``.
      collective_axes: cluster axes along which every block loads the same
        block (collective TMA); warp-specialized pipelines only.

    Raises:
      TypeError / ValueError: as :class:`pallas_core.BlockSpec`, and for a
        negative ``delay_release`` or transforms that do not fit the block.
    """

    def __init__(self, block_shape=None, index_map=None, *, memory_space=None,
                 pipeline_mode=None, transforms: Sequence[Any] = (), delay_release: int = 0,
                 collective_axes: Hashable | tuple[Hashable, ...] = ()):
        super().__init__(block_shape, index_map, memory_space=memory_space,
                         pipeline_mode=pipeline_mode)
        if isinstance(delay_release, bool) or not isinstance(delay_release, int) or delay_release < 0:
            raise ValueError(f"BlockSpec: delay_release must be an int >= 0, got {delay_release!r}.")
        if isinstance(collective_axes, str) or not isinstance(collective_axes, (tuple, list)):
            collective_axes = (collective_axes,)
        if memory_space is not None and not isinstance(memory_space, memory.GPUMemorySpace):
            if hasattr(memory_space, "backend"):  # another backend's pallas_core space
                raise TypeError(f"BlockSpec: memory_space must be pallas_core.gpu.SMEM or GMEM, "
                                f"got {memory_space!r}.")
        transforms = tuple(transforms or ())
        _check_transform_types(transforms)
        if transforms and self.block_shape is not None:
            kept = tuple(d for d in self.block_shape if d is not None)
            if all(isinstance(d, int) for d in kept):
                _check_tiling(kept, transforms)
        self.transforms = transforms
        self.delay_release = delay_release
        self.collective_axes = tuple(collective_axes)
        if transforms:  # the grid form reads the transforms off the memory space
            space = memory_space if isinstance(memory_space, memory.GPUMemorySpace) else memory.SMEM
            self.memory_space = space.with_transforms(transforms)

    def __repr__(self):
        return (f"gpu.BlockSpec(block_shape={self.block_shape}, transforms={self.transforms}, "
                f"delay_release={self.delay_release}, collective_axes={self.collective_axes})")


def _check_transform_types(transforms):
    for t in transforms:
        if not memory.is_transform(t):
            raise TypeError(f"BlockSpec: transforms must be plgpu transforms such as "
                            f"TilingTransform((8, 64)) or SwizzleTransform(128), got {t!r}.")


def _check_tiling(shape, transforms):
    """Tilings must divide the block's trailing dims (swizzles depend on the dtype,
    checked when the operand is known, by JAX's pipeline)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    for t in transforms:
        if isinstance(t, plgpu.TilingTransform):
            tiling = tuple(t.tiling)
            trailing = shape[len(shape) - len(tiling):]
            if len(tiling) > len(shape) or any(d % r for d, r in zip(trailing, tiling)):
                raise ValueError(f"BlockSpec: {t} needs the block's last {len(tiling)} dims to be "
                                 f"multiples of {tiling}, got block {shape}.")
            shape = (*shape[:len(shape) - len(tiling)], *(d // r for d, r in zip(trailing, tiling)),
                     *tiling)


def to_jax_spec(spec, what: str = "in_specs"):
    """A spec as JAX's Mosaic GPU pipelines take it (``plgpu.BlockSpec``).

    Ours (this class, or a plain :class:`pallas_core.BlockSpec`) convert; JAX's
    pass as they are.

    Raises:
      TypeError: anything else, or a spec with element (Unblocked) indexing.
    """
    from jax.experimental.pallas import mosaic_gpu as plgpu
    from jax._src.pallas import core as jax_pallas_core
    if isinstance(spec, jax_pallas_core.BlockSpec):
        return spec
    if not isinstance(spec, specs.BlockSpec):
        raise TypeError(f"{what}: expected a pallas_core.gpu.BlockSpec, got {spec!r}.")
    if isinstance(spec.indexing_mode, specs.Unblocked) or any(
            not (d is None or isinstance(d, int)) for d in spec.block_shape or ()):
        raise TypeError(f"{what}: Mosaic GPU pipelines take blocked specs (ints or None per "
                        f"dim), got {spec!r}.")
    space = spec.memory_space
    jax_space = space.to_jax() if isinstance(space, memory.GPUMemorySpace) else space
    return plgpu.BlockSpec(spec.block_shape, spec.index_map, memory_space=jax_space,
                           transforms=getattr(spec, "transforms", ()),
                           delay_release=getattr(spec, "delay_release", 0),
                           collective_axes=getattr(spec, "collective_axes", ()))


def to_jax_specs(tree, what: str = "in_specs"):
    """:func:`to_jax_spec` over a pytree of specs (lists, tuples, dicts)."""
    is_spec = lambda x: isinstance(x, specs.BlockSpec) or not isinstance(x, (list, tuple, dict))
    return jax.tree.map(lambda s: to_jax_spec(s, what), tree, is_leaf=is_spec)
