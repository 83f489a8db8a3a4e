"""A grid-form ``pallas_call(backend="mosaic_gpu")`` in JAX's GPU interpret mode.

JAX 0.10.2's GPU interpreter runs kernels whose operands stay whole in GMEM
(``plgpu.kernel``), not ``pallas_call``\\ s with BlockSpecs. So the interpreted
grid form is built the way JAX's Mosaic GPU lowering builds the real one
(``lower_pipelined_jaxpr_to_module``): the ``"parallel"`` grid axes become the
kernel's grid of blocks (one warpgroup each), and the ``"arbitrary"`` axes
JAX's ``plgpu.emit_pipeline`` inside each block, which TMA-copies every
operand's block into SMEM ``max_concurrent_steps`` steps ahead, runs the
kernel body on the SMEM blocks and TMA-stores each output block when its
index changes. Same pipeline, same slot rotation, same TMA edge behaviour
(loads past the array read zeros, stores past it are dropped), so what the
interpreter shows is what the GPU does.

Not here (``NotImplementedError``): ``input_output_aliases`` (a ``plgpu.kernel``
takes none), element (Unblocked) block dims (JAX's lowering refuses them too).
"""
from __future__ import annotations

import jax
from jax import lax

from pallas_core import context
from pallas_core.gpu import memory
from pallas_core.gpu.kernel_context import MosaicGPUContext


def _plgpu():
    from jax.experimental.pallas import mosaic_gpu as plgpu
    return plgpu


def _axis_name(axis: int) -> str:
    return f"pallas_core_grid_{axis}"


def interpreted_call(call, jax_params, max_concurrent_steps: int, interpret_params):
    """``f(*args) -> outputs`` running resolved ``call`` in the interpret mode.

    Args:
      call: a :class:`pallas_core.call.ResolvedCall` for ``mosaic_gpu``.
      jax_params: JAX's ``plgpu.CompilerParams`` for the kernel.
      max_concurrent_steps: the pipeline depth (SMEM slots per operand).
      interpret_params: JAX's ``InterpretGPUParams``.

    Raises:
      NotImplementedError: aliased outputs or element block dims.
    """
    plgpu = _plgpu()
    if call.input_output_aliases:
        raise NotImplementedError(
            f"pallas_call {call.name!r} on mosaic_gpu: input_output_aliases do not run in the GPU "
            "interpret mode (JAX 0.10.2 interprets plgpu.kernel, which takes no aliases); "
            "they lower for cuda.")
    grid = tuple(call.grid)
    parallel = [a for a, s in enumerate(call.semantics) if s == "parallel"]
    sequential = [a for a, s in enumerate(call.semantics) if s != "parallel"]
    names = tuple(_axis_name(a) for a in parallel)

    def program_ids(seq_indices):
        ids = [None] * len(grid)
        for axis, name in zip(parallel, names):
            ids[axis] = lax.axis_index(name)
        for axis, index in zip(sequential, seq_indices):
            ids[axis] = index
        return tuple(ids)

    def jax_spec(m):
        if m.unblocked:
            raise NotImplementedError(f"{m.origin}: element (Unblocked) block dims do not lower to "
                                      "Mosaic GPU.")
        space = m.memory_space
        if space is not None and getattr(space, "name", "") in ("GMEM", "ANY"):
            return plgpu.BlockSpec(memory_space=plgpu.GMEM)
        transforms = getattr(space, "transforms", ())
        block = tuple(None if sq else b for b, sq in zip(m.block_shape, m.squeezed))
        index_map = m.index_map
        return plgpu.BlockSpec(block, lambda *idx: index_map(*program_ids(idx[:len(sequential)])),
                               memory_space=plgpu.SMEM, transforms=transforms)

    in_specs = [jax_spec(m) for m in call.in_mappings]
    out_specs = [jax_spec(m) for m in call.out_mappings]
    scratch = [memory.to_jax_type(s, "scratch_shapes") for s in call.scratch_shapes]
    n_in, n_out = len(in_specs), len(out_specs)
    pipeline_grid = tuple(grid[a] for a in sequential) or (1,)

    def body(*refs):
        ins, outs, scratch_refs = refs[:n_in], refs[n_in:n_in + n_out], refs[n_in + n_out:]

        def step(indices, *blocks):
            ctx = MosaicGPUContext(grid=grid, ids=program_ids(indices), interpret=True)
            with context.installed(ctx):
                call.kernel(*blocks, *scratch_refs)

        plgpu.emit_pipeline(step, grid=pipeline_grid, in_specs=in_specs, out_specs=out_specs,
                            max_concurrent_steps=max_concurrent_steps)(*ins, *outs)

    body.__name__ = call.name
    out_type = [jax.ShapeDtypeStruct(m.array_shape, m.dtype) for m in call.out_mappings]
    kernel = plgpu.kernel(body, out_type=out_type, scratch_types=scratch,
                          compiler_params=jax_params,
                          grid=tuple(grid[a] for a in parallel), grid_names=names,
                          interpret=interpret_params, kernel_name=call.name)
    return lambda *args: list(kernel(*args))
