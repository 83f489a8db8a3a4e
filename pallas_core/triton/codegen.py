"""Kernel jaxpr -> Triton source: pallas_core's own Triton lowering.

The kernel is traced once with its grid ids as scalar inputs and Refs over
its operands (:func:`trace_kernel`); :class:`KernelWriter` then walks the
jaxpr and writes one readable ``@jit`` function:

* every operand is a pointer plus ``tl.constexpr`` array and block dims; a
  Ref is that pointer seen through its block (the index_map, itself traced
  and emitted, gives the block origin) and any ``.at`` views, kept as one
  ``(start, size, stride)`` range or fixed index per array dim;
* loads and stores are masked wherever a block can run past the array, so
  edge blocks need no hand-written masks (docs/design.md §4);
* Triton tensors have power-of-two dims, so a value of logical shape
  ``(8, 96)`` is a ``(8, 128)`` tensor whose padding lanes are never
  stored, are masked out of reductions and dot contractions, and never leak
  into valid lanes otherwise (elementwise ops, broadcasts, transposes and
  forward scans keep lanes apart); reshapes that would mix padding into
  valid lanes raise NotImplementedError;
* parallel grid axes are the launch grid (flattened into axis 0, decoded
  with constexpr div/mod); arbitrary axes run as loops inside each program,
  so a TPU-style reduction over a grid axis is correct (docs/design.md §4);
* jaxpr primitives map to ``tl`` builtins with XLA's semantics: where a
  builtin differs (NaN-dropping ``tl.maximum``, ``log(1 + x)`` for log1p,
  ``0 - x`` for negation, out-of-range conversions and shifts) the writer
  emits a helper from :mod:`pallas_core.triton.jit_helpers` or an explicit
  guard instead. Helpers and reduction combine functions are defined in the
  generated module under the decorator name ``jit``, bound when the source
  is loaded (``triton.jit`` for GPUs and ahead-of-time compiles, the
  interpreter's wrapper on a CPU), so one source serves both.

Anything not covered raises NotImplementedError naming the primitive, the
kernel and the user's source line.

This module writes the kernel's structure (program ids, blocks, Refs,
scratch, control flow and calls); element-wise primitives, reductions and
dots are in :mod:`pallas_core.triton.elementwise`, and the spelling of
values, shapes and masks in :mod:`pallas_core.triton.values`.
"""
from __future__ import annotations

import ast
import dataclasses
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

from pallas_core import _jax_internals, context
from pallas_core.params import ARBITRARY, PARALLEL
from pallas_core.primitives import next_power_of_2
from pallas_core.indexing import indexer_layout, is_slice, is_trivial
from pallas_core.triton import (descriptors, inline_asm, jit_helpers, markers, peeling, program_order,
                                 scratch_barriers)
from pallas_core.triton.elementwise import ElementwiseWriter
from pallas_core.triton.values import (INT32_MAX, Val, as_code, axis_index, fit, lane_mask, literal, tl_dtype,
                                       tl_shape)
from pallas_core.triton.atomics import ATOMIC_PREFIX
from pallas_core.triton.params import schedule_options

class TritonTraceContext(context.KernelContext):
    """Grid ids are the traced scalar inputs; num_programs is static."""

    backend = "triton"

    def __init__(self, ids, grid):
        self._ids, self._grid = ids, grid

    def program_id(self, axis):
        return self._ids[axis]

    def num_programs(self, axis):
        return self._grid[axis]

    def run_scoped(self, body, scratch_shapes):
        raise NotImplementedError("run_scoped is not supported by the triton backend yet; "
                                  "use scratch_shapes or values carried in the kernel.")


def trace_kernel(call) -> jex_core.ClosedJaxpr:
    """The kernel as a jaxpr of (grid ids, operand blocks, scratch) with Ref effects."""
    grid = call.grid
    mappings = list(call.in_mappings) + list(call.out_mappings)

    def body(ids, blocks, scratch):
        refs = [jax.new_ref(v) for v in blocks] + [jax.new_ref(v) for v in scratch]
        with context.installed(TritonTraceContext(*call.kernel_ids(ids))):
            call.kernel(*refs)
        return [jax.freeze(r) for r in refs]

    ids = [jax.ShapeDtypeStruct((), jnp.int32)] * len(grid)
    blocks = [jax.ShapeDtypeStruct(m.ref_shape, m.dtype) for m in mappings]
    scratch = [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in call.scratch_shapes]
    # Hijax primitives (lax.scan under jax_scan3) expanded into JAX's own, as JAX does.
    return _jax_internals.without_hijax(jax.make_jaxpr(body)(ids, blocks, scratch))


def _grouped(expr: str) -> str:
    """``expr`` safe as an operand of ``*``: a name, a number, or one parenthesised group."""
    if re.fullmatch(r"\w+", expr):
        return expr
    depth = 0
    for i, ch in enumerate(expr):
        depth += (ch == "(") - (ch == ")")
        if depth == 0 and i < len(expr) - 1:
            return f"({expr})"
    return expr if expr.startswith("(") else f"({expr})"


# ------------------------------------------------------------------------------------
# Values and Refs as the writer sees them
# ------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Range:
    start: str  # an expression in elements of the underlying array
    size: int
    stride: int
    axis: int | None = None  # the result axis it walks; None: the Ranges' order


@dataclasses.dataclass(frozen=True)
class Gather:
    """An array dim indexed by an integer tensor: elements ``start + stride * index``,
    ``index`` laid along the result ``axes`` (a gather, ``x_ref[idx_array]``)."""

    start: str
    stride: int
    index: Val
    axes: tuple[int, ...]


BOTH_EDGES = 2  # a RefView.masked entry: the dim's index may be < 0 as well as past the end


@dataclasses.dataclass(frozen=True)
class RefView:
    """A Ref: an operand's pointer seen through its block and ``.at`` views.

    ``dims`` has one entry per array dim: a Range (kept), a str (fixed index) or,
    after a gather, a Gather. ``masked`` marks array dims a block may run past
    (loads/stores get masks): past the end (True), or past either edge
    (:data:`BOTH_EDGES`: element offsets into a padded array may be negative).
    """

    ptr: str
    array_shape: tuple[int, ...]
    dim_names: tuple[str, ...]  # constexpr names of the array dims
    dims: tuple[Range | Gather | str, ...]
    masked: tuple[bool, ...]
    dtype: Any
    wide: bool  # more than 2**31 elements: int64 offsets
    # A value name carried through loops in place of memory: the index of a scratch buffer
    # (named acc<k>), or the name of a Ref made inside the kernel (jax.new_ref of a value).
    register: int | str | None = None
    origin_last: str | None = None  # start of the operand block's last dim, before any .at view
    result_shape: tuple[int, ...] | None = None  # set by a gather, whose axes Ranges do not give
    # Per array dim, the end (exclusive, in elements) of what a BoundedSlice block holds, or
    # None: lanes past it are neither read nor written. Empty: no BoundedSlice dim.
    bounds: tuple[str | None, ...] = ()
    # The index of the scratch buffer this view is in, where it lives in memory (accesses are
    # ordered by barriers: pallas_core.triton.scratch_barriers); None: an operand or a register.
    scratch: int | None = None

    @property
    def register_name(self) -> str:
        return self.register if isinstance(self.register, str) else f"acc{self.register}"

    @property
    def shape(self) -> tuple[int, ...]:
        if self.result_shape is not None:
            return self.result_shape
        return tuple(d.size for d in self.dims if isinstance(d, Range))

    def index(self, indexer, value, overhang_ok: bool = False) -> "RefView":
        """Applies one NDIndexer (ints, static or dynamic slices, integer arrays) to the view.

        ``value(leaf)`` gives the :class:`Val` of an index leaf. Static indices
        past the view's edge raise IndexError unless ``overhang_ok`` (a masked
        access, whose mask guards those lanes).
        """
        if self.result_shape is not None:
            if is_trivial(indexer):  # ``view[...]`` of a gathered view
                return self
            raise NotImplementedError("triton backend: indexing a gathered Ref view again is not "
                                      "supported; index the Ref once with all its index arrays.")
        kept = [i for i, d in enumerate(self.dims) if isinstance(d, Range)]
        if len(indexer.indices) != len(kept):
            raise NotImplementedError(f"indexer of rank {len(indexer.indices)} for a view of rank {len(kept)}")
        gather = bool(tuple(indexer.int_indexer_shape))
        shape, axes = indexer_layout(indexer)
        dims = list(self.dims)
        for dim, (axis, idx, ax) in enumerate(zip(kept, indexer.indices, axes)):
            base: Range = dims[axis]
            if is_slice(idx):
                start = value(idx.start).expr
                size, stride = int(idx.size), int(idx.stride)
                if not overhang_ok:
                    _check_static(start, (size - 1) * stride, base.size, dim, self.shape)
                dims[axis] = Range(_add(base.start, _mul(start, str(base.stride))), size,
                                   base.stride * stride, ax[0] if gather else None)
            elif ax:
                dims[axis] = Gather(base.start, base.stride, value(idx), ax)
            else:
                at = value(idx).expr
                if not overhang_ok:
                    _check_static(at, 0, base.size, dim, self.shape)
                dims[axis] = _add(base.start, _mul(at, str(base.stride)))
        return dataclasses.replace(self, dims=tuple(dims), result_shape=tuple(shape) if gather else None)


def _strides(ref: RefView) -> list[str]:
    """Row-major strides of the array under ``ref``, written with its constexpr dims."""
    strides = ["1"] * len(ref.array_shape)
    for d in reversed(range(len(ref.array_shape) - 1)):
        strides[d] = _mul(strides[d + 1], ref.dim_names[d + 1])
    return strides


def _check_static(start: str, extent: int, size: int, dim: int, shape) -> None:
    """IndexError if a literal ``start`` (to ``start + extent``) leaves ``[0, size)``."""
    if not start.lstrip("-").isdigit():
        return
    first = int(start)
    if first < 0 or first + extent >= size:
        raise IndexError(
            f"triton backend: an index reaches elements {first}..{first + extent} of dim {dim} "
            f"of a Ref view of shape {tuple(shape)}, past its edge, with no mask; pass mask= to "
            "pl.load / pl.store (masked-off lanes are never read or written).")


def _add(a: str, b: str) -> str:
    if b == "0":
        return a
    if a == "0":
        return b
    return f"({a} + {b})"


def _mul(a: str, b: str) -> str:
    if a == "0" or b == "0":
        return "0"
    if b == "1":
        return a
    if a == "1":
        return b
    return f"({a} * {b})"


# ------------------------------------------------------------------------------------
# The writer
# ------------------------------------------------------------------------------------

class _ScratchNeedsMemory(Exception):
    """Raised while writing when scratch ``index`` is accessed other than as a whole block."""

    def __init__(self, index: int):
        super().__init__(index)
        self.index = index


class _DescriptorsNeedPointers(Exception):
    """Raised after writing when operands read and written by one kernel got descriptors."""

    def __init__(self, pointers: set[str]):
        super().__init__(sorted(pointers))
        self.pointers = pointers


class KernelWriter(ElementwiseWriter):
    """Writes the Triton source of one resolved pallas_call.

    Args:
      memory_scratch: indices of scratch buffers kept in global memory; every
        other scratch buffer is a loop-carried value (see :meth:`_scratch_ref`).
    """

    def __init__(self, call, memory_scratch: frozenset[int] = frozenset(),
                 pointer_only: frozenset[str] = frozenset()):
        self.call = call
        self.memory_scratch = memory_scratch
        self.pointer_only = pointer_only  # operands kept off tensor descriptors (see _check_descriptors)
        self.reads: set[str] = set()  # operand pointers loaded from / stored to, by any means
        self.writes: set[str] = set()
        self.name = _identifier(call.name)
        self.lines: list[str] = []
        self.indent = 1
        self.counter = 0
        self.combiners: set[str] = set()  # jit_helpers.COMBINERS used
        self.math: set[str] = set()  # jit_helpers.MATH used
        self.params: list[str] = []
        self.constexprs: dict[str, int] = {}
        self.used: set = set()  # jaxpr vars read by some equation or returned
        self.eqn_stack: list = []  # equations being written, outermost first
        self.access: dict | None = None  # the masked access a load / store marker is writing
        self.options = schedule_options(call.params.triton)
        self.descriptors: dict[tuple, str] = {}  # (pointer, box[, site]) -> tensor descriptor name
        self.descriptor_lines: list[str] = []
        self.scopes = descriptors.LoopScopes()  # with tma: where names change (descriptors at an access)
        self.ids: dict[int, str] = {}  # grid axis -> this program's id expression
        self.scalar_refs: list[RefView] = []  # the scalar-prefetch operands' views
        self.barriers = scratch_barriers.BarrierPlan()  # memory scratch accesses since the last barrier

    # ---- small helpers -------------------------------------------------------------
    def fresh(self, prefix="v") -> str:
        self.counter += 1
        return f"{prefix}{self.counter}"

    def emit(self, line: str) -> None:
        if self.options.tma:
            self.scopes.see(self.indent, line)
        self.lines.append("    " * self.indent + line)

    def assign(self, expr: str, shape, dtype, prefix="v") -> Val:
        name = self.fresh(prefix)
        self.emit(f"{name} = {expr}")
        return Val(name, tuple(shape), np.dtype(dtype))

    def constexpr(self, name: str, value: int) -> str:
        self.constexprs[name] = int(value)
        return name

    def unsupported(self, eqn, what=None):
        # Equations inside an inlined call (jnp functions are jitted) carry only
        # JAX-internal frames: report the innermost enclosing user line instead.
        where = next((w for w in map(_user_frame, [eqn, *reversed(self.eqn_stack)]) if w), "")
        raise NotImplementedError(
            f"triton backend: {what or 'primitive'} {eqn.primitive.name!r} in kernel "
            f"{self.call.name} is not supported{where}.")

    # ---- the kernel ----------------------------------------------------------------
    def write(self, closed: jex_core.ClosedJaxpr) -> str:
        """The module source for the kernel jaxpr ``closed`` (from :func:`trace_kernel`)."""
        call = self.call
        jaxpr = closed.jaxpr
        grid = call.grid
        parallel = [a for a, s in enumerate(call.semantics) if s == PARALLEL]
        arbitrary = [a for a, s in enumerate(call.semantics) if s == ARBITRARY]
        for a, n in enumerate(grid):
            self.constexpr(f"G{a}", n)
        scratch_refs = [self._scratch_ref(k, s, parallel) for k, s in enumerate(call.scratch_shapes)]
        ids: dict[int, str] = {}
        loops = []  # the loops the rest of the kernel is written in: their entry states
        if parallel:
            ids.update(self._program_ids(parallel))
            if self.options.persistent:  # one program's tiles share its memory scratch
                loops.append(self.barriers.loop_start())
        for ref in scratch_refs:
            if ref.register is not None:  # garbage is unspecified: zeros are as good as anything
                self.emit(f"{ref.register_name} = tl.full({tl_shape(ref.shape)}, 0, {tl_dtype(ref.dtype)})")
        for a in arbitrary[:-1]:
            self.emit(f"for i{a} in range(G{a}):")
            self.indent += 1
            ids[a] = f"i{a}"
            loops.append(self.barriers.loop_start())
        id_vars = jaxpr.invars[:len(grid)]
        n_operands = len(call.in_mappings) + len(call.out_mappings)
        refs = (id_vars, jaxpr.invars[len(grid):len(grid) + n_operands],
                jaxpr.invars[len(grid) + n_operands:], scratch_refs)
        if not arbitrary:
            self._program_body(closed, refs, ids, range(len(jaxpr.eqns)))
        else:
            self._peeled_loop(closed, refs, ids, arbitrary[-1])
        for entry in reversed(loops):
            self._loop_end(entry)
            self.indent -= 1
        self._check_descriptors()
        header = self._header(n_operands)
        helpers = "".join(jit_helpers.combiner_source(n) for n in sorted(self.combiners))
        helpers += "".join(jit_helpers.math_source(n) for n in jit_helpers.with_dependencies(self.math))
        if jit_helpers.PTX & self.math:  # rebound to True when Triton's interpreter loads the module
            helpers = f"\n{jit_helpers.INTERPRETED} = tl.constexpr(False)\n" + helpers
        # Descriptors depend only on parameters: made once, ahead of every loop.
        prologue = ["    " + line for line in self.descriptor_lines]
        return ("import triton.language as tl\n" + helpers + "\n\n@jit\n" + header + "\n"
                + "\n".join(prologue + self.lines) + "\n")

    def _program_ids(self, parallel) -> dict[int, str]:
        """Emits the decoding of this program's parallel grid indices (and, if persistent, the
        loop over its tiles, which the rest of the kernel is written inside)."""
        options = self.options
        sizes = [self.call.grid[a] for a in parallel]
        flat = "tl.program_id(0)"
        if options.persistent:
            self.constexpr("NUM_TILES", int(np.prod(sizes)))
            self.constexpr("NUM_PROGRAMS", program_order.launch_size(sizes, options.persistent))
            self.emit("for tile_id in range(tl.program_id(0), NUM_TILES, NUM_PROGRAMS):")
            self.indent += 1
            flat = "tile_id"
        group = options.group_size if len(parallel) >= 2 else 1
        if group > 1:
            self.constexpr("GROUP", group)
        lines, names = program_order.decode(parallel, group, flat)
        for line in lines:
            self.emit(line)
        return names

    def _bind_refs(self, refs, ids, env) -> None:
        """Binds grid ids (``ids``: axis -> expression), operand and scratch Refs."""
        id_vars, operand_vars, scratch_vars, scratch_refs = refs
        for a, var in enumerate(id_vars):
            env[var] = Val(ids[a], (), np.dtype(np.int32))
        mappings = list(self.call.in_mappings) + list(self.call.out_mappings)
        self.ref_of_value = {}
        self.ids = ids
        self.scalar_refs = []  # the scalar-prefetch operands', built first: index maps read them
        for k, (m, var) in enumerate(zip(mappings, operand_vars)):
            ref = self.ref_of_value[var] = self._operand_ref(k, m, ids)
            if k < self.call.num_scalar_prefetch:
                self.scalar_refs.append(ref)
        for ref, var in zip(scratch_refs, scratch_vars):
            self.ref_of_value[var] = ref

    def _program_body(self, closed, refs, ids, only) -> None:
        """Writes the equations ``only`` (indices) of the kernel at grid ids ``ids``."""
        env: dict = {}
        self._bind_refs(refs, ids, env)
        self.body(closed.jaxpr, closed.consts, env, only=frozenset(only))
        self.emit("pass")  # keeps a loop over arbitrary axes well-formed if its body is empty

    def _peeled_loop(self, closed, refs, ids, axis) -> None:
        """The loop over the innermost arbitrary ``axis``, first/last-iteration blocks peeled
        (:mod:`pallas_core.triton.peeling`)."""
        jaxpr = closed.jaxpr
        length = self.call.grid[axis]
        # The Refs over operand and scratch blocks (trace_kernel's; not those a kernel makes).
        neutral = [i for i, e in enumerate(jaxpr.eqns)
                   if e.primitive.name == "new_ref" and e.invars[0] in jaxpr.invars]
        peel = peeling.plan(jaxpr, jaxpr.invars[axis], length, self.options.loop_peeling,
                            self._buffers(jaxpr, refs, neutral))
        if peel.before:
            self._peeled_blocks(closed, refs, {**ids, axis: "0"}, neutral + list(peel.before_values), peel.before)
        self.emit(f"for i{axis} in range(G{axis}):")
        self.indent += 1
        entry = self.barriers.loop_start()
        self._program_body(closed, refs, {**ids, axis: f"i{axis}"}, peel.loop)
        self._loop_end(entry)
        self.indent -= 1
        if peel.after:
            self._peeled_blocks(closed, refs, {**ids, axis: f"(G{axis} - 1)"}, neutral + list(peel.after_values),
                                peel.after)

    def _buffers(self, jaxpr, refs, neutral) -> dict:
        """Ref variable -> buffer id (its operand's, or the input's it is aliased to)."""
        _, operand_vars, scratch_vars, _ = refs
        n_in = len(self.call.in_mappings)
        buffer = {v: k for k, v in enumerate(operand_vars)}
        for i, o in self.call.input_output_aliases.items():
            buffer[operand_vars[n_in + o]] = i
        buffer.update({v: ("scratch", k) for k, v in enumerate(scratch_vars)})
        eqns = jaxpr.eqns
        return {eqns[i].outvars[0]: buffer.get(eqns[i].invars[0], i) for i in neutral}

    def _peeled_blocks(self, closed, refs, ids, prelude, conds) -> None:
        """The true branches of the ``pl.when`` equations ``conds``, outside the loop, after the
        equations ``prelude`` (Refs and the blocks' operand values)."""
        env: dict = {}
        self._bind_refs(refs, ids, env)
        self.body(closed.jaxpr, closed.consts, env, only=frozenset(prelude))
        for i in conds:
            eqn = closed.jaxpr.eqns[i]
            self.eqn_stack.append(eqn)
            try:
                self._inline(eqn.params["branches"][1], [self.read(env, v) for v in eqn.invars[1:]], env)
            finally:
                self.eqn_stack.pop()

    def _header(self, n_operands) -> str:
        ptrs = [f"p{k}" for k in range(n_operands)]
        ptrs += [f"s{k}" for k in range(len(self.call.scratch_shapes)) if k in self.memory_scratch]
        consts = [f"{n}: tl.constexpr" for n in self.constexprs]
        self.params = ptrs
        return f"def {self.name}(" + ", ".join(ptrs + consts) + "):"

    def _operand_ref(self, k, m, ids) -> RefView:
        rank = len(m.array_shape)
        names = tuple(self.constexpr(f"A{k}_{d}", m.array_shape[d]) for d in range(rank))
        blocks = [self.constexpr(f"B{k}_{d}", m.block_shape[d]) for d in range(rank)]
        # The block origin, from the index_map traced at the program ids.
        block_idx = self._index_map(m, ids)
        # BoundedSlice dims: the pl.ds sizes, from the same index_map.
        sizes = self._index_map(m, ids, m.size_map) if m.size_map is not None else None
        dims, masked = [], []
        for d in range(rank):
            if m.element[d]:  # pl.Element / Unblocked: an offset into the array padded by `low`
                low = m.padding[d][0]
                start = f"({block_idx[d]} - {low})" if low else block_idx[d]
                masked.append(BOTH_EDGES if low else True)  # padding reads as `other` (0)
            else:
                start = _mul(block_idx[d], blocks[d])
                masked.append(m.array_shape[d] % m.block_shape[d] != 0)
            if m.squeezed[d]:
                dims.append(start)
            else:
                dims.append(Range(start, m.block_shape[d], 1))
        numel = int(np.prod(m.array_shape)) if rank else 1
        # A descriptor (TMA) box must start at a block origin; element offsets need not.
        origin_last = dims[-1].start if rank and isinstance(dims[-1], Range) and not m.element[-1] \
            else None
        bounds = ()
        if sizes is not None:
            bounds = tuple(_add(block_idx[d], sizes[d]) if m.bounded[d] else None for d in range(rank))
        return RefView(ptr=f"p{k}", array_shape=m.array_shape, dim_names=names, dims=tuple(dims),
                       masked=tuple(masked), dtype=np.dtype(m.dtype), wide=numel > INT32_MAX,
                       origin_last=origin_last, bounds=bounds)

    def _scratch_ref(self, k, s, parallel) -> RefView:
        """A scratch buffer: a loop-carried value, or private global memory.

        A scratch buffer only ever read and written whole (``acc_ref[...]``,
        the usual accumulator) is a value named ``acc{k}`` that Triton carries
        through the loops over arbitrary axes, i.e. registers: the classic
        Triton matmul. One accessed any other way (slices, atomics) lives in
        global memory, one private slice per launched program;
        :func:`generate` finds out which by writing the kernel again after
        :class:`_ScratchNeedsMemory`. The program's threads reach a memory
        buffer's elements in different layouts, so its accesses are ordered
        by barriers where they may race (:meth:`_ordered`).
        """
        rank = len(s.shape)
        names = tuple(self.constexpr(f"S{k}_{d}", s.shape[d]) for d in range(rank))
        numel = int(np.prod(s.shape)) if rank else 1
        ptr = f"s{k}" if not parallel else f"(s{k} + tl.program_id(0) * {numel})"
        # Rank 0 stays in memory: a Triton scalar cannot be carried like a block.
        register = k if rank and k not in self.memory_scratch else None
        return RefView(ptr=ptr, array_shape=tuple(s.shape), dim_names=names,
                       dims=tuple(Range("0", n, 1) for n in s.shape), masked=(False,) * rank,
                       dtype=np.dtype(s.dtype), wide=False, register=register,
                       scratch=k if register is None else None)

    def _index_map(self, m, ids, fn=None) -> list[str]:
        """The block index of ``m`` at grid ids ``ids``, the index map (or ``fn``, a function
        of the same arguments) written inline.

        With scalar prefetch the index map also reads the scalar-prefetch
        operands: it is traced with Refs over them (``context.scalar_refs``)
        bound to those operands' views, so ``pages[i]`` is a scalar ``tl.load``.
        """
        grid = self.call.grid
        scalars = list(self.scalar_refs)
        avals = [jax.ShapeDtypeStruct(r.array_shape, r.dtype) for r in scalars]

        index_map = fn or m.index_map

        def traced(ids, arrays):
            if not arrays:
                return index_map(*ids)
            with context.scalar_refs([jax.new_ref(a) for a in arrays]):
                return index_map(*ids)

        closed = jax.make_jaxpr(traced)([jnp.int32(0)] * len(grid), avals)
        invars = closed.jaxpr.invars
        env = {v: Val(ids[a], (), np.dtype(np.int32)) for a, v in enumerate(invars[:len(grid)])}
        self.ref_of_value.update(zip(invars[len(grid):], scalars))
        outs = self.body(closed.jaxpr, closed.consts, env, returns=True)
        return [o.expr for o in outs]

    # ---- jaxpr walking -------------------------------------------------------------
    def read(self, env, atom) -> Any:
        if isinstance(atom, jex_core.Literal):
            return literal(atom.val, atom.aval)
        if atom in self.ref_of_value:
            return self.ref_of_value[atom]
        return env[atom]

    def body(self, jaxpr, consts, env, returns=False, only: frozenset[int] | None = None):
        """Writes ``jaxpr`` (only the equations of indices ``only``, if given)."""
        eqns = [e for i, e in enumerate(jaxpr.eqns) if only is None or i in only]
        self.used.update(v for e in eqns for v in e.invars if not isinstance(v, jex_core.Literal))
        self.used.update(v for v in jaxpr.outvars if not isinstance(v, jex_core.Literal))
        for var, c in zip(jaxpr.constvars, consts):
            env[var] = literal(c, var.aval)
        for eqn in eqns:
            self.equation(eqn, env)
        if returns:
            return [self.read(env, v) for v in jaxpr.outvars]
        return None

    def equation(self, eqn, env):
        self.eqn_stack.append(eqn)
        try:
            self._equation(eqn, env)
        finally:
            self.eqn_stack.pop()

    def _equation(self, eqn, env):
        name = eqn.primitive.name
        args = [self.read(env, v) for v in eqn.invars]
        handler = getattr(self, f"_p_{name}", None)
        if handler is None:
            handler = self.table_handler(name)
        if handler is None:
            self.unsupported(eqn)
        outs = handler(eqn, env, *args)
        if outs is None:
            return
        if not isinstance(outs, (list, tuple)):
            outs = [outs]
        for var, out in zip(eqn.outvars, outs):
            env[var] = out

    # ---- refs ----------------------------------------------------------------------
    def _view(self, ref: RefView, transforms, env, overhang_ok: bool = False) -> RefView:
        def value(x):
            if isinstance(x, (int, np.integer)):
                return Val(str(int(x)), (), np.dtype(np.int32))
            return self.read(env, x)

        for t in transforms:
            ref = ref.index(t, value, overhang_ok)
        return ref

    def _addresses(self, ref: RefView):
        """(offsets expr, mask expr or None, result shape) of a view."""
        shape = ref.shape
        rank = len(shape)
        sequential = 0
        offsets, masks = [], []
        lanes_masked: set[int] = set()

        def mask_lanes(axis):  # padding lanes: never read or written
            if axis not in lanes_masked and next_power_of_2(shape[axis]) != shape[axis]:
                masks.append(lane_mask(axis, shape[axis], rank))
            lanes_masked.add(axis)

        strides = _strides(ref)
        for d, dim in enumerate(ref.dims):
            index = self.fresh("r")
            if isinstance(dim, Range):
                axis = sequential if dim.axis is None else dim.axis
                sequential += 1
                step = f" * {dim.stride}" if dim.stride != 1 else ""
                lanes = f"tl.arange(0, {next_power_of_2(dim.size)}){step}"
                self.emit(f"{index} = ({_add(dim.start, lanes)})[{axis_index(axis, rank)}]")
                mask_lanes(axis)
            elif isinstance(dim, Gather):
                at = as_code(dim.index)
                if np.dtype(dim.index.dtype) not in (np.dtype(np.int32), np.dtype(np.int64)):
                    at = f"{at}.to(tl.int32)"
                if len(dim.axes) != rank:
                    at = f"{at}[{', '.join(':' if a in dim.axes else 'None' for a in range(rank))}]"
                step = f" * {dim.stride}" if dim.stride != 1 else ""
                self.emit(f"{index} = {_add(dim.start, f'{at}{step}')}")
                for axis in dim.axes:
                    mask_lanes(axis)
            else:
                self.emit(f"{index} = {dim}")
            if ref.wide:
                index_wide = f"{index}.to(tl.int64)"
            else:
                index_wide = index
            offsets.append(_mul(index_wide, strides[d]))
            if ref.bounds and ref.bounds[d] is not None:
                masks.append(f"({index} < {ref.bounds[d]})")
            if ref.masked[d] == BOTH_EDGES:
                masks.append(f"(({index} >= 0) & ({index} < {ref.dim_names[d]}))")
            elif ref.masked[d]:
                masks.append(f"({index} < {ref.dim_names[d]})")
        offset = " + ".join(offsets) if offsets else "0"
        mask = " & ".join(masks) if masks else None
        return offset, mask, shape

    def _check_descriptors(self) -> None:
        """Descriptors only for buffers a kernel reads or writes, not both.

        A TMA store completes asynchronously and a pointer store is not
        ordered with TMA reads (another memory proxy), so a buffer read back
        after a write (an output block revisited along a grid axis, an input
        aliased to an output) keeps pointer loads and stores throughout.
        """
        n_in = len(self.call.in_mappings)
        buffer = {f"p{n_in + o}": f"p{i}" for i, o in self.call.input_output_aliases.items()}
        both = {buffer.get(p, p) for p in self.reads} & {buffer.get(p, p) for p in self.writes}
        conflicts = {key[0] for key in self.descriptors if buffer.get(key[0], key[0]) in both}
        if conflicts:
            raise _DescriptorsNeedPointers(conflicts)

    def _descriptor(self, ref: RefView, access: dict) -> tuple[str, tuple[int, ...], list[int]] | None:
        """``(descriptor name, box, the array dims it describes)`` if ``tma`` is on and the view
        can move as one TMA box (:mod:`pallas_core.triton.descriptors`). Fixed indices that
        no open loop changes are folded into the descriptor's address, made here; otherwise it
        covers every dim and is made once, ahead of the loops, on first use."""
        if (not self.options.tma or ref.register is not None or ref.origin_last is None
                or ref.ptr in self.pointer_only or any(b is not None for b in ref.bounds)):
            return None
        user = access.get("mask")
        plain = (user is None or user.expr == "True") and not access.get("hints")
        box = descriptors.tma_box(ref.array_shape, ref.dtype, ref.dims, ref.origin_last, plain)
        if box is None:
            return None
        strides = _strides(ref)
        fixed = [d for d, dim in enumerate(ref.dims) if isinstance(dim, str)]
        if fixed and not ref.wide and self.scopes.invariant(self.indent, [ref.dims[d] for d in fixed]):
            kept = [d for d in range(len(ref.dims)) if d not in fixed]
            name = self.descriptors[(ref.ptr, box, len(self.descriptors))] = f"d{len(self.descriptors)}"
            address = " + ".join([ref.ptr] + [_mul(_grouped(ref.dims[d]), strides[d]) for d in fixed])
            self.emit(descriptors.make_source(name, address, [ref.dim_names[d] for d in kept],
                                              [strides[d] for d in kept], [box[d] for d in kept]))
            return name, tuple(box[d] for d in kept), kept
        key = (ref.ptr, box)
        if key not in self.descriptors:
            name = self.descriptors[key] = f"d{len(self.descriptors)}"
            self.descriptor_lines.append(descriptors.make_source(name, ref.ptr, ref.dim_names, strides, box))
        return self.descriptors[key], box, list(range(len(ref.dims)))

    def _box_offsets(self, ref: RefView, dims) -> str:
        """The box origin of a descriptor access: one element index per described array dim."""
        return "[" + ", ".join(ref.dims[d].start if isinstance(ref.dims[d], Range) else ref.dims[d]
                               for d in dims) + "]"

    def _ordered(self, ref: RefView, kind: str) -> None:
        """Before an access of ``kind`` (:mod:`pallas_core.triton.scratch_barriers`) to ``ref``:
        a barrier where ``ref`` is memory scratch another thread of the program may be
        writing or reading in an earlier access."""
        if ref.scratch is not None and self.barriers.access(ref.scratch, kind, _region(ref)):
            self.emit("tl.debug_barrier()")

    def _loop_end(self, entry) -> None:
        """At the end of a loop's body (``entry``: the barrier plan's ``loop_start``): a
        barrier where the next iteration's memory scratch accesses may race this one's."""
        if self.barriers.loop_end(entry):
            self.emit("tl.debug_barrier()")

    def _load(self, ref: RefView, access: dict | None = None) -> Val:
        """``tl.load`` of a view; ``access`` (a masked load): ``mask``, ``other`` Vals and hints."""
        access = access or {}
        self.reads.add(ref.ptr)
        self._ordered(ref, scratch_barriers.LOAD)
        if tma := self._descriptor(ref, access):
            name, box, dims = tma
            value = self.assign(f"{name}.load({self._box_offsets(ref, dims)})", box, ref.dtype)
            if tuple(box) == tuple(ref.shape):
                return value
            return self.assign(f"tl.reshape({value.expr}, {tl_shape(ref.shape)})", ref.shape, ref.dtype)
        offset, mask, shape = self._addresses(ref)
        user = access.get("mask")
        masks = [m for m in (mask, None if user is None or user.expr == "True" else as_code(user)) if m]
        extra = ""
        if masks:
            other = access.get("other")
            extra = f", mask={' & '.join(masks)}, other={as_code(other) if other is not None else 0}"
        extra += _hint_args(access.get("hints", {}))
        value = self.assign(f"tl.load({ref.ptr} + {offset}{extra})", shape, ref.dtype)
        # Every padding lane is in the mask (_addresses), so it reads as `other`.
        value.zero_padding = access.get("other") is None
        return value

    def _store(self, ref: RefView, val: Val, access: dict | None = None) -> None:
        access = access or {}
        self.writes.add(ref.ptr)
        self._ordered(ref, scratch_barriers.STORE)
        if tma := self._descriptor(ref, access):
            name, box, dims = tma
            value = fit(val, ref.shape, ref.dtype)
            if tuple(box) != tuple(ref.shape):
                value = f"tl.reshape({value}, {tl_shape(box)})"
            self.emit(f"{name}.store({self._box_offsets(ref, dims)}, {value})")
            return
        offset, mask, shape = self._addresses(ref)
        user = access.get("mask")
        masks = [m for m in (mask, None if user is None or user.expr == "True" else as_code(user)) if m]
        extra = f", mask={' & '.join(masks)}" if masks else ""
        extra += _hint_args(access.get("hints", {}))
        self.emit(f"tl.store({ref.ptr} + {offset}, {fit(val, shape, ref.dtype)}{extra})")

    def _transforms(self, eqn, env, n_leading):
        return jax.tree.unflatten(eqn.params["tree"], eqn.invars[n_leading:])

    def _register(self, ref: RefView, transforms) -> str | None:
        """The value name of a register scratch accessed whole; raises if accessed otherwise."""
        if not isinstance(ref, RefView) or ref.register is None:
            return None
        if all(_is_whole(t, ref.shape) for t in transforms):
            return ref.register_name
        self._needs_memory(ref)

    def _take_access(self, ref) -> dict | None:
        """The pending masked access of a load / store marker, consumed by its one get / swap."""
        access, self.access = self.access, None
        if access is not None and isinstance(ref, RefView) and ref.register is not None:
            self._needs_memory(ref)  # masked access: the buffer lives in memory
        return access

    def _needs_memory(self, ref: RefView):
        """Raises for a register Ref accessed other than whole: a scratch buffer is then
        written again in memory (:func:`generate`); a Ref made in the kernel has none."""
        if not isinstance(ref.register, str):
            raise _ScratchNeedsMemory(ref.register)
        raise NotImplementedError(
            f"triton backend: a Ref made inside kernel {self.call.name} (jax.new_ref of a value, "
            "as lax.scan under JAX's jax_scan3 flag makes for its carry and stacked outputs) is "
            "read or written other than whole, which is not supported; use a scratch buffer "
            "(scratch_shapes) for it.")

    def _p_get(self, eqn, env, ref, *idx):
        access = self._take_access(ref)
        transforms = self._transforms(eqn, env, 1)
        if register := self._register(ref, transforms):
            # A copy: the register is reassigned by later writes, this value must not be.
            return self.assign(register, ref.shape, ref.dtype)
        return self._load(self._view(ref, transforms, env, _guarded(access)), access)

    def _p_swap(self, eqn, env, ref, val, *idx):
        access = self._take_access(ref)
        transforms = self._transforms(eqn, env, 2)
        if register := self._register(ref, transforms):
            old = self.assign(register, ref.shape, ref.dtype) if eqn.outvars[0] in self.used else None
            self.emit(f"{register} = {fit(val, ref.shape, ref.dtype)}")
            return old
        view = self._view(ref, transforms, env, _guarded(access))
        old = None
        if eqn.outvars[0] in self.used:  # the value a swap returns is rarely read
            old = self._load(view, access)
        self._store(view, val, access)
        return old

    def _p_addupdate(self, eqn, env, ref, val, *idx):
        transforms = self._transforms(eqn, env, 2)
        if register := self._register(ref, transforms):
            self.emit(f"{register} = {register} + {as_code(val)}")
            return
        view = self._view(ref, transforms, env)
        current = self._load(view)
        total = self.assign(f"{current.expr} + {as_code(val)}", current.shape, current.dtype)
        self._store(view, total)

    def _p_axis_index(self, eqn, env):
        """``lax.axis_index(name)`` of a named grid axis: that axis's program id
        (:mod:`pallas_core.named_axes`)."""
        names = self.call.grid_names or ()
        name = eqn.params["axis_name"]
        if name not in names:
            raise NameError(f"triton backend: lax.axis_index({name!r}) in kernel {self.call.name}: "
                            f"the grid's axis names are {tuple(names)}.")
        return Val(self.ids[self.call.num_batch_axes + names.index(name)], (), np.dtype(np.int32))

    def _p_new_ref(self, eqn, env, value):
        if isinstance(value, RefView):  # the Ref over an operand (or scratch) block
            return value
        # A Ref over a value made in the kernel (lax.scan under jax_scan3 keeps its carry in
        # such Refs): a value name carried through loops, as a register scratch buffer is.
        aval = eqn.outvars[0].aval.inner_aval
        name = self.fresh("loc")
        self.emit(f"{name} = {fit(value, aval.shape, aval.dtype)}")
        rank = len(aval.shape)
        return RefView(ptr=name, array_shape=tuple(aval.shape), dim_names=(),
                       dims=tuple(Range("0", n, 1) for n in aval.shape), masked=(False,) * rank,
                       dtype=np.dtype(aval.dtype), wide=False, register=name)

    def _p_freeze(self, eqn, env, ref):
        return None

    # ---- control flow and calls ----------------------------------------------------
    def _inline(self, closed, args, env):
        sub = {v: a for v, a in zip(closed.jaxpr.invars, args) if not isinstance(a, RefView)}
        saved = {}
        for v, a in zip(closed.jaxpr.invars, args):
            if isinstance(a, RefView):
                saved[v] = a
        self.ref_of_value.update(saved)
        return self.body(closed.jaxpr, closed.consts, sub, returns=True)

    def _p_pjit(self, eqn, env, *args):
        name = str(eqn.params.get("name", ""))
        if name.startswith(ATOMIC_PREFIX):
            return self._atomic(name[len(ATOMIC_PREFIX):], eqn.params["jaxpr"], args)
        if markers.is_marker(name):
            return self._marker(name, eqn, env, args)
        if name.startswith(inline_asm.PREFIX):
            return self._inline_asm(inline_asm.snippet(name), args)
        return self._inline(eqn.params["jaxpr"], args, env)

    def _inline_asm(self, snippet, args):
        """``tl.inline_asm_elementwise`` for ``pltriton.elementwise_inline_asm``."""
        asm, constraints, pack, results = snippet
        dtypes = [tl_dtype(d) for _, d in results]
        dtype = dtypes[0] if len(dtypes) == 1 else "(" + ", ".join(dtypes) + ",)"
        expr = (f"tl.inline_asm_elementwise({asm!r}, {constraints!r}, [{', '.join(map(as_code, args))}], "
                f"dtype={dtype}, is_pure=True, pack={pack})")
        if len(results) == 1:
            return [self.assign(expr, *results[0])]
        name = self.fresh()
        self.emit(f"{name} = {expr}")
        return [self.assign(f"{name}[{k}]", *r) for k, r in enumerate(results)]

    def _marker(self, name, eqn, env, args):
        """A call of :mod:`pallas_core.triton.markers`: its Triton spelling."""
        closed = eqn.params["jaxpr"]
        if name.startswith((markers.LOAD, markers.STORE)):
            load = name.startswith(markers.LOAD)
            base = markers.LOAD if load else markers.STORE
            mask = args[0] if load else args[1]
            self.access = dict(mask=mask, other=args[1] if load else None,
                               hints=markers.parse_hints(name, base))
            try:
                return self._inline(closed, args, env)
            finally:
                self.access = None
        if name.startswith(markers.HINT):
            kind, values = markers.parse_hint(name)
            (x,) = args
            if not x.shape and not x.expr.isidentifier():  # a literal: nothing to annotate
                return [x]
            return [self.assign(f"tl.{kind}({x.expr}, {values})", x.shape, x.dtype)]
        if name == markers.APPROX_TANH:
            (x,) = args
            if np.dtype(x.dtype) == np.float64:  # PTX has no approximate float64 tanh
                return [self._math("tanh", eqn, x)]
            return [self._math("approx_tanh", eqn, x)]
        if name.startswith(markers.MATH):
            return [self._math(name[len(markers.MATH):], eqn, *args)]
        if name == markers.DEBUG_BARRIER:
            self.emit("tl.debug_barrier()")
            self.barriers.barrier()
            return []
        if name.startswith(markers.ROLL):
            return [self._roll(*markers.parse_roll(name), *args)]
        if name.startswith(markers.DEBUG_PRINT):
            self._device_print(markers.print_prefix(name), args)
            return []
        return self._inline(closed, args, env)

    def _roll(self, axis, stride, stride_axis, x: Val, shift: Val) -> Val:
        """``pltpu.roll``: ``tl.gather`` along ``axis`` from ``(j - shift - k * stride) mod n``
        (``j`` the lane, ``k`` the lane along ``stride_axis``, ``n`` the dim's logical
        size). A padding lane gathers some lane of the tensor, as padding may."""
        rank, n = len(x.shape), x.shape[axis]
        lanes = lambda a: f"tl.arange(0, {next_power_of_2(x.shape[a])})[{axis_index(a, rank)}]"
        code = as_code(shift)
        # (a traced shift should be >= 0, but a negative one is rolled as jnp.roll would)
        amount = str(int(code) % n) if code.lstrip("-").isdigit() else f"((({code} % {n}) + {n}) % {n})"
        if stride is not None:  # slice k rolls by shift + k * stride
            amount = f"(({amount} + {lanes(stride_axis)} * {stride % n}) % {n})"
        wrapped = self.fresh("r")  # in (-n, P): one wrap-around fixes the negative ones
        self.emit(f"{wrapped} = {lanes(axis)} - {amount}")
        self.emit(f"{wrapped} = tl.broadcast_to(tl.where({wrapped} < 0, {wrapped} + {n}, {wrapped}), "
                  f"{tl_shape(x.shape)})")
        return self.assign(f"tl.gather({as_code(x)}, {wrapped}, {axis})", x.shape, x.dtype)

    def _device_print(self, prefix: str, values) -> None:
        """``tl.device_print`` of ``pl.debug_print`` (:mod:`pallas_core.debugging`): Triton
        prints the prefix and each value, with the program's id. 16-bit floats go as
        float32 (Triton's CPU interpreter would print bfloat16 bit patterns)."""
        printed = []
        for v in values:
            if any(next_power_of_2(d) != d for d in v.shape):
                raise NotImplementedError(
                    f"debug_print: the triton backend prints whole Triton tensors, whose dims are "
                    f"powers of two; a value of shape {tuple(v.shape)} would print padding lanes "
                    f"(kernel {self.call.name}). Print a power-of-two slice or a reduction of it.")
            code = as_code(v)
            if np.dtype(v.dtype).itemsize == 2 and jnp.issubdtype(v.dtype, jnp.floating):
                code = f"({code}).to(tl.float32)"
            printed.append(code)
        self.emit(f"tl.device_print({prefix!r}{''.join(', ' + c for c in printed)})")

    def _atomic(self, op, closed, args):
        """``tl.atomic_<op>`` at the address the atomic's body reads (pallas_core.triton.atomics)."""
        jaxpr = closed.jaxpr
        ref, val, mask, cmp = args[:4]
        if ref.register is not None:
            self._needs_memory(ref)
        inner = {v: a for v, a in zip(jaxpr.invars, args) if not isinstance(a, RefView)}
        self.ref_of_value.update({v: a for v, a in zip(jaxpr.invars, args) if isinstance(a, RefView)})
        get = next(e for e in jaxpr.eqns if e.primitive.name == "get")
        guarded = mask.expr != "True"  # the mask guards lanes past the edge
        view = self._view(ref, jax.tree.unflatten(get.params["tree"], get.invars[1:]), inner, guarded)
        self.reads.add(view.ptr)
        self.writes.add(view.ptr)
        self._ordered(view, scratch_barriers.ATOMIC)
        offset, bounds, shape = self._addresses(view)
        masks = [m for m in (bounds, as_code(mask) if mask.expr != "True" else None) if m]
        where = f", mask={' & '.join(masks)}" if masks else ""
        if op == "cas":
            expr = f"tl.atomic_cas({view.ptr} + {offset}, {as_code(cmp)}, {as_code(val)})"
        else:
            expr = f"tl.atomic_{op}({view.ptr} + {offset}, {as_code(val)}{where})"
        return [self.assign(expr, shape, view.dtype)]

    _p_jit = _p_pjit

    def _p_closed_call(self, eqn, env, *args):
        return self._inline(eqn.params["call_jaxpr"], args, env)

    # JAX after 0.11.0 calls a jaxpr with ``eval_jaxpr`` (same ``call_jaxpr`` param)
    # where 0.10 and 0.11.0 stage ``closed_call``.
    _p_eval_jaxpr = _p_closed_call

    def _p_remat2(self, eqn, env, *args):
        """``jax.checkpoint`` / ``jax.remat``: inside a kernel only a recomputation hint
        for JAX's autodiff, so its body is written in place (an open jaxpr in 0.10)."""
        return self._inline(_jax_internals.as_closed(eqn.params["jaxpr"]), args, env)

    def _p_custom_jvp_call(self, eqn, env, *args):
        return self._inline(eqn.params["call_jaxpr"], args, env)

    def _p_custom_vjp_call(self, eqn, env, *args):
        jaxpr = eqn.params.get("call_jaxpr") or eqn.params.get("fun_jaxpr")
        return self._inline(jaxpr, args, env)

    def _bind_outputs(self, eqn):
        return [self.fresh("c") for _ in eqn.outvars]

    def _p_cond(self, eqn, env, index, *args):
        branches = eqn.params["branches"]
        names = self._bind_outputs(eqn)
        before, after = self.barriers.save(), []
        for k, branch in enumerate(branches):
            self.barriers.restore(before)
            if k == 0:
                cond = f"{as_code(index)} == 0" if len(branches) > 1 else "True"
                self.emit(f"if {cond}:")
            elif k < len(branches) - 1:
                self.emit(f"elif {as_code(index)} == {k}:")
            else:
                self.emit("else:")
            self.indent += 1
            start = len(self.lines)
            outs = self._inline(branch, args, env)
            for name, out in zip(names, outs):
                self.emit(f"{name} = {as_code(out)}")
            if len(self.lines) == start:
                self.emit("pass")
            self.indent -= 1
            after.append(self.barriers.save())
        self.barriers.merge(after)
        return [Val(n, v.aval.shape, np.dtype(v.aval.dtype)) for n, v in zip(names, eqn.outvars)]

    def _p_scan(self, eqn, env, *args):
        p = eqn.params
        n_consts, n_carry = _jax_internals.scan_sizes(p)
        if len(args) != n_consts + n_carry or p["reverse"]:
            self.unsupported(eqn, "scan with stacked inputs/outputs or reverse=True")
        consts, init = args[:n_consts], args[n_consts:]
        carry = [self.fresh("c") for _ in init]
        for name, value in zip(carry, init):
            self.emit(f"{name} = {as_code(value)}")
        self.emit(f"for _ in range({int(p['length'])}):")
        self.indent += 1
        entry = self.barriers.loop_start()
        avals = [v.aval for v in eqn.outvars]
        current = [Val(n, a.shape, np.dtype(a.dtype)) for n, a in zip(carry, avals)]
        outs = self._inline(p["jaxpr"], list(consts) + current, env)
        for name, out in zip(carry, outs):
            self.emit(f"{name} = {as_code(out)}")
        self._loop_end(entry)
        self.indent -= 1
        return current

    def _p_while(self, eqn, env, *args):
        p = eqn.params
        nc, nb = p["cond_nconsts"], p["body_nconsts"]
        cond_consts, body_consts, init = args[:nc], args[nc:nc + nb], args[nc + nb:]
        if _is_counted_loop(p):
            return self._counted_loop(eqn, env, body_consts, init)
        carry = [self.fresh("c") for _ in init]
        for name, value in zip(carry, init):
            self.emit(f"{name} = {as_code(value)}")
        avals = [v.aval for v in eqn.outvars]
        current = [Val(n, a.shape, np.dtype(a.dtype)) for n, a in zip(carry, avals)]
        flag = self.fresh("w")
        (first,) = self._inline(p["cond_jaxpr"], list(cond_consts) + current, env)
        self.emit(f"{flag} = {as_code(first)}")
        self.emit(f"while {flag}:")
        self.indent += 1
        entry = self.barriers.loop_start()
        outs = self._inline(p["body_jaxpr"], list(body_consts) + current, env)
        for name, out in zip(carry, outs):
            self.emit(f"{name} = {as_code(out)}")
        (again,) = self._inline(p["cond_jaxpr"], list(cond_consts) + current, env)
        self.emit(f"{flag} = {as_code(again)}")
        self._loop_end(entry)
        self.indent -= 1
        return current


    def _counted_loop(self, eqn, env, body_consts, init):
        """``lax.fori_loop(lower, upper, ...)`` with traced bounds as ``for i in range(lower, upper)``.

        Triton software-pipelines the loads of an ``scf.for`` loop (cp.async /
        TMA stages), never those of an ``scf.while``; loops whose bounds depend on
        the program id (the key/value range of flash attention) are the ones
        that need it.
        """
        p = eqn.params
        counter, upper = self.fresh("c"), self.fresh("c")
        carry = [self.fresh("c") for _ in init[2:]]
        self.emit(f"{upper} = {as_code(init[1])}")
        for name, value in zip(carry, init[2:]):
            self.emit(f"{name} = {as_code(value)}")
        avals = [v.aval for v in eqn.outvars]
        current = [Val(counter, (), np.dtype(np.int32)), Val(upper, (), np.dtype(np.int32))]
        current += [Val(n, a.shape, np.dtype(a.dtype)) for n, a in zip(carry, avals[2:])]
        self.emit(f"for {counter} in range({as_code(init[0])}, {upper}):")
        self.indent += 1
        entry = self.barriers.loop_start()
        outs = self._inline(p["body_jaxpr"], list(body_consts) + current, env)
        for name, out in zip(carry, outs[2:]):
            self.emit(f"{name} = {as_code(out)}")
        self.emit("pass")
        self._loop_end(entry)
        self.indent -= 1
        final = None
        if eqn.outvars[0] in self.used:  # the counter after the loop: max(lower, upper)
            final = self.assign(f"tl.maximum({as_code(init[0])}, {upper})", (), np.int32)
        return [final, current[1], *current[2:]]


def _is_counted_loop(params) -> bool:
    """Whether a ``while`` is ``fori_loop``'s: carry ``(i, upper, ...)``, ``i < upper``, ``i += 1``."""
    cond, body = params["cond_jaxpr"].jaxpr, params["body_jaxpr"].jaxpr
    if params["cond_nconsts"] or len(cond.invars) < 2 or len(cond.eqns) != 1:
        return False
    (lt,) = cond.eqns
    i, upper = cond.invars[0], cond.invars[1]
    if (lt.primitive.name != "lt" or list(lt.invars) != [i, upper] or cond.outvars != lt.outvars
            or np.dtype(i.aval.dtype) != np.int32 or np.dtype(upper.aval.dtype) != np.int32):
        return False
    nb = params["body_nconsts"]
    bi, bupper = body.invars[nb], body.invars[nb + 1]
    if body.outvars[1] is not bupper:
        return False
    inc = next((e for e in body.eqns if body.outvars[0] in e.outvars), None)
    return (inc is not None and inc.primitive.name == "add" and inc.invars[0] is bi
            and isinstance(inc.invars[1], jex_core.Literal) and int(inc.invars[1].val) == 1)


def _identifier(name: str) -> str:
    out = "".join(c if c.isalnum() or c == "_" else "_" for c in name)
    return out if out and not out[0].isdigit() else f"k_{out}"


def _user_frame(eqn) -> str:
    try:
        from jax._src import source_info_util
        frame = source_info_util.user_frame(eqn.source_info.traceback)
        if frame is not None:
            return f" (at {frame.file_name}:{frame.start_line})"
    except Exception:  # noqa: BLE001 - best effort only
        pass
    return ""


def _guarded(access: dict | None) -> bool:
    """Whether a masked access's mask may guard lanes past the edge (it is not ``True``)."""
    return access is not None and access.get("mask") is not None and access["mask"].expr != "True"


def _hint_args(hints: dict) -> str:
    """``tl.load`` / ``tl.store`` keyword arguments for memory hints."""
    out = ""
    if "cache_modifier" in hints:
        out += f", cache_modifier={hints['cache_modifier']!r}"
    if "eviction_policy" in hints:
        out += f", eviction_policy={hints['eviction_policy']!r}"
    if hints.get("volatile"):
        out += ", volatile=True"
    return out


def _is_whole(indexer, shape) -> bool:
    """Whether an NDIndexer selects every element of a view of ``shape``, in order."""
    if tuple(indexer.int_indexer_shape) or len(indexer.indices) != len(shape):
        return False
    for idx, n in zip(indexer.indices, shape):
        if not (hasattr(idx, "size") and hasattr(idx, "stride") and hasattr(idx, "start")):
            return False
        start = idx.start
        if not isinstance(start, (int, np.integer)) or int(start) != 0 or int(idx.size) != n or int(idx.stride) != 1:
            return False
    return True


def _static_int(expr: str) -> int | None:
    """The value of an index expression made of integer literals, ``+``, ``-`` and ``*``
    (as :func:`_add` and :func:`_mul` write them), or None where it names anything."""
    try:
        tree = ast.parse(expr, mode="eval").body
    except SyntaxError:
        return None

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            inner = value(node.operand)
            return None if inner is None else -inner
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult)):
            a, b = value(node.left), value(node.right)
            if a is None or b is None:
                return None
            return a + b if isinstance(node.op, ast.Add) else a - b if isinstance(node.op, ast.Sub) else a * b
        return None
    return value(tree)


def _region(ref: RefView) -> scratch_barriers.Region:
    """Per array dim of a view, the first and last index it may touch (None: unknown,
    a dynamic index or a gather)."""
    region = []
    for dim in ref.dims:
        if isinstance(dim, Range):
            start = _static_int(dim.start)
            end = None if start is None else start + (dim.size - 1) * dim.stride
            region.append(None if start is None else (min(start, end), max(start, end)))
        elif isinstance(dim, str):
            at = _static_int(dim)
            region.append(None if at is None else (at, at))
        else:
            region.append(None)
    return tuple(region)


def generate(call) -> tuple[str, str, dict[str, int], list[str]]:
    """``(source, function name, constexprs, pointer parameter names)`` of a call.

    Pointer parameters are ``p<k>`` per operand (inputs, then outputs) and
    ``s<k>`` per scratch buffer kept in global memory.
    """
    closed = trace_kernel(call)
    memory: set[int] = set()
    pointer_only: set[str] = set()
    while True:
        writer = KernelWriter(call, frozenset(memory), frozenset(pointer_only))
        try:
            source = writer.write(closed)
        except _ScratchNeedsMemory as needs:
            memory.add(needs.index)
            continue
        except _DescriptorsNeedPointers as needs:
            pointer_only |= needs.pointers
            continue
        return source, writer.name, dict(writer.constexprs), list(writer.params)
