"""The ``interpret`` backend: the grid as a loop of XLA ops (docs/design.md §3.2).

Each grid point slices its input blocks out of padded copies of the inputs,
runs the kernel body on Refs over them (and over the current output blocks),
and writes the output blocks back into the loop carry. The body is traced
once and its Refs discharged into pure values (``_jax_internals``), so the
program the interpreter builds holds no Refs and JAX transforms it freely. Padding
makes every block slice in bounds: edge blocks read NaN (floats) / the integer
minimum on input, and what they write past the array's end is cropped away.
A revisited output block keeps its value because outputs live in the carry.
Grid points run in the order of ``grid_analysis.execution_order``: a
simulated megacore (parallel axes split across cores with separate scratch)
and, optionally, a seeded shuffle of parallel points.
Outputs whose block stays put along a parallel axis
(``ResolvedCall.core_local_outputs``) start as a fresh copy on each simulated
core, as on a megacore TPU, and the copies go back in order, the last winning.
A grid dim computed under ``jit`` (a traced scalar) makes the loops ``while``
loops over traced trip counts (no shuffle then). Scalar-prefetch operands
(``ResolvedCall.num_scalar_prefetch``) are each core's own copy in SMEM, as on
a TPU: what a program writes to them the next program on that core reads
(paged attention keeps its DMA buffer index there).
Runs under ``jit``/``vmap`` on every platform.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_core import _jax_internals, context, grid_analysis, named_axes, registry
from pallas_core.memory import ScratchShape, as_scratch_shape, garbage_fill_value
from pallas_core.specs import BlockMapping, dynamic_axes
from pallas_core.traits import BackendTraits


class InterpretContext(context.KernelContext):
    backend = "interpret"

    def __init__(self, ids, grid, vma=()):
        self._ids = ids
        self._grid = grid
        self._vma = vma  # the manual axes the blocks vary over (see run)
        # pltpu.prng_seed / prng_random_bits state (pallas_core.tpu_ops), a Ref made
        # here, at the kernel's top level, so seeding inside pl.when or a loop
        # carries out of it.
        self.prng_state = jax.new_ref(_jax_internals.vary(jnp.zeros((3,), jnp.uint32), vma))

    def program_id(self, axis):
        if not 0 <= axis < len(self._grid):
            raise ValueError(f"program_id({axis}): the grid {self._grid} has rank {len(self._grid)}.")
        return self._ids[axis]

    def num_programs(self, axis):
        if not 0 <= axis < len(self._grid):
            raise ValueError(f"num_programs({axis}): the grid {self._grid} has rank {len(self._grid)}.")
        return self._grid[axis]

    def run_scoped(self, body, scratch_shapes):
        refs = [jax.new_ref(_jax_internals.vary(_fresh_scratch(as_scratch_shape(s)), self._vma))
                for s in scratch_shapes]
        return body(*refs)


def _garbage(shape, dtype):
    return jnp.full(shape, garbage_fill_value(dtype), dtype)


def _fresh_scratch(s: ScratchShape):
    """A scratch buffer as it starts: garbage, but semaphores (pltpu.SemaphoreType) at 0."""
    from pallas_core.dma import is_semaphore
    if is_semaphore(s.memory_space):
        return jnp.zeros(s.shape, s.dtype)
    return _garbage(s.shape, s.dtype)


def _padded_extent(m: BlockMapping, axis: int) -> tuple[int, int]:
    """(low, high) padding that keeps every legal block of ``m`` in bounds."""
    d, b = m.array_shape[axis], m.block_shape[axis]
    lo, hi = m.padding[axis]
    if m.element[axis]:
        return lo, hi + b - 1  # a block may start at the last (padded) element
    return 0, -(-d // b) * b - d


def _pad(x, m: BlockMapping):
    pads = [_padded_extent(m, a) for a in range(x.ndim)]
    if not any(lo or hi for lo, hi in pads):
        return x
    return jnp.pad(x, pads, constant_values=garbage_fill_value(x.dtype))


def _crop(x, m: BlockMapping):
    idx = tuple(slice(_padded_extent(m, a)[0], _padded_extent(m, a)[0] + d)
                for a, d in enumerate(m.array_shape))
    return x[idx]


def _starts(m: BlockMapping, ids):
    return tuple(jnp.asarray(s, jnp.int32) for s in m.element_starts(m.index_map(*ids)))


def _bounded_valid(m: BlockMapping, ids):
    """Where a block with BoundedSlice dims holds the array's elements (None: everywhere)."""
    if m.size_map is None:
        return None
    valid = jnp.ones(m.block_shape, jnp.bool_)
    for axis, (size, bounded) in enumerate(zip(m.size_map(*ids), m.bounded)):
        if bounded:
            valid &= lax.broadcasted_iota(jnp.int32, m.block_shape, axis) < size
    return valid


def _read_block(buf, m: BlockMapping, starts, valid):
    block = lax.dynamic_slice(buf, starts, m.block_shape)
    if valid is not None:  # past a BoundedSlice's size the block is unspecified
        block = jnp.where(valid, block, _garbage((), m.dtype))
    return block.reshape(m.ref_shape)


def _write_block(buf, m: BlockMapping, starts, value, valid):
    value = value.reshape(m.block_shape)
    if valid is not None:  # only a BoundedSlice's first size elements are written back
        value = jnp.where(valid, value, lax.dynamic_slice(buf, starts, m.block_shape))
    return lax.dynamic_update_slice(buf, value, starts)


def _pure_body(call, in_avals, out_avals, scratch_avals):
    """One grid point's work as a pure jaxpr:
    (ids, dynamic grid sizes, in blocks, out blocks, scratch) -> (out blocks, scratch,
    scalar-prefetch blocks).

    The kernel is traced once with fresh Refs over its blocks, then JAX's state
    discharge removes the Refs, so the loop below is made of plain XLA ops.
    """
    grid = call.grid
    dynamic = dynamic_axes(grid)
    varying = []  # the manual axes the blocks vary over, found while tracing

    def body(ids, sizes, in_blocks, out_blocks, scratch):
        in_refs = [jax.new_ref(v) for v in in_blocks]
        out_refs = [jax.new_ref(v) for v in out_blocks]
        scratch_refs = [jax.new_ref(v) for v in scratch]
        varying[:] = _jax_internals.varying_axes(*in_blocks, *out_blocks, *scratch)
        # Traced grid dims come in as inputs (pl.num_programs gives them), not closed over.
        traced = dict(zip(dynamic, sizes))
        kernel_ids, kernel_grid = call.kernel_ids(ids)
        kernel_grid = tuple(traced.get(call.num_batch_axes + a, d) for a, d in enumerate(kernel_grid))
        with context.installed(InterpretContext(kernel_ids, kernel_grid, tuple(varying))):
            call.kernel(*in_refs, *out_refs, *scratch_refs)
        return ([jax.freeze(r) for r in out_refs], [jax.freeze(r) for r in scratch_refs],
                [jax.freeze(r) for r in in_refs[:call.num_scalar_prefetch]])

    ids_avals = [jax.ShapeDtypeStruct((), jnp.int32)] * len(grid)
    closed = jax.make_jaxpr(body)(ids_avals, ids_avals[:len(dynamic)], in_avals, out_avals,
                                  scratch_avals)
    if call.grid_names:  # lax.axis_index(name) is the program id (the ids come first)
        closed = named_axes.without_axis_index(
            closed, {n: call.num_batch_axes + a for a, n in enumerate(call.grid_names)})
    if varying:
        closed = _jax_internals.vary_stored_values(closed, jax.sharding.get_abstract_mesh().axis_names)
    return _jax_internals.discharge_refs(closed)


def run(call, args):
    """Executes a resolved pallas_call (see ``pallas_core.call``) on XLA ops."""
    grid = call.grid
    params = call.interpret_params
    dynamic = dynamic_axes(grid)
    order = grid_analysis.execution_order(grid, call.semantics, params.num_cores,
                                          params.shuffle_seed)
    # Inside a shard_map that checks types, every buffer the loop carries varies over
    # the union of the operands' manual axes, as a JAX primitive's result would.
    vma = _jax_internals.varying_axes(*args)
    inputs = [_jax_internals.vary(_pad(jnp.asarray(x), m), vma) for x, m in zip(args, call.in_mappings)]
    outputs = []
    for o, m in enumerate(call.out_mappings):
        aliased = [i for i, oo in call.input_output_aliases.items() if oo == o]
        init = inputs[aliased[0]] if aliased else _pad(_garbage(m.array_shape, m.dtype), m)
        outputs.append(_jax_internals.vary(init, vma))
    scratch = [_jax_internals.vary(_fresh_scratch(s), vma) for s in call.scratch_shapes]
    if not dynamic and order.size == 0:  # a grid with an empty axis runs no program
        return [_crop(o, m) for o, m in zip(outputs, call.out_mappings)]
    varying = {}  # the blocks' type: varying over vma on the shard_map's mesh
    if vma:
        varying = dict(manual_axis_type=jax.typeof(inputs[0]).mat, sharding=jax.sharding.NamedSharding(
            jax.sharding.get_abstract_mesh(), jax.sharding.PartitionSpec()))
    aval = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, **varying)
    key = ("interpret", vma)
    pure = call.traces.get(key)
    if pure is None:
        pure = call.traces[key] = _pure_body(
            call, [aval(m.ref_shape, m.dtype) for m in call.in_mappings],
            [aval(m.ref_shape, m.dtype) for m in call.out_mappings],
            [aval(s.shape, s.dtype) for s in call.scratch_shapes])
    n_out, n_scratch = len(call.out_mappings), len(call.scratch_shapes)
    n_scalar = call.num_scalar_prefetch  # whole-array SMEM blocks, the first inputs
    scalars = [_read_block(x, m, _starts(m, [jnp.int32(0)] * len(grid)), None)
               for x, m in zip(inputs[:n_scalar], call.in_mappings)]

    def step(group, within, carry):
        outs, scr, scal = carry
        ids = order.ids(group, within)
        core_start = order.core_start(group, within)
        # Each simulated core has its own scratch, garbage when the core starts.
        scr = [jnp.where(core_start, _fresh_scratch(s), v)
               for s, v in zip(call.scratch_shapes, scr)]
        in_starts = [_starts(m, ids) for m in call.in_mappings]
        out_starts = [_starts(m, ids) for m in call.out_mappings]
        in_valid = [_bounded_valid(m, ids) for m in call.in_mappings]
        out_valid = [_bounded_valid(m, ids) for m in call.out_mappings]
        in_blocks = [_read_block(x, m, s, v)
                     for x, m, s, v in zip(inputs, call.in_mappings, in_starts, in_valid)]
        # Each core starts from the scalar-prefetch operands as passed, then keeps its writes.
        in_blocks[:n_scalar] = [jnp.where(core_start, first, kept)
                                for first, kept in zip(scalars, scal)]
        out_blocks = [_read_block(o, m, s, v)
                      for o, m, s, v in zip(outs, call.out_mappings, out_starts, out_valid)]
        for o in call.core_local_outputs:  # each core's own copy starts unwritten
            m = call.out_mappings[o]
            out_blocks[o] = jnp.where(core_start, _garbage(m.ref_shape, m.dtype), out_blocks[o])
        sizes = [jnp.asarray(grid[a], jnp.int32) for a in dynamic]
        results = jax.core.eval_jaxpr(pure.jaxpr, pure.consts, *ids, *sizes, *in_blocks,
                                      *out_blocks, *scr)
        new_blocks = results[:n_out]
        scr, scal = list(results[n_out:n_out + n_scratch]), list(results[n_out + n_scratch:])
        outs = [_write_block(o, m, s, v, ok)
                for o, m, s, v, ok in zip(outs, call.out_mappings, out_starts, new_blocks, out_valid)]
        return outs, scr, scal

    if call.debug:
        print(f"pallas_core interpret: kernel {call.name}, grid {grid}, "
              f"{order.size} program(s)\n{pure}")

    def run_group(group, carry):  # the points of one group, in row-major order
        return lax.fori_loop(0, order.group_size, lambda w, c: step(group, w, c), carry)

    outs, _, _ = lax.fori_loop(0, order.num_groups, run_group, (outputs, scratch, scalars))
    return [_crop(o, m) for o, m in zip(outs, call.out_mappings)]


# The kernel runs as JAX operations on any device, its grid walked in order;
# every block shape is taken (edge blocks are padded and cropped).
registry.register_backend("interpret", run, batch_grid=True, traits=BackendTraits(
    "interpret", hardware="any", interpreted=True, dynamic_grid=True))
