"""The ``triton`` backend: generate, load and launch (docs/design.md §3.3)."""
from __future__ import annotations

import contextlib
import contextvars
import math

import jax
import numpy as np

from pallas_core import registry
from pallas_core.params import PARALLEL
from pallas_core.traits import LOOP, BackendTraits
from pallas_core.triton import codegen, inline_asm, program_order, runtime
from pallas_core.triton.params import schedule_options

# While set, every triton pallas_call traced records (name, source, constexprs, ...) here.
_CAPTURE: contextvars.ContextVar[list | None] = contextvars.ContextVar("triton_capture", default=None)


@contextlib.contextmanager
def capturing():
    records: list = []
    token = _CAPTURE.set(records)
    try:
        yield records
    finally:
        _CAPTURE.reset(token)


def _on_gpu() -> bool:
    """Whether to launch through jax_triton rather than Triton's CPU interpreter.

    Decided when the call is traced, by the default device's platform, like
    every platform default here: on a GPU host, a triton pallas_call inside a
    function jitted for (or exported to) the CPU has no CPU lowering. Pass
    ``backend="interpret"`` there. (``lax.platform_dependent`` cannot choose
    later: jax_triton does not import where jaxlib lacks its CUDA plugin.)
    """
    return jax.default_backend() == "gpu"


# Triton's CPU interpreter spends about 0.1 to 0.4 ms of Python on every tl operation
# (its front end builds and checks types for each one), whatever the tile size,
# while numpy runs an element-wise op on a tile of 2**18 float32 elements in
# about the same time. So there, fewer and bigger programs cost far less: the
# ops' tile heuristics ask :func:`wants_interpreter_tiles` and then cover a
# problem with :func:`interpreter_tiles`, tiles of up to this many elements
# (GPU tiles are sized for registers and shared memory instead, and stay as
# they are).
INTERPRETER_TILE_ELEMENTS = 1 << 18


def runs_in_interpreter() -> bool:
    """Whether a ``triton`` pallas_call traced now runs in Triton's CPU interpreter.

    True on a host whose default device is not a GPU, unless the kernels are
    being captured (:func:`capturing`: :func:`pallas_core.triton.source`,
    :func:`pallas_core.triton.compile` and tests reading launch parameters),
    which inspect or compile them for a GPU, where the GPU's tiles are the
    ones that count.
    """
    return not _on_gpu() and _CAPTURE.get() is None


def wants_interpreter_tiles(backend: str) -> bool:
    """Whether an op's kernels on ``backend``, traced now, take
    :func:`interpreter_tiles` instead of its heuristic's GPU tiles: ``triton``
    running in Triton's CPU interpreter (:func:`runs_in_interpreter`). Every
    other backend, and ``triton`` on a GPU or inside a capture, keeps the
    heuristic's tiles. An explicit tile argument or a tuning-cache entry
    still wins over either (the op's precedence, docs/design.md §5.4)."""
    return backend == "triton" and runs_in_interpreter()


def interpreter_tiles(extents, *, cap: int | None = None, floor: int = 16) -> tuple[int, ...]:
    """The interpreter's tiles of dims ``extents``: each dim whole, rounded up to
    a power of two, at most ``cap`` and at least ``floor`` (``tl.dot``'s
    minimum is 16). ``cap`` is the op's limit; None: the largest square tile
    within :data:`INTERPRETER_TILE_ELEMENTS` (512, for two-dimensional tiles
    made of these dims, as a matmul's)."""
    if cap is None:
        cap = math.isqrt(INTERPRETER_TILE_ELEMENTS)
    return tuple(_interpreter_tile(extent, cap, floor) for extent in extents)


def _interpreter_tile(extent: int, cap: int, floor: int) -> int:
    tile = 1 << max(0, int(extent) - 1).bit_length()
    return max(floor, min(cap, tile))


def launch_grid(call) -> tuple[int]:
    """One program per tile of the parallel grid axes, or the persistent program count."""
    sizes = [n for n, s in zip(call.grid, call.semantics) if s == PARALLEL]
    return (program_order.launch_size(sizes, schedule_options(call.params.triton).persistent),)


def run(call, args):
    schedule_options(call.params.triton)  # bad switches raise before the kernel is traced
    source, name, constexprs, params = codegen.generate(call)
    if call.debug:
        print(f"# pallas_core triton: kernel {name}, launch grid {launch_grid(call)}\n{source}")
    grid = launch_grid(call)
    # Scratch the generated kernel keeps in global memory (parameter s<k>) is an
    # extra output, one private slice per program; the rest lives in registers.
    memory_scratch = [s for k, s in enumerate(call.scratch_shapes) if f"s{k}" in params]
    scratch_avals = [jax.ShapeDtypeStruct((grid[0] * int(np.prod(s.shape)),), s.dtype)
                     for s in memory_scratch]
    out_avals = [jax.ShapeDtypeStruct(m.array_shape, m.dtype) for m in call.out_mappings]
    records = _CAPTURE.get()
    if records is not None:
        pointer_dtypes = [m.dtype for m in (*call.in_mappings, *call.out_mappings)]
        pointer_dtypes += [s.dtype for s in memory_scratch]
        records.append(dict(name=name, source=source, constexprs=constexprs, params=params,
                            pointer_dtypes=pointer_dtypes, grid=grid,
                            num_warps=call.params.triton.get("num_warps", 4),
                            num_stages=call.params.triton.get("num_stages", 3)))
    outs = runtime.launch(source, name, grid=grid, args=list(args),
                          out_avals=out_avals + scratch_avals,
                          aliases=call.input_output_aliases, constexprs=constexprs,
                          num_warps=call.params.triton.get("num_warps", 4),
                          num_stages=call.params.triton.get("num_stages", 3), on_gpu=_on_gpu())
    return list(outs)[:len(out_avals)]


# Our Triton lowering pads blocks to powers of two and masks them (any block
# shape), refuses dots under 16 (tl.dot's minimum), runs "arbitrary" grid axes
# as loops inside each program and passes scalar-prefetch tables as pointers.
registry.register_backend("triton", run, batch_grid=True, traits=BackendTraits(
    "triton", hardware="gpu", triton=True, min_dot=16, walk=LOOP))
# Assembly is emitted when the kernel is for a GPU (launched there, or captured by
# source / compile); Triton's CPU interpreter cannot run it.
registry.register_rule("elementwise_inline_asm", "triton",
                       lambda snippet, args: inline_asm.marked(snippet, args,
                                                               emit=not runs_in_interpreter()))
