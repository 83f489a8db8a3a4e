"""pallas_core: the Pallas programming model, implemented here.

Backend-neutral names (``import pallas_core as pl``), as in JAX's Pallas::

    pl.pallas_call, pl.BlockSpec, pl.Blocked, pl.Unblocked, pl.GridSpec,
    pl.program_id, pl.num_programs, pl.cdiv, pl.when, pl.loop, pl.ds,
    pl.load, pl.store, pl.multiple_of, pl.dot, pl.run_scoped, pl.CompilerParams

JAX 0.10.2's other names: block dims ``pl.Element``, ``pl.Squeezed`` / ``pl.squeezed``,
``pl.BoundedSlice``, ``pl.Blocked(b)``; ``pl.Buffered`` (a BlockSpec's pipeline_mode),
``pl.CostEstimate``, ``pl.ANY`` / ``pl.MemorySpace``, ``pl.no_block_spec``,
``pl.debug_print``, ``pl.semaphore_signal`` / ``semaphore_wait`` / ``semaphore_read``.

Ours: ``pl.backend_traits(name)`` (a :class:`pl.BackendTraits`): what a backend
declared about itself (block rules, tiling, grid order, scalar memory), which
kernels ask instead of comparing backend names (docs/design.md §10).

Backend-specific modules: ``pallas_core.tpu`` (VMEM, SMEM, HBM, CompilerParams,
PrefetchScalarGridSpec, roll, prng_seed / prng_random_bits, make_async_copy /
async_copy / sync_copy, SemaphoreType), ``pallas_core.triton`` (CompilerParams,
atomics, JAX's ``pallas.triton`` load / store / dot / debug_barrier / max_contiguous /
approx_tanh / elementwise_inline_asm), ``pallas_core.gpu`` (Mosaic GPU: ``kernel``, SMEM / ACC /
Barrier, TMA copies, ``wgmma``, pipelines; JAX's GPU interpret mode on a CPU host).
See docs/pallas_core.md (section 13 lists what stays absent, and why).
"""
# First: a JAX outside the verified range is named before anything else can fail on it.
from pallas_core import _versions
_versions.check_jax_version()
from pallas_core import gpu, tpu, triton
# The backends register their runners and primitive rules (pallas_core.registry) when
# imported: this is the one place that imports them all.
from pallas_core.backends import interpret as _interpret_backend, jax_pallas as _jax_pallas_backends
from pallas_core.triton import backend as _triton_backend, markers as _triton_markers
from pallas_core.arith import align_to, reciprocal
from pallas_core.backends import BACKENDS, TRITON_BACKENDS, backend_traits, default_backend
from pallas_core.block_dims import BoundedSlice, Buffered, Element, RevisitMode, Squeezed, squeezed
from pallas_core.call import pallas_call
from pallas_core.cost import CostEstimate
from pallas_core.debugging import debug_print
from pallas_core.dma import semaphore_read, semaphore_signal, semaphore_wait
from pallas_core.params import ARBITRARY, PARALLEL, CompilerParams, InterpretParams
from pallas_core.primitives import (cdiv, dot, ds, dslice, load, loop, multiple_of, next_power_of_2,
                                    num_programs, program_id, run_scoped, run_state, store, when)
from pallas_core.memory import ANY, MemorySpace, empty, empty_like
from pallas_core.primitives import _RefSlice as Slice  # what pl.ds makes: JAX's own Slice
from pallas_core.specs import BlockDim, Blocked, BlockSpec, GridSpec, Unblocked
from pallas_core.traits import BackendTraits

# JAX's ``pl.no_block_spec`` (the default of every in/out spec): the whole array,
# which is what a None spec means here.
no_block_spec = None

__all__ = [
    "ANY", "BackendTraits", "BlockDim", "BoundedSlice", "Buffered", "CostEstimate", "Element", "MemorySpace", "RevisitMode", "Squeezed",
    "align_to", "debug_print", "empty", "empty_like", "no_block_spec", "reciprocal",
    "semaphore_read", "semaphore_signal", "semaphore_wait",
    "Slice", "squeezed",
    "ARBITRARY", "BACKENDS", "TRITON_BACKENDS", "BlockSpec", "Blocked", "CompilerParams", "GridSpec", "InterpretParams", "PARALLEL",
    "Unblocked", "backend_traits", "cdiv", "default_backend", "dot", "ds", "dslice", "gpu", "load", "loop",
    "multiple_of", "next_power_of_2", "num_programs", "pallas_call", "program_id", "run_scoped", "run_state", "store", "tpu", "triton", "when",
]
