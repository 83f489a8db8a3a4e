"""``mosaic_tpu``, ``mosaic_gpu`` and ``pallas_triton``: our specs on JAX's Pallas.

Our resolved call (block mappings, grid, scratch, dimension semantics,
compiler params) is translated one-to-one onto ``jax.experimental.pallas``;
the kernel body runs under a context whose ``program_id`` etc. are JAX's
own, so kernels are written once for every backend. On ``pallas_triton``,
whose lowering does no bounds checks, operands whose blocks can overhang the
array get edge-masked Refs (:mod:`pallas_core.backends.edge_masks`). JAX picks its lowering
from the type of the compiler params, so each backend passes its own.

On ``mosaic_gpu`` the call runs where :mod:`pallas_core.gpu.target` says: JAX's
Mosaic GPU lowering on an sm_90+ GPU, and on a host without a GPU JAX's GPU
interpret mode (the grid translated as JAX's lowering translates it,
:mod:`pallas_core.gpu.grid_call`) while still lowering for ``cuda`` as JAX's
Mosaic GPU kernel.
"""
from __future__ import annotations

import dataclasses
import functools

import jax

from pallas_core import context, registry
from pallas_core.backends import edge_masks
from pallas_core.cost import as_cost_estimate
from pallas_core.dma import SemaphoreType, is_semaphore
from pallas_core.memory import TPU_SMEM, ScratchShape, as_scratch_shape
from pallas_core.specs import BlockMapping
from pallas_core.traits import LOOP, BackendTraits


def _jpl():
    from jax.experimental import pallas as jpl
    return jpl


class JaxPallasContext(context.KernelContext):
    def __init__(self, backend):
        self.backend = backend

    def program_id(self, axis):
        return _jpl().program_id(axis)

    def num_programs(self, axis):
        return _jpl().num_programs(axis)

    def run_scoped(self, body, scratch_shapes):
        types = [_scratch(s, self.backend) for s in scratch_shapes]
        return _jpl().run_scoped(body, *types)

    def run_state(self, fn, init):
        if self.backend == "mosaic_gpu":  # pallas_core.gpu.ACC.init(x) as JAX's accumulator
            from pallas_core.gpu.kernel_context import jax_initial_values
            init = jax_initial_values(init)
        return super().run_state(fn, init)

    def run_scoped_named(self, body, scratch_shapes, named, collective_axes):
        if collective_axes and self.backend != "mosaic_gpu":
            return super().run_scoped_named(body, scratch_shapes, named, collective_axes)
        types = [_scratch(s, self.backend) for s in scratch_shapes]
        named = {k: _scratch(v, self.backend) for k, v in named.items()}
        return _jpl().run_scoped(body, *types, collective_axes=collective_axes, **named)


def _memory_space(space, backend, origin):
    if space is None:
        return None
    if space.backend == "any":
        return _jpl().ANY
    if backend == "mosaic_tpu" and space.backend == "tpu":
        from jax.experimental.pallas import tpu as pltpu
        return {"VMEM": pltpu.VMEM, "SMEM": pltpu.SMEM, "HBM": pltpu.HBM,
                "ANY": _jpl().ANY}[space.name]
    if backend == "mosaic_gpu" and space.backend == "gpu":
        return space.to_jax()  # pallas_core.gpu.SMEM / GMEM
    raise ValueError(f"{origin}: memory space {space!r} does not exist on backend {backend!r}.")


def _scratch(s: ScratchShape, backend):
    s = as_scratch_shape(s)
    if backend == "pallas_triton":
        raise ValueError("scratch_shapes / run_scoped: the pallas_triton backend has no "
                         "scratch memory; carry values in the kernel instead.")
    if backend == "mosaic_gpu":
        from pallas_core.gpu import memory as gpu_memory
        return gpu_memory.to_jax_type(s, "scratch_shapes")
    if is_semaphore(s.memory_space):
        if backend != "mosaic_tpu":
            raise NotImplementedError(f"scratch_shapes: semaphores exist on the interpret and "
                                      f"mosaic_tpu backends, not on {backend!r}.")
        from jax.experimental.pallas import tpu as pltpu
        return pltpu.SemaphoreType[SemaphoreType(s.memory_space.name).name](s.shape)
    space = _memory_space(s.memory_space, backend, "scratch_shapes")
    return space(s.shape, s.dtype)


def _block_spec(m: BlockMapping, backend):
    jpl = _jpl()
    if m.unblocked and backend != "mosaic_tpu":
        raise ValueError(f"{m.origin}: element offsets (Unblocked indexing, Element or "
                         f"BoundedSlice block dims) are only supported on the "
                         f"interpret and mosaic_tpu backends, not {backend!r}.")
    if any(m.bounded):
        raise NotImplementedError(f"{m.origin}: BoundedSlice block dims run on the interpret "
                                  f"backend; JAX 0.10.2's {backend} pallas_call lowering has none.")
    block = []
    for b, sq, el, pad in zip(m.block_shape, m.squeezed, m.element, m.padding):
        if el and sq:
            raise NotImplementedError(f"{m.origin}: squeezed dims with Unblocked indexing are "
                                      f"not supported on {backend}.")
        elif el:
            block.append(jpl.Element(b, pad))
        else:
            block.append(jpl.squeezed if sq else b)
    pipeline_mode = None
    if m.pipeline_mode is not None and backend == "mosaic_tpu":
        p = m.pipeline_mode
        revisit = None if p.revisit is None else jpl.RevisitMode(p.revisit.value)
        pipeline_mode = jpl.Buffered(p.buffer_count, use_lookahead=p.use_lookahead, revisit=revisit)
    space = _memory_space(m.memory_space, backend, m.origin)
    if backend == "mosaic_gpu":  # pallas_core.gpu.BlockSpec's transforms ride on its memory space
        from jax.experimental.pallas import mosaic_gpu as plgpu
        return plgpu.BlockSpec(tuple(block), m.index_map, memory_space=space,
                               transforms=getattr(m.memory_space, "transforms", ()))
    return jpl.BlockSpec(tuple(block), m.index_map, pipeline_mode=pipeline_mode,
                         memory_space=space)


def _compiler_params(call, backend):
    p = call.params
    if backend == "mosaic_tpu":
        from jax.experimental.pallas import tpu as pltpu
        return pltpu.CompilerParams(dimension_semantics=call.semantics, **p.tpu)
    if backend == "mosaic_gpu":
        from pallas_core.gpu import params as gpu_params
        fields = dict(p.gpu)
        fields.pop("max_concurrent_steps", None)
        return gpu_params.to_jax(fields, call.semantics, mosaic_gpu_steps(call))
    if backend == "pallas_triton":
        # Passed explicitly: on CUDA JAX otherwise picks Mosaic GPU (docs/design.md §3.4).
        from jax.experimental.pallas import triton as pltriton
        return pltriton.CompilerParams(num_warps=p.triton.get("num_warps", 4),
                                       num_stages=p.triton.get("num_stages", 3))
    raise ValueError(f"not a JAX Pallas backend: {backend!r}")


def _cost_estimate(cost):
    cost = as_cost_estimate(cost)
    if cost is None:
        return None
    return _jpl().CostEstimate(flops=cost.flops, transcendentals=cost.transcendentals,
                               bytes_accessed=cost.bytes_accessed,
                               remote_bytes_transferred=cost.remote_bytes_transferred)


def _reading_scalar_refs(m: BlockMapping, grid_rank: int) -> BlockMapping:
    """``m`` whose index map takes JAX's scalar-prefetch Refs after the program ids and
    hands them to the scalar-reading index map of :mod:`pallas_core.tpu_prefetch`."""
    index_map = m.index_map

    def with_refs(*args):
        with context.scalar_refs(args[grid_rank:]):
            return index_map(*args[:grid_rank])

    return dataclasses.replace(m, index_map=with_refs)


def mosaic_gpu_steps(call) -> int:
    """The pipeline depth of a ``mosaic_gpu`` call (``max_concurrent_steps``).

    JAX's Mosaic GPU pipeline gives each step the next of ``max_concurrent_steps``
    SMEM slots, outputs included, and stores an output block from the slot of
    the step that last wrote it: an output block revisited on consecutive
    sequential steps (a reduction accumulating into it) would start each step
    in a different slot. Such calls get one slot (the default otherwise is 2);
    asking for more is an error.

    Raises:
      ValueError: ``max_concurrent_steps > 1`` given with an output block revisited
        along a sequential axis.
    """
    from pallas_core import grid_analysis
    given = call.params.gpu.get("max_concurrent_steps")
    sequential = {a for a, s in enumerate(call.semantics) if s != "parallel"}
    revisiting = []
    for m in call.out_mappings:
        table = grid_analysis.block_index_table(m, call.grid)
        if table is None or grid_analysis.revisited_axes(table, call.grid) & sequential:
            revisiting.append(m.origin)
    if not revisiting:
        return 2 if given is None else given
    if given is not None and given > 1:
        raise ValueError(
            f"pallas_call {call.name!r} on mosaic_gpu: {', '.join(revisiting)} revisit their blocks "
            f"along a sequential grid axis, which JAX's Mosaic GPU pipeline keeps in one SMEM slot "
            f"only with max_concurrent_steps=1 (got {given}); leave it unset or accumulate in "
            "scratch.")
    return 1


def _mosaic_gpu_run(call, args, fn):
    """``fn(*args)`` (JAX's lowering), or on a host without a GPU the interpret mode with
    ``fn`` as the ``cuda`` branch (:mod:`pallas_core.gpu.target`)."""
    from pallas_core.gpu import grid_call, runner, target
    choice = target.choose(None, f"pallas_call {call.name!r} on mosaic_gpu")
    if choice.kind == target.MOSAIC:
        return list(fn(*args))
    jax_params = _compiler_params(call, "mosaic_gpu")
    steps = jax_params.max_concurrent_steps

    def make(interpret_params):
        if interpret_params is None:
            return lambda *a: list(fn(*a))
        return grid_call.interpreted_call(call, jax_params, steps, interpret_params)

    return list(runner.run(choice, make, args, owner=call,
                           what=f"pallas_call {call.name!r} on mosaic_gpu"))


def run(call, args, backend):
    """``call`` on JAX's lowering for ``backend``. With ``call.num_scalar_prefetch = n``
    (mosaic_tpu only, :mod:`pallas_core.tpu_prefetch`) the first ``n`` inputs are the
    scalar-prefetch operands: they go to JAX's ``PrefetchScalarGridSpec``, whose index
    maps take them after the program ids."""
    jpl = _jpl()
    n_scalar = call.num_scalar_prefetch
    in_mappings = [_reading_scalar_refs(m, len(call.grid)) if n_scalar else m
                   for m in call.in_mappings[n_scalar:]]
    out_mappings = [_reading_scalar_refs(m, len(call.grid)) if n_scalar else m
                    for m in call.out_mappings]
    mappings = list(call.in_mappings) + list(call.out_mappings)

    def kernel(*refs):
        with context.installed(JaxPallasContext(backend)):
            if backend == "pallas_triton":  # JAX's Triton lowering does no bounds checks
                refs = edge_masks.wrap(refs[:len(mappings)], mappings, len(call.grid)) + list(
                    refs[len(mappings):])
            call.kernel(*refs)

    kernel.__name__ = call.name
    out_shape = [jax.ShapeDtypeStruct(m.array_shape, m.dtype) for m in call.out_mappings]
    specs = dict(grid=call.grid,
                 in_specs=[_block_spec(m, backend) for m in in_mappings],
                 out_specs=[_block_spec(m, backend) for m in out_mappings],
                 scratch_shapes=[_scratch(s, backend) for s in call.scratch_shapes])
    if n_scalar:
        if backend != "mosaic_tpu":
            raise NotImplementedError(f"PrefetchScalarGridSpec: JAX's {backend} lowering has no "
                                      "scalar prefetch.")
        from jax.experimental.pallas import tpu as pltpu
        specs = dict(grid_spec=pltpu.PrefetchScalarGridSpec(n_scalar, **specs))
    fn = jpl.pallas_call(
        kernel,
        out_shape=out_shape,
        **specs,
        input_output_aliases=dict(call.input_output_aliases),
        compiler_params=_compiler_params(call, backend),
        name=call.name,
        debug=call.debug,
        cost_estimate=_cost_estimate(call.cost_estimate),
        metadata=call.metadata,
    )
    if backend == "mosaic_gpu":
        return _mosaic_gpu_run(call, args, fn)
    return list(fn(*args))


_TRAITS = (
    # Mosaic TPU: (8, 128) vector-register tiles, the grid in order on a core,
    # scalar prefetch into SMEM (vector memory is not read as scalars).
    BackendTraits("mosaic_tpu", hardware="tpu", tile=(8, 128), scalar_memory=TPU_SMEM, dynamic_grid=True,
                  through_jax=True),
    # Mosaic GPU: its lowering reports its own block limits (TMA boxes, swizzles).
    # Sequential axes are pipelined in order (an output revisited along them gets one
    # pipeline slot: mosaic_gpu_steps); no scalar prefetch. Runs interpreted on a
    # host without a GPU (pallas_core.gpu.target).
    BackendTraits("mosaic_gpu", hardware="gpu", scalar_prefetch=False, through_jax=True),
    # JAX's Triton lowering: power-of-two tensors only, every grid point
    # concurrent (no accumulation across grid steps), no scalar prefetch.
    BackendTraits("pallas_triton", hardware="gpu", triton=True, power_of_two_blocks=True,
                  sequential_grid=False, walk=LOOP, scalar_prefetch=False, through_jax=True),
)

for _traits in _TRAITS:
    registry.register_backend(_traits.name, functools.partial(run, backend=_traits.name),
                              traits=_traits)
