"""The ``triton`` backend: generate, load and launch (DESIGN 2.3)."""
from __future__ import annotations

import contextlib
import contextvars

import jax
import numpy as np

from pallas_core.params import PARALLEL
from pallas_core.triton import codegen, program_order, runtime
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
