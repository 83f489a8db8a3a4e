"""Shared machinery for row-wise kernels (norms, softmax family, cross-entropy).

Every row-wise op sees its input as ``[rows, features]`` and reduces along
``features``. One kernel layout serves all of them on every backend:

* a program owns ``block_rows`` rows and a *full-row* block, ``[block_rows,
  padded_cols]``, whose width covers every feature (padded per backend, see
  :func:`row_layout`);
* the kernel walks the row in ``chunk`` -wide column slices with an
  in-kernel loop (:func:`for_each_chunk`), so rows far wider than one chunk
  (V = 128k logits) work with a bounded working set, and no grid axis has to
  run sequentially (JAX's Pallas Triton runs every program concurrently);
* columns at or past ``features`` hold unspecified padding (docs/pallas_core.md section 3), so the
  last chunk is masked with :func:`column_mask`; rows past the end are
  discarded on store and need no mask unless they feed a cross-row sum.

Reads of the input: a kernel whose output needs a whole-row statistic (the
norms, softmax and log-softmax, forward and backward) reads a row once when it
fits one chunk (the chunk stays in registers between the statistics and the
output) and twice otherwise: a row wider than a chunk cannot be held in
registers, and re-reading it (mostly from L2) costs less than spilling it.
Reductions that only need the statistics (logsumexp, cross-entropy's forward,
an online logsumexp plus the label's logit) read it once. The static gate
(``python -m benchmarks.static``) counts these reads and fails a kernel that
reads more often than stated here.

Block widths per backend: on the Triton backends the full-row block is the next
power of two (loads are what must be powers of two, and the loop never runs
past ``features``); on ``mosaic_tpu`` and ``interpret`` it is a whole number of
chunks (chunks are multiples of 128, the TPU lane width), so no slice runs
past the block.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import pallas_core as pl
from pallas_core.triton import backend as triton_backend
from ops import _op
from ops._checks import check_array, check_float_dtype
from ops._implementation import KERNEL_BACKENDS, check_implementation
from ops._partitioning import reshape


@dataclasses.dataclass(frozen=True)
class RowLayout:
    """How ``[rows, features]`` is tiled.

    Attributes:
      rows, features: the 2-D problem.
      block_rows: rows per program.
      chunk: columns per loop step (a power of two).
      num_chunks: loop trip count, ``cdiv(features, chunk)``.
      padded_cols: width of the full-row block (>= num_chunks * chunk).
      num_warps, num_stages: Triton launch parameters from the tuning cache;
        None: :func:`row_compiler_params`' heuristic.
    """

    rows: int
    features: int
    block_rows: int
    chunk: int
    num_chunks: int
    padded_cols: int
    num_warps: int | None = None
    num_stages: int | None = None

    @property
    def grid(self) -> tuple[int]:
        return (pl.cdiv(self.rows, self.block_rows),)

    @property
    def needs_column_mask(self) -> bool:
        return self.num_chunks * self.chunk != self.features

    def row_spec(self) -> pl.BlockSpec:
        """The full-row block of program ``i``: rows ``[i*block_rows, ...)``, all columns."""
        return pl.BlockSpec((self.block_rows, self.padded_cols), lambda i: (i, 0))

    def stat_spec(self) -> pl.BlockSpec:
        """A per-row statistic stored as ``[rows, 1]`` float32 (mean, rstd, logsumexp...)."""
        return pl.BlockSpec((self.block_rows, 1), lambda i: (i, 0))



def check_axis_op(x, axis, op: str, implementation, max_chunk) -> tuple[tuple[int, ...], object]:
    """Checks the arguments of a reduction over ``axis`` (sum, max, softmax, logsumexp …).

    Returns ``(axes, implementation)``: the normalised axes and the checked
    ``implementation=`` argument, for :func:`ops._implementation.run_implementation`.

    Raises:
      TypeError / ValueError: from the checks named, each naming the argument.
    """
    check_array(x, "x", op)
    check_float_dtype(x, "x", op)
    axes = normalize_axes(axis, x.ndim, op)
    impl = check_implementation(implementation, op)
    check_max_chunk(max_chunk, op)
    return axes, impl


def check_max_chunk(max_chunk, op: str) -> None:
    """``max_chunk`` (the ops' test hook capping the column chunk): None or a power of two >= 128.

    Raises:
      ValueError: anything else, naming ``max_chunk``.
    """
    if max_chunk is None:
        return
    if (not isinstance(max_chunk, (int, np.integer)) or isinstance(max_chunk, bool)
            or max_chunk < 128 or max_chunk & (max_chunk - 1)):
        raise ValueError(f"{op}: max_chunk must be None or a power of two >= 128, got {max_chunk!r}.")


def row_layout(rows: int, features: int, dtype, backend: str, *, max_chunk: int | None = None,
               block_rows: int | None = None) -> RowLayout:
    """Tiles a ``[rows, features]`` row-wise problem for ``backend``.

    Args:
      dtype: the input dtype (wider dtypes get narrower chunks, so a chunk of a
        few rows stays within registers / VMEM).
      max_chunk: cap on the chunk width (a power of two >= 128); tests use a
        small cap to exercise multi-chunk rows on small shapes.
      block_rows: rows per program; None picks 4, or one whole sublane tile
        where blocks are tiled (``pl.backend_traits(backend).tile``: 8 on
        mosaic_tpu), fewer for very small problems where blocks are not tiled.

    Raises:
      ValueError: ``block_rows`` neither a multiple of the backend's sublane
        tile nor all the rows.
    """
    check_max_chunk(max_chunk, "row_layout")
    if max_chunk is None:
        max_chunk = 4096 if np.dtype(dtype).itemsize <= 2 else 2048
    chunk = min(max_chunk, max(128, pl.next_power_of_2(features)))
    num_chunks = max(1, pl.cdiv(features, chunk))
    traits = pl.backend_traits(backend)
    if traits.triton:  # a Triton tensor's dims are powers of two
        padded = max(chunk, pl.next_power_of_2(features))
    else:
        padded = num_chunks * chunk
    sublanes = traits.tile[0]
    if block_rows is None:
        block_rows = max(4, sublanes)
        if rows < block_rows and sublanes == 1:
            block_rows = max(1, pl.next_power_of_2(rows))
    if not traits.fits_tile(block_rows, rows, axis=-2):
        raise ValueError(f"block_rows must be a multiple of {sublanes} on {backend}, got {block_rows}.")
    return RowLayout(rows=rows, features=features, block_rows=block_rows, chunk=chunk,
                     num_chunks=num_chunks, padded_cols=padded)


@dataclasses.dataclass(frozen=True)
class RowConfig(_op.KernelConfig):
    """The config of every row-wise kernel (:mod:`ops._op`): what the tuning cache
    stores for a ``[rows, features]`` problem; :meth:`layout` makes it a :class:`RowLayout`.

    Attributes:
      block_rows: rows per program.
      chunk: columns per loop step (a power of two >= 128).
      num_warps, num_stages: Triton launch parameters; None:
        :func:`row_compiler_params`' heuristic.

    Subclasses change only :meth:`default_block_rows` (the norms' rows per program).
    """

    block_rows: int = _op.tunable()
    chunk: int = _op.tunable()
    num_warps: int | None = _op.tunable(None)
    num_stages: int | None = _op.tunable(None)

    @classmethod
    def default_block_rows(cls, problem: _op.Problem, backend: str,
                           max_chunk: int | None) -> int | None:
        """Rows per program of the heuristic; None: :func:`row_layout`'s default."""
        return None

    @classmethod
    def heuristic(cls, problem: _op.Problem, device: _op.Device, *,
                  max_chunk: int | None = None, block_rows: int | None = None) -> "RowConfig":
        """:func:`row_layout` with ``block_rows`` (None: :meth:`default_block_rows`) rows
        per program, or, in Triton's CPU interpreter (``device.interpreter``),
        :func:`interpreter_block_rows`; ``max_chunk`` caps the chunk (the ops'
        ``max_chunk=`` argument)."""
        rows, features = problem.shape
        if block_rows is None:
            block_rows = cls.default_block_rows(problem, device.backend, max_chunk)
        layout = row_layout(rows, features, problem.dtype, device.backend, max_chunk=max_chunk,
                            block_rows=block_rows)
        if device.interpreter:
            layout = row_layout(rows, features, problem.dtype, device.backend, max_chunk=max_chunk,
                                block_rows=interpreter_block_rows(rows, layout.chunk))
        return cls(block_rows=layout.block_rows, chunk=layout.chunk)

    @classmethod
    def from_tuned(cls, tuned, problem: _op.Problem, device: _op.Device) -> "RowConfig":
        """A cache entry: its ``chunk`` caps the chunk as ``max_chunk`` does; fields it
        leaves out are :func:`row_layout`'s defaults.

        Raises:
          ValueError: a config ``device.backend`` cannot run (from :func:`row_layout`).
        """
        rows, features = problem.shape
        layout = row_layout(rows, features, problem.dtype, device.backend,
                            max_chunk=tuned.get("chunk"), block_rows=tuned.get("block_rows"))
        return cls(block_rows=layout.block_rows, chunk=layout.chunk,
                   num_warps=tuned.get("num_warps"), num_stages=tuned.get("num_stages"))

    @classmethod
    def candidates(cls, problem: _op.Problem, device: _op.Device) -> tuple["RowConfig", ...]:
        """1, 2 or 4 rows per program (where blocks are tiled 1, 2 or 4 sublane tiles,
        on mosaic_tpu 8, 16 or 32, or all rows when fewer), chunks of 1024, 4096 or 8192 columns, 4 or 8
        warps; two pipeline stages when a row takes several chunks (clamped to the
        problem, distinct)."""
        rows, features = problem.shape
        sublanes = device.traits.tile[0]
        configs = []
        for block_rows, chunk, warps in itertools.product((sublanes, 2 * sublanes, 4 * sublanes),
                                                          (1024, 4096, 8192), (4, 8)):
            chunk = _op.fit(chunk, features, floor=128)
            block_rows = (rows if rows < block_rows else block_rows) if sublanes > 1 else min(
                block_rows, pl.next_power_of_2(rows))
            configs.append(cls(block_rows=block_rows, chunk=chunk, num_warps=warps,
                               num_stages=2 if pl.cdiv(features, chunk) > 1 else 1))
        return tuple(dict.fromkeys(configs))

    def layout(self, problem: _op.Problem, backend: str) -> RowLayout:
        """The kernels' layout of ``problem`` with this config on ``backend``."""
        rows, features = problem.shape
        layout = row_layout(rows, features, problem.dtype, backend, max_chunk=self.chunk,
                            block_rows=self.block_rows)
        return dataclasses.replace(layout, num_warps=self.num_warps, num_stages=self.num_stages)


def select_row_layout(op: str, rows: int, features: int, dtype, backend: str, *,
                      max_chunk: int | None = None, heuristic_block_rows=None) -> RowLayout:
    """The layout of the registered row-wise op ``op`` on a ``[rows, features]``
    problem (:meth:`ops._op.Op.select`): an explicit ``max_chunk`` (the caller's
    choice) goes to the heuristic, capping its chunk; otherwise the tuning cache's
    entry (key ``(rows, features)``), else the op's :meth:`RowConfig.heuristic`.
    ``heuristic_block_rows(max_chunk)``, when given, is the heuristic's rows per
    program (instead of the config class's :meth:`RowConfig.default_block_rows`).

    Raises:
      ops.tuning.TuningCacheError: a malformed user or packaged cache file.
      ValueError: a cached config this backend cannot run (from row_layout).
    """
    registered = _op.get(op)
    problem = registered.problem((rows, features), dtype)
    hints = {} if heuristic_block_rows is None else {"block_rows": heuristic_block_rows(max_chunk)}
    explicit = None
    if max_chunk is not None:
        explicit = registered.config_type(backend).heuristic(
            problem, _op.Device.current(backend), max_chunk=max_chunk, **hints)
    return registered.select(problem, backend, explicit, **hints).layout(problem, backend)


def row_example(fn: Callable, *, params: int = 0, labels: bool = False) -> Callable:
    """The tuner's call of the row-wise op ``fn`` (:attr:`ops._op.Tuning.example`):
    ``x [rows, features]`` of the problem's dtype, then ``params`` ``[features]``
    vectors (a norm's scale and bias) or, with ``labels``, int32 labels ``[rows]``;
    otherwise a reduction over the last axis."""
    def example(problem: _op.Problem, implementation: str):
        rows, features = problem.shape
        dtype = jnp.dtype(problem.dtype)
        x = jax.ShapeDtypeStruct((rows, features), dtype)
        if labels:
            return (lambda x, y: fn(x, y, implementation=implementation),
                    [x, jax.ShapeDtypeStruct((rows,), jnp.int32)])
        if params:
            return (lambda x, *p: fn(x, *p, implementation=implementation),
                    [x] + [jax.ShapeDtypeStruct((features,), dtype)] * params)
        return lambda x: fn(x, axis=-1, implementation=implementation), [x]

    return example


def row_problem_of(x, axes=None, **_) -> tuple:
    """The problem of a row-wise call on ``x`` reduced over ``axes`` (None: the last):
    ``((rows, features), dtype, None)`` (:attr:`ops._op.Op.problem_of`)."""
    axes = (x.ndim - 1,) if axes is None else tuple(a % x.ndim for a in axes)
    features = math.prod(x.shape[a] for a in axes)
    return (math.prod(x.shape) // max(features, 1), features), x.dtype, None


def register_row_op(name: str, reference: Callable, example: Callable, *,
                    config: type[RowConfig] = RowConfig, shapes=(), quick=(), order: int = 100,
                    check: Callable | None = None, entry: Callable | None = None,
                    problem_of: Callable = row_problem_of,
                    function: Callable | None = None) -> _op.Op:
    """Registers a row-wise op (:func:`ops._op.register`): problem dims ``(rows,
    features)``, ``config`` on every kernel backend, the tuner's ``shapes`` and
    ``quick`` problems, ``example(problem, implementation)`` the tuner's call (its
    ``jax.vjp`` the training step the compile filter also compiles: the backward
    kernels take the same layout), ``entry``, ``problem_of`` and ``function`` (the
    public op) as :class:`ops._op.Op` takes them."""
    return _op.register(_op.Op(
        name=name, dims=("rows", "features"), configs=dict.fromkeys(KERNEL_BACKENDS, config),
        reference=reference, check=check, entry=entry, problem_of=problem_of,
        function=function,
        tuning=_op.Tuning(example=example, shapes=tuple(shapes), quick=tuple(quick), order=order,
                          training=_op.vjp_training(example))))


def interpreter_block_rows(rows: int, chunk: int) -> int:
    """Rows per program in Triton's CPU interpreter, whose cost is per tl operation
    rather than per element: all rows (a power of two) as long as a chunk of them
    stays within :data:`pallas_core.triton.backend.INTERPRETER_TILE_ELEMENTS`
    (:func:`pallas_core.triton.backend.interpreter_tiles`)."""
    (block_rows,) = triton_backend.interpreter_tiles(
        (rows,), cap=max(1, triton_backend.INTERPRETER_TILE_ELEMENTS // chunk), floor=1)
    return block_rows


def as_rows(x) -> tuple[jax.Array, tuple[int, ...]]:
    """``x [..., features]`` as ``[rows, features]``, with the leading shape to undo it."""
    lead = x.shape[:-1]
    return reshape(x, (-1, x.shape[-1])), lead


def chunk_slice(layout: RowLayout, c):
    """The column indexer of chunk ``c`` (may be traced): ``ref[:, chunk_slice(...)]``."""
    return pl.ds(c * layout.chunk, layout.chunk)


def column_mask(layout: RowLayout, c, shape) -> jax.Array | None:
    """True where chunk ``c``'s columns are real features; None when no chunk needs it."""
    if not layout.needs_column_mask:
        return None
    col = c * layout.chunk + lax.broadcasted_iota(jnp.int32, shape, len(shape) - 1)
    return col < layout.features


def row_mask(layout: RowLayout, shape) -> jax.Array | None:
    """True where this program's rows are real (for sums across rows); None if all are."""
    if layout.rows % layout.block_rows == 0:
        return None
    row = pl.program_id(0) * layout.block_rows + lax.broadcasted_iota(jnp.int32, shape, 0)
    return row < layout.rows


def load_chunk(ref, layout: RowLayout, c, *, fill=0.0) -> jax.Array:
    """Chunk ``c`` of a full-row block as float32, padding columns set to ``fill``."""
    value = ref[:, chunk_slice(layout, c)].astype(jnp.float32)
    mask = column_mask(layout, c, value.shape)
    return value if mask is None else jnp.where(mask, value, fill)


def for_each_chunk(layout: RowLayout, body, init):
    """``carry = body(c, carry)`` for every chunk ``c``, as one loop (a single step unrolled)."""
    if layout.num_chunks == 1:
        return body(0, init)
    return lax.fori_loop(0, layout.num_chunks, body, init)


def online_logsumexp_update(m, s, x_chunk):
    """One step of the online (streaming) logsumexp: folds ``x_chunk`` into ``(m, s)``.

    The running state of a row is its maximum so far ``m`` and the sum so far
    of ``exp(x - m)``, ``s`` (Milakov & Gimelshein 2018, "Online normalizer
    calculation for softmax"): a new chunk may raise the maximum, so the old
    sum is rescaled by ``exp(m - m_new)`` before the chunk's terms are added.
    After the last chunk, ``logsumexp = m + log(s)``.

    Args:
      m, s: float32 ``[block_rows, 1]``; start from ``-inf`` and ``0``.
      x_chunk: float32 ``[block_rows, chunk]``, padding columns set to
        ``-inf`` (``load_chunk(..., fill=-inf)``).

    Returns:
      ``(m_new, s_new)``, float32 ``[block_rows, 1]``.

    A row that is ``-inf`` everywhere so far keeps ``m = -inf, s = 0`` (its
    logsumexp is ``-inf``, as ``jax.nn.logsumexp``'s) instead of producing
    ``exp(-inf - -inf) = NaN``: terms are taken relative to a shift that is the
    new maximum where it is finite and 0 elsewhere, the choice
    ``jax.nn.logsumexp`` makes too (so a ``+inf`` entry gives ``+inf``).
    """
    m_new = jnp.maximum(m, jnp.max(x_chunk, axis=1, keepdims=True))
    shift = logsumexp_shift(m_new)
    s_new = s * jnp.exp(m - shift) + jnp.sum(jnp.exp(x_chunk - shift), axis=1, keepdims=True)
    return m_new, s_new


def row_compiler_params(layout: RowLayout, backend: str):
    """Compiler params for a row-wise ``pallas_call`` over ``layout.grid``.

    The one grid axis is ``"parallel"`` (programs own disjoint rows). On
    ``pallas_triton`` the Triton params are passed explicitly (JAX would pick
    Mosaic GPU otherwise): 8 warps once a loop step touches 8k elements or
    more, 4 below; two pipeline stages when the row takes several chunks (the
    next chunk's load overlaps this chunk's math; at most 64 KiB of shared
    memory with the default chunks), one otherwise. Untuned starting points:
    revisit with GPU measurements. A layout from the tuning cache brings its own.
    """
    if pl.backend_traits(backend).triton:
        warps = layout.num_warps or (8 if layout.block_rows * layout.chunk >= 8192 else 4)
        stages = layout.num_stages or (2 if layout.num_chunks > 1 else 1)
        return pl.triton.CompilerParams(num_warps=warps, num_stages=stages,
                                        dimension_semantics=(pl.PARALLEL,))
    return pl.CompilerParams(dimension_semantics=(pl.PARALLEL,))


def normalize_axes(axis, ndim: int, op: str) -> tuple[int, ...]:
    """``axis`` (None = every axis, an int, or a tuple/list of ints; negative
    counts from the end) as sorted non-negative axes.

    Raises:
      TypeError: an entry that is not an int.
      ValueError: an axis out of range for rank ``ndim``, or a repeated axis;
        the message names ``axis``.
    """
    if axis is None:
        return tuple(range(ndim))
    entries = tuple(axis) if isinstance(axis, (tuple, list)) else (axis,)
    out = []
    for a in entries:
        if isinstance(a, bool) or not isinstance(a, (int, np.integer)):
            raise TypeError(f"{op}: axis must be None, an int or a tuple of ints, got {axis!r}.")
        if not -ndim <= a < ndim:
            raise ValueError(f"{op}: axis {int(a)} is out of range for x of rank {ndim} "
                             f"(axis={axis!r}).")
        out.append(int(a) % ndim if ndim else int(a))
    if len(set(out)) != len(out):
        raise ValueError(f"{op}: axis {axis!r} names the same axis more than once.")
    return tuple(sorted(out))


@dataclasses.dataclass(frozen=True)
class AxesView:
    """``x`` seen as ``[rows, features]`` with ``axes`` flattened into features.

    Attributes:
      x2: the ``[rows, features]`` array. Axes are moved last with a
        transpose, a copy of ``x`` unless ``axes`` already are the trailing
        axes (then ``x2`` is a free reshape).
      axes: the reduced axes (sorted, non-negative).
      kept_shape: x's shape without ``axes`` (the shape of a per-row result).
      moved_shape: x's shape with ``axes`` moved last.
      perm: the transpose taking x to ``moved_shape``.
    """

    x2: jax.Array
    axes: tuple[int, ...]
    kept_shape: tuple[int, ...]
    moved_shape: tuple[int, ...]
    perm: tuple[int, ...]

    def restore(self, y2) -> jax.Array:
        """A ``[rows, features]`` result back in x's layout (the inverse transpose)."""
        y = reshape(y2, self.moved_shape)
        if self.perm == tuple(range(len(self.perm))):
            return y
        return jnp.transpose(y, np.argsort(self.perm))


def rows_over_axes(x, axes: tuple[int, ...]) -> AxesView:
    """Moves (normalized) ``axes`` last and flattens: rows = kept axes, features = ``axes``."""
    kept = tuple(d for d in range(x.ndim) if d not in axes)
    perm = kept + tuple(axes)
    moved = x if perm == tuple(range(x.ndim)) else jnp.transpose(x, perm)
    kept_shape = tuple(x.shape[d] for d in kept)
    features = int(np.prod([x.shape[d] for d in axes], dtype=np.int64))
    rows = int(np.prod(kept_shape, dtype=np.int64))
    return AxesView(x2=reshape(moved, (rows, features)), axes=tuple(axes), kept_shape=kept_shape,
                    moved_shape=tuple(moved.shape), perm=perm)


def logsumexp_shift(m):
    """What ``exp`` arguments are taken relative to: the running max ``m`` where
    it is finite, else 0 (``jax.nn.logsumexp``'s choice), so an all ``-inf``
    row never computes ``-inf - -inf``. Written with ``abs`` and ``<`` (a NaN
    ``m`` gives 0 and stays NaN downstream) so every backend can lower it.
    """
    return jnp.where(jnp.abs(m) < jnp.inf, m, 0.0)
