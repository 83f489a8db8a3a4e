"""The kernel context of Mosaic GPU kernels: what ``pl.program_id``, ``pl.run_scoped``,
``pl.run_state`` mean inside ``pallas_core.gpu.kernel`` and the interpreted grid form.

Installed (:func:`pallas_core.context.installed`) while the body is traced, so
pallas_core's backend-neutral names dispatch to JAX's Mosaic GPU ones:

* ``pl.program_id(i)``: the block's index along grid axis ``i``, as
  ``lax.axis_index(grid_names[i])`` (JAX's ``program_id`` is the lowering's
  block id, but JAX 0.10.2's GPU interpreter answers 0 for it; the axis index
  is right on both); in the interpreted grid form, the ids the pipeline
  passes. ``pl.num_programs(i)``: the grid's size. Cluster and warpgroup
  indices are ``lax.axis_index(name)`` of their names.
* ``pl.run_scoped(body, *types, collective_axes=(), **named_types)``: JAX's
  ``run_scoped``, our types converted (:func:`pallas_core.gpu.memory.to_jax_type`);
  ``collective_axes="wg"`` makes one allocation shared by the warpgroups.
* ``pl.run_state(fn)(init)``: JAX's ``run_state``; in the interpret mode,
  where JAX 0.10.2's interpreter has no rule for it, accumulator operands
  (``ACC.init(x)``) become a scoped ``ACC`` written with ``x`` first and read
  back after ``fn`` (reading an accumulator waits for its ``wgmma``\\ s, as
  ``run_state`` does on the GPU).

``interpret`` tells the pallas_core.gpu wrappers
(:mod:`pallas_core.gpu.primitives`) which spelling the tracing path needs.
"""
from __future__ import annotations

import jax
from jax import lax

from pallas_core import context
from pallas_core.gpu import memory


def _jpl():
    from jax.experimental import pallas as jpl
    return jpl


class MosaicGPUContext(context.KernelContext):
    """Kernel-side services of a Mosaic GPU kernel being traced.

    Args:
      grid: the kernel's grid (ints).
      grid_names: one axis name per grid dim (``pallas_core.gpu.kernel``), or
        None where ``ids`` are given.
      ids: the program ids, where the caller computes them (the grid form).
      interpret: the kernel is traced for JAX's GPU interpret mode.
    """

    backend = "mosaic_gpu"

    def __init__(self, *, grid, grid_names=None, ids=None, interpret: bool):
        self.grid = tuple(grid)
        self.grid_names = tuple(grid_names) if grid_names is not None else None
        self.ids = None if ids is None else tuple(ids)
        self.interpret = interpret

    def _check(self, what, axis):
        if not 0 <= axis < len(self.grid):
            raise ValueError(f"{what}({axis}): the kernel's grid {self.grid} has rank "
                             f"{len(self.grid)}; cluster and warpgroup indices are "
                             "lax.axis_index(name) of their names.")

    def program_id(self, axis):
        self._check("program_id", axis)
        if self.ids is not None:
            return self.ids[axis]
        return lax.axis_index(self.grid_names[axis])

    def num_programs(self, axis):
        self._check("num_programs", axis)
        return self.grid[axis]

    def run_scoped(self, body, scratch_shapes):
        return self.run_scoped_named(body, scratch_shapes, {}, ())

    def run_scoped_named(self, body, scratch_shapes, named, collective_axes):
        types = memory.to_jax_types(list(scratch_shapes), "run_scoped")
        named = memory.to_jax_types(dict(named), "run_scoped")
        return _jpl().run_scoped(body, *types, collective_axes=collective_axes, **named)

    def run_state(self, fn, init):
        if not self.interpret:
            return _jpl().run_state(fn)(jax_initial_values(init))
        return _run_state_interpreted(fn, init)


def interpreting() -> bool:
    """Whether the kernel being traced is traced for JAX's GPU interpret mode."""
    ctx = context._CURRENT.get()
    return isinstance(ctx, MosaicGPUContext) and ctx.interpret


def _is_acc(x) -> bool:
    from jax.experimental.pallas import mosaic_gpu as plgpu
    return isinstance(x, (memory.ACC, plgpu.ACC))


def jax_initial_values(init):
    return jax.tree.map(lambda x: x.to_jax() if isinstance(x, memory.ACC) else x, init,
                        is_leaf=_is_acc)


def _acc_value(x):
    return x.init_value if isinstance(x, memory.ACC) else x._init


def _run_state_interpreted(fn, init):
    from jax._src.state import primitives as state_primitives
    from jax._src.state import types as state_types
    from jax.experimental.pallas import mosaic_gpu as plgpu
    leaves, tree = jax.tree.flatten(init, is_leaf=_is_acc)
    for leaf in leaves:
        if not _is_acc(leaf) or _acc_value(leaf) is None or _acc_value(leaf) is state_types.uninitialized:
            raise NotImplementedError(
                "pl.run_state in the GPU interpret mode takes wgmma accumulators "
                f"(plgpu.ACC.init(value)) only, got {leaf!r}; carry other values through "
                "lax.fori_loop or keep them in SMEM scratch (pl.run_scoped).")

    def body(*refs):
        for ref, leaf in zip(refs, leaves):
            state_primitives.ref_set(ref, (), _acc_value(leaf))  # a plain store into the registers
        fn(jax.tree.unflatten(tree, list(refs)))
        return [ref[...] for ref in refs]  # waits for the warpgroup's wgmmas

    finals = _jpl().run_scoped(body, *[plgpu.ACC(leaf.shape, leaf.dtype) for leaf in leaves])
    return jax.tree.unflatten(tree, list(finals))
