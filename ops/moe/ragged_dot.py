"""``ops.ragged_dot``: the grouped matmul of mixture-of-experts layers.

Tokens sorted by expert form contiguous groups of rows of ``lhs``; group
``g`` is multiplied by its own ``rhs[g]``. This is ``jax.lax.ragged_dot``'s
meaning, with ``group_offset`` implemented (expert parallelism: ``rhs``
holds only the groups this call owns, rows of the others are zero).

Kernels (the grouped GEMM of megablox, "MegaBlocks: Efficient Sparse
Training with Mixture-of-Experts", Gale et al. 2023, arXiv:2211.15841,
section 5, as JAX's TPU ``gmm`` / ``tgmm`` implement it; our own code on
the tiled-matmul core, :mod:`ops.matmul.tiled`):

* forward, ``gmm``: programs over (row-tile visit, column tile); the row
  tiles follow the group boundaries through a visit table built on the
  device from ``group_sizes`` (:mod:`ops.moe.group_table`) and read through
  scalar prefetch. A tile that a boundary cuts is visited once per group,
  each visit storing only its group's rows; an empty group has no visit; no
  group is padded in memory.
* backward: ``dlhs = gmm(dout, rhs^T)`` (the same kernel, contracting N) and
  ``drhs[g] = lhs_g^T @ dout_g`` (``tgmm``: programs over (group, K tile, N
  tile), the group's rows reduced inside; :mod:`ops.moe.tgmm`). Every output
  block has one writer: no atomics.
"""
from __future__ import annotations

import dataclasses
import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import pallas_core as pl
from ops._checks import check_array, check_float_dtype, check_same_dtype
from ops._op import (Call, Implementation, Op, Problem, Tuning, register, register_implementation,
                     vjp_training)
from ops._partitioning import block_index, psum, reduced_axes, run
from ops.matmul import tiled
from ops.matmul import mosaic_gpu
from ops.matmul.config import check_block_sizes
from ops.matmul.mosaic_gpu_config import MosaicMatmulConfig
from ops.matmul.mosaic_gpu_ragged import MosaicRaggedConfig, RaggedKernels
from ops.moe import gmm, group_table, tgmm
from ops.moe.config import RaggedDotConfig
from ops.moe.reference import ragged_dot_reference

_OP = "ragged_dot"
_PRECISION_NAMES = ("default", "high", "highest", "bfloat16", "tensorfloat32", "float32", "fastest")


def ragged_dot(lhs, rhs, group_sizes, precision=None, preferred_element_type=None,
               group_offset=None, *, implementation=None, block_sizes=None) -> jax.Array:
    """Grouped matmul: ``out[i] = lhs[i] @ rhs[g(i)]`` where row ``i`` is in group ``g(i)``.

    A drop-in for ``jax.lax.ragged_dot``. Group ``g`` is rows
    ``[sum(group_sizes[:g]), sum(group_sizes[:g + 1]))`` of ``lhs``.

    Args:
      lhs: ``[M, K]`` float32 / bfloat16 / float16 (tokens sorted by group).
      rhs: ``[G_local, K, N]``, lhs's dtype: one matrix per owned group.
      group_sizes: integer ``[G]`` (``G = G_local`` without ``group_offset``),
        rows per group, ``sum(group_sizes) <= M``; rows at or past the sum
        are zero in the output.
      precision: as ``jax.lax.ragged_dot`` (None, a ``lax.Precision`` or its
        name, or a pair); it reaches the ``"xla"`` implementation. The
        kernels accumulate in float32 and multiply float32 operands in IEEE
        float32 whatever it says.
      preferred_element_type: the output dtype (float32 / bfloat16 /
        float16); None: lhs's dtype.
      group_offset: None, or an int32 scalar or ``[1]``: this call owns
        groups ``[group_offset, group_offset + G_local)`` of ``group_sizes``
        (expert parallelism); rows of the other groups are zero in the
        output (not left unwritten), so a sum over expert shards is the full
        product. Group ids outside ``[0, G)`` own no rows.
      implementation: None (the default: "xla" on a CPU; on a GPU the fastest
        measured implementation that can run the call, which
        ``ops.resolve_implementation`` names with its measurement; "mosaic_tpu"
        on a TPU; docs/design.md §5.2), "xla" (``jax.lax.ragged_dot``), "interpret", "triton",
        "pallas_triton" (JAX's Triton lowering, which has no scalar prefetch:
        programs per output tile looping over the tile's groups, the tables as
        ordinary operands, blocks padded to powers of two), "mosaic_tpu",
        "mosaic_gpu" (sm_90 warp-specialized kernels walking the group table,
        :mod:`ops.matmul.mosaic_gpu_ragged`: bfloat16 / float16, a
        ``MosaicRaggedConfig`` as block_sizes; NotImplementedError otherwise). Or a
        sequence of these tried in order (:mod:`ops._implementation`).
      block_sizes: optional ``(block_m, block_n, block_k)`` or a
        :class:`~ops.moe.config.RaggedDotConfig` (tiles, warps, stages, the
        walk); None takes the tuning cache's entry, else the heuristic (by
        M / G, K and N).

    Returns:
      ``[M, N]`` in ``preferred_element_type``.

    Raises:
      TypeError: non-array inputs, lhs not float32 / bfloat16 / float16,
        rhs's dtype not lhs's, non-integer group_sizes or group_offset, a
        non-float preferred_element_type, a bad precision.
      ValueError: lhs not rank 2, rhs not rank 3, K mismatch, group_sizes not
        ``[G]`` (``G`` = rhs's groups without group_offset, at least that
        with it), group_offset not a scalar or ``[1]``, bad block_sizes or
        implementation.

    Differentiable in lhs and rhs (``jax.custom_vjp``; the backward pass is
    two Pallas kernels); jit- and vmap-compatible.
    """
    out_dtype, explicit = _check(lhs, rhs, group_sizes, precision, preferred_element_type,
                                 group_offset, block_sizes)
    return OP.run(implementation, lhs=lhs, rhs=rhs, group_sizes=group_sizes, precision=precision,
                  out_dtype=out_dtype, group_offset=group_offset, explicit=explicit)


def _check(lhs, rhs, group_sizes, precision, preferred_element_type, group_offset, block_sizes):
    """Validates every argument before anything is traced; returns (out dtype, explicit config)."""
    check_array(lhs, "lhs", _OP)
    check_array(rhs, "rhs", _OP)
    check_array(group_sizes, "group_sizes", _OP)
    check_float_dtype(lhs, "lhs", _OP)
    check_same_dtype(rhs, lhs, "rhs", "lhs", _OP)
    if lhs.ndim != 2:
        raise ValueError(f"{_OP}: lhs must have rank 2 [M, K], got shape {tuple(lhs.shape)}.")
    if rhs.ndim != 3:
        raise ValueError(f"{_OP}: rhs must have rank 3 [G, K, N], got shape {tuple(rhs.shape)}.")
    if lhs.shape[1] != rhs.shape[1]:
        raise ValueError(f"{_OP}: lhs's K ({lhs.shape[1]}) must equal rhs's K (dim 1, "
                         f"{rhs.shape[1]}); got lhs {tuple(lhs.shape)} and rhs {tuple(rhs.shape)}.")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise TypeError(f"{_OP}: group_sizes must have an integer dtype (int32), got "
                        f"{np.dtype(group_sizes.dtype).name}.")
    g_local = rhs.shape[0]
    if group_offset is None:
        if tuple(group_sizes.shape) != (g_local,):
            raise ValueError(f"{_OP}: group_sizes must have shape [G] = ({g_local},) (rhs's "
                             f"groups), got {tuple(group_sizes.shape)}.")
    else:
        if group_sizes.ndim != 1 or group_sizes.shape[0] < g_local:
            raise ValueError(f"{_OP}: with group_offset, group_sizes must list every group, "
                             f"shape [G] with G >= {g_local} (rhs's groups), got "
                             f"{tuple(group_sizes.shape)}.")
        if isinstance(group_offset, (numbers.Integral, np.integer)) and not isinstance(
                group_offset, bool):
            pass
        else:
            check_array(group_offset, "group_offset", _OP)
            if not jnp.issubdtype(group_offset.dtype, jnp.integer):
                raise TypeError(f"{_OP}: group_offset must be an integer (int32) scalar or [1], "
                                f"got dtype {np.dtype(group_offset.dtype).name}.")
            if tuple(group_offset.shape) not in ((), (1,)):
                raise ValueError(f"{_OP}: group_offset must be a scalar or have shape [1], got "
                                 f"{tuple(group_offset.shape)}.")
    _check_precision(precision)
    if preferred_element_type is None:
        out_dtype = np.dtype(lhs.dtype)
    else:
        try:
            out_dtype = np.dtype(jnp.dtype(preferred_element_type))
        except TypeError:
            raise TypeError(f"{_OP}: preferred_element_type must be a float dtype, got "
                            f"{preferred_element_type!r}.") from None
        if out_dtype not in (np.dtype(jnp.float32), np.dtype(jnp.bfloat16),
                             np.dtype(jnp.float16)):
            raise TypeError(f"{_OP}: preferred_element_type must be float32, bfloat16 or "
                            f"float16, got {out_dtype.name}.")
    return out_dtype, _check_block_sizes(block_sizes)


def _check_precision(precision):
    def ok(p):
        return p is None or isinstance(p, lax.Precision) or (
            isinstance(p, str) and p.lower() in _PRECISION_NAMES)
    if ok(precision) or (isinstance(precision, (tuple, list)) and len(precision) == 2
                         and all(ok(p) for p in precision)):
        return
    raise TypeError(f"{_OP}: precision must be None, a jax.lax.Precision (or its name) or a "
                    f"pair of them, got {precision!r}.")


def _check_block_sizes(block_sizes):
    if isinstance(block_sizes, MosaicMatmulConfig):  # implementation="mosaic_gpu"'s tiles
        block_sizes.check(_OP)
        return block_sizes
    sizes = check_block_sizes(block_sizes, _OP, RaggedDotConfig)
    return RaggedDotConfig(*sizes) if isinstance(sizes, tuple) else sizes


def _ragged_dot_on(impl, lhs, rhs, group_sizes, precision, out_dtype, group_offset, explicit,
                   products=None):
    """The checked call on one implementation; ``products``: another core's kernels
    (:class:`_Kernel`), None for the tiled core's."""
    offset = None if group_offset is None else jnp.reshape(
        jnp.asarray(group_offset), ()).astype(jnp.int32)
    if impl == "xla" or lhs.size == 0 or rhs.size == 0:
        # Nothing to multiply (M, K, N or G zero): XLA's answer (zeros for K = 0) is exact.
        return ragged_dot_reference(lhs, rhs, group_sizes.astype(jnp.int32), precision, out_dtype,
                                    offset)
    m, k = lhs.shape
    g_local, _, n = rhs.shape
    problem = OP.problem((m, k, n, g_local), lhs.dtype)
    if products is None and isinstance(explicit, MosaicMatmulConfig):
        raise NotImplementedError(f"{_OP}: block_sizes is a {type(explicit).__name__}, the "
                                  f"tiles of implementation='mosaic_gpu', not of {impl!r}.")
    config = OP.select(problem, impl, explicit)
    if products is not None:
        kernel = _Kernel(impl, config, np.dtype(out_dtype), "", False, products)
        return _ragged_dot(lhs, rhs, group_sizes.astype(jnp.int32), offset, kernel)
    if config.walk not in (None, gmm.walk(impl)) and not pl.backend_traits(impl).interpreted:
        raise ValueError(f"{_OP}: block_sizes.walk={config.walk!r} cannot run on {impl!r} "
                         f"(it takes {gmm.walk(impl)!r}; the interpreter runs either).")
    return _kernel_ragged_dot(lhs, rhs, group_sizes.astype(jnp.int32), offset, impl, config,
                              out_dtype)


def _kernel_ragged_dot(lhs, rhs, group_sizes, offset, backend, config, out_dtype,
                       walk: str | None = None, scalar_prefetch: bool | None = None):
    """The kernels' ``ragged_dot`` (``walk``: force the grid or loop walk;
    ``scalar_prefetch=False``: pallas_triton's form, programs per output tile with the
    tables as ordinary operands; tests run each on the interpreter)."""
    if scalar_prefetch is None:
        scalar_prefetch = gmm.tables_in_scalar_memory(backend)
    kernel = _Kernel(backend, config, np.dtype(out_dtype),
                     walk or config.walk or gmm.walk(backend), scalar_prefetch)
    return _ragged_dot(lhs, rhs, group_sizes, offset, kernel)


@dataclasses.dataclass(frozen=True)
class _Kernel:
    """Everything static about one call's kernels (a custom_vjp nondiff argument)."""

    backend: str
    config: RaggedDotConfig
    out_dtype: np.dtype
    walk: str
    scalar_prefetch: bool = True
    # Another core's kernels (ops.matmul.mosaic_gpu_ragged.RaggedKernels), None: the tiled core's.
    products: object = None

    def gmm(self, lhs, rhs, visits, *, transpose_rhs, config, out_dtype, name):
        if self.products is not None:
            return self.products.gmm(lhs, rhs, visits, transpose_rhs=transpose_rhs, config=config,
                                     out_dtype=out_dtype, name=name)
        if not self.scalar_prefetch:
            return gmm.gmm_by_tile(lhs, rhs, visits, transpose_rhs=transpose_rhs, config=config,
                                   backend=self.backend, out_dtype=out_dtype, name=name)
        return gmm.gmm(lhs, rhs, visits, transpose_rhs=transpose_rhs, config=config,
                       backend=self.backend, out_dtype=out_dtype, walk_override=self.walk,
                       name=name)


# Multi-device (ops._partitioning): rows ("m") of lhs and the output, lhs's and rhs's
# contraction ("k"), rhs's columns ("n") and rhs's groups ("g") stay where they live;
# group_sizes ("gs", every group's size) is gathered.
# * Rows: a device's rows are a block of the global row order, so group_sizes is
#   localised to it (each group's rows clipped to the block), which keeps the rows of
#   groups it does not hold, and rows past the sum, zero.
# * Groups: a device holding groups [g0, g0 + G_local) of rhs runs them with group offset
#   g0 (added to the caller's), the other groups' rows zero; the forward's partial
#   outputs (and dlhs) are summed over the groups' axes, in float32. This is expert
#   parallelism with every token on every device; ops/moe/expert_parallel.py moves the
#   tokens to their experts' devices instead (an all-to-all, no sum over the outputs).
# * Contraction: partial products summed in float32 (forward); dlhs and drhs keep it.
# * Columns: dlhs is summed over them; drhs is summed over the rows' axes.
_IN = ("m k", "g k n", "gs", "")


def _local_groups(group_sizes, offset, reduced, m_local: int, g_local: int):
    """``(group_sizes, offset)`` of this device's block of rows and groups."""
    if reduced_axes(reduced, "m"):
        m0 = block_index(reduced, "m") * m_local
        ends = jnp.cumsum(group_sizes)
        group_sizes = (jnp.clip(ends - m0, 0, m_local)
                       - jnp.clip(ends - group_sizes - m0, 0, m_local)).astype(jnp.int32)
    if reduced_axes(reduced, "g"):
        g0 = block_index(reduced, "g") * g_local
        offset = g0 if offset is None else offset + g0
    return group_sizes, offset


def _summed(x, reduced, factors, dtype):
    """``x`` (float32 where ``factors`` are split) summed over their axes, as ``dtype``."""
    return psum(x, reduced, *factors).astype(dtype)


def _forward(lhs, rhs, group_sizes, offset, kernel: _Kernel):
    def local(lhs, rhs, group_sizes, offset, *, reduced):
        m, g_local = lhs.shape[0], rhs.shape[0]
        sizes, off = _local_groups(group_sizes, offset, reduced, m, g_local)
        partial = reduced_axes(reduced, "k", "g")
        visits = group_table.row_visits(sizes, g_local, off, m, kernel.config.block_m)
        out = kernel.gmm(lhs, rhs, visits, transpose_rhs=False, config=kernel.config,
                         out_dtype=np.dtype(np.float32) if partial else kernel.out_dtype,
                         name="ragged_dot")
        return (_summed(out, reduced, ("k", "g"), kernel.out_dtype),)

    return run(_OP, local, (lhs, rhs, group_sizes, offset), _IN, ("m n",), gather=("gs",),
               reduce=("m", "k", "g"))[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _ragged_dot(lhs, rhs, group_sizes, offset, kernel: _Kernel):
    return _forward(lhs, rhs, group_sizes, offset, kernel)


def _ragged_dot_fwd(lhs, rhs, group_sizes, offset, kernel):
    return _forward(lhs, rhs, group_sizes, offset, kernel), (lhs, rhs, group_sizes, offset)


def _ragged_dot_bwd(kernel: _Kernel, residuals, g):
    """``dlhs = gmm(dout, rhs^T)`` (rows of groups not owned get 0), ``drhs = tgmm(lhs,
    dout)``; the tiles by role (``dlhs``: (block_m, block_k) tiles contracting N by
    block_n; ``drhs``: (block_k, block_n) tiles contracting rows by block_m). The
    cotangent is cast to the operands' dtype (the products' input dtype)."""
    lhs, rhs, group_sizes, offset = residuals
    dout = g.astype(lhs.dtype)
    c = kernel.config
    if kernel.products is None:
        # The forward's warps for both (dlhs's tile is block_m x block_k, drhs's block_k x
        # block_n; at 4 warps drhs's masked 64 x 128 bfloat16 tiles take 241 registers on
        # sm_90, at 8 warps 124).
        c = dataclasses.replace(c, num_warps=c.num_warps or tiled.default_num_warps(c.block_m,
                                                                                    c.block_n))

    def local(lhs, rhs, group_sizes, offset, dout, *, reduced):
        m, g_local = lhs.shape[0], rhs.shape[0]
        sizes, off = _local_groups(group_sizes, offset, reduced, m, g_local)
        f32 = np.dtype(np.float32)
        visits = group_table.row_visits(sizes, g_local, off, m, c.block_m)
        drhs_dtype = f32 if reduced_axes(reduced, "m") else rhs.dtype
        # Mosaic GPU's dlhs keeps the forward's block (its row tiles are the visits').
        dlhs = kernel.gmm(dout, rhs, visits, transpose_rhs=True,
                          config=c if kernel.products is not None else
                          dataclasses.replace(c, block_n=c.block_k, block_k=c.block_n),
                          out_dtype=f32 if reduced_axes(reduced, "n", "g") else lhs.dtype,
                          name="ragged_dot_dlhs")
        if kernel.products is not None:
            begins, ends = group_table.group_bounds(sizes, g_local, off, m)
            drhs = kernel.products.tgmm(lhs, dout, begins, ends, out_dtype=drhs_dtype)
        else:
            drhs = tgmm.tgmm(lhs, dout, sizes, off, g_local, config=c, backend=kernel.backend,
                             out_dtype=drhs_dtype, walk=kernel.walk,
                             scalar_prefetch=kernel.scalar_prefetch)
        return (_summed(dlhs, reduced, ("n", "g"), lhs.dtype),
                _summed(drhs, reduced, ("m",), rhs.dtype))

    dlhs, drhs = run(_OP, local, (lhs, rhs, group_sizes, offset, dout), _IN + ("m n",),
                     ("m k", "g k n"), gather=("gs",), reduce=("m", "n", "g"), out_like=(0, 1))
    return dlhs, drhs, None, None


_ragged_dot.defvjp(_ragged_dot_fwd, _ragged_dot_bwd)


# --------------------------------------------------------------------------
# Registration (ops._op)
# --------------------------------------------------------------------------

def _example(problem: Problem, implementation: str):
    m, k, n, groups = problem.shape
    dtype = jnp.dtype(problem.dtype)
    args = [jax.ShapeDtypeStruct((m, k), dtype), jax.ShapeDtypeStruct((groups, k, n), dtype)]

    def fn(lhs, rhs):
        sizes = jnp.full((groups,), m // groups, jnp.int32)
        return ragged_dot(lhs, rhs, sizes, implementation=implementation)
    return fn, args


def _problem_of(lhs, rhs, **_):
    """The call's problem ``(m, k, n, groups)`` (:attr:`ops._op.Op.problem_of`)."""
    return (lhs.shape[0], lhs.shape[1], rhs.shape[2], rhs.shape[0]), lhs.dtype, None


OP = register(Op(
    name=_OP, dims=("m", "k", "n", "groups"),
    configs={b: RaggedDotConfig for b in ("interpret", "triton", "pallas_triton", "mosaic_tpu")},
    reference=ragged_dot_reference, entry=_ragged_dot_on, problem_of=_problem_of,
    function=ragged_dot,
    tuning=Tuning(example=_example, shapes=((32768, 4096, 14336, 8), (32768, 14336, 4096, 8),
                                            (131072, 2048, 1024, 64)),
                  quick=((512, 256, 512, 4),), training=vjp_training(_example))))


# implementation="mosaic_gpu": gmm and tgmm as walks of the warp-specialized Mosaic GPU
# core over the group tables (ops/matmul/mosaic_gpu_ragged.py).

def _mosaic_supported(call: Call) -> str | None:
    """None when the Mosaic GPU kernels run ``call``, else why not: float32 operands, the
    other kernels' ``RaggedDotConfig`` (a tuple becomes one) as ``block_sizes``, a GPU older
    than sm_90."""
    a = call.args
    return mosaic_gpu.why_not(a["lhs"].dtype, block_sizes=a["explicit"], call=call)


def _mosaic_run(call: Call):
    return _ragged_dot_on("mosaic_gpu", **call.args,
                          products=RaggedKernels(call.args["explicit"]))


register_implementation(_OP, Implementation("mosaic_gpu", _mosaic_run, config=MosaicRaggedConfig,
                                            supported=_mosaic_supported, platforms=("gpu",)))

