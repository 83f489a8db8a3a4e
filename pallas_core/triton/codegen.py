"""Kernel jaxpr -> Triton source: pallas_core's own Triton lowering.

The kernel is traced once with its grid ids as scalar inputs and Refs over
its operands (:func:`trace_kernel`); :class:`KernelWriter` then walks the
jaxpr and writes one readable ``@jit`` function:

* every operand is a pointer plus ``tl.constexpr`` array and block dims; a
  Ref is that pointer seen through its block (the index_map, itself traced
  and emitted, gives the block origin) and any ``.at`` views, kept as one
  ``(start, size, stride)`` range or fixed index per array dim;
* loads and stores are masked wherever a block can run past the array, so
  edge blocks need no hand-written masks (seed 000 semantics);
* Triton tensors have power-of-two dims, so a value of logical shape
  ``(8, 96)`` is a ``(8, 128)`` tensor whose padding lanes are never
  stored, are masked out of reductions and dot contractions, and never leak
  into valid lanes otherwise (elementwise ops, broadcasts, transposes and
  forward scans keep lanes apart); reshapes that would mix padding into
  valid lanes raise NotImplementedError;
* parallel grid axes are the launch grid (flattened into axis 0, decoded
  with constexpr div/mod); arbitrary axes run as loops inside each program,
  so a TPU-style reduction over a grid axis is correct (DESIGN 2.4);
* jaxpr primitives map to ``tl`` builtins only. Combine functions for
  reductions are defined in the generated module under the name ``jit``,
  bound when the source is loaded (``triton.jit`` for GPUs and ahead-of-time
  compiles, the interpreter's wrapper on a CPU), so one source serves both.

Anything not covered raises NotImplementedError naming the primitive, the
kernel and the user's source line.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

from pallas_core import context
from pallas_core.params import ARBITRARY, PARALLEL
from pallas_core.primitives import next_power_of_2
from pallas_core.triton import jit_helpers
from pallas_core.triton.atomics import ATOMIC_PREFIX

_TL_DTYPES = {
    "float32": "tl.float32", "float16": "tl.float16", "bfloat16": "tl.bfloat16",
    "float64": "tl.float64", "int8": "tl.int8", "int16": "tl.int16", "int32": "tl.int32",
    "int64": "tl.int64", "uint8": "tl.uint8", "uint16": "tl.uint16", "uint32": "tl.uint32",
    "uint64": "tl.uint64", "bool": "tl.int1",
}
_INT32_MAX = 2**31 - 1


def tl_dtype(dtype) -> str:
    name = np.dtype(dtype).name
    try:
        return _TL_DTYPES[name]
    except KeyError:
        raise NotImplementedError(f"the triton backend has no dtype {name}") from None


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
    return jax.make_jaxpr(body)(ids, blocks, scratch)


# ------------------------------------------------------------------------------------
# Values and Refs as the writer sees them
# ------------------------------------------------------------------------------------

@dataclasses.dataclass
class Val:
    """A Triton value: an expression (usually a local name) with its JAX type."""

    expr: str
    shape: tuple[int, ...]
    dtype: Any


@dataclasses.dataclass(frozen=True)
class Range:
    start: str  # an expression in elements of the underlying array
    size: int
    stride: int


@dataclasses.dataclass(frozen=True)
class RefView:
    """A Ref: an operand's pointer seen through its block and ``.at`` views.

    ``dims`` has one entry per array dim: a Range (kept) or a str (fixed index).
    ``masked`` marks array dims a block may run past (loads/stores get masks).
    """

    ptr: str
    array_shape: tuple[int, ...]
    dim_names: tuple[str, ...]  # constexpr names of the array dims
    dims: tuple[Range | str, ...]
    masked: tuple[bool, ...]
    dtype: Any
    wide: bool  # more than 2**31 elements: int64 offsets
    register: int | None = None  # index of a scratch buffer kept as a loop-carried value

    @property
    def register_name(self) -> str:
        return f"acc{self.register}"

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(d.size for d in self.dims if isinstance(d, Range))

    def index(self, indexer, scalar) -> "RefView":
        """Applies one NDIndexer (ints, static or dynamic slices) to the view."""
        if tuple(indexer.int_indexer_shape):
            raise NotImplementedError("array (gather-style) indexing of a Ref is not supported "
                                      "by the triton backend; use slices or pl.ds.")
        kept = [i for i, d in enumerate(self.dims) if isinstance(d, Range)]
        if len(indexer.indices) != len(kept):
            raise NotImplementedError(f"indexer of rank {len(indexer.indices)} for a view of rank {len(kept)}")
        dims = list(self.dims)
        for axis, idx in zip(kept, indexer.indices):
            base: Range = dims[axis]
            if hasattr(idx, "size") and hasattr(idx, "stride") and hasattr(idx, "start"):
                start = scalar(idx.start)
                dims[axis] = Range(_add(base.start, _mul(start, str(base.stride))), int(idx.size),
                                   base.stride * int(idx.stride))
            else:
                dims[axis] = _add(base.start, _mul(scalar(idx), str(base.stride)))
        return dataclasses.replace(self, dims=tuple(dims))


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

_BINARY = {"add": "+", "add_any": "+", "sub": "-", "mul": "*", "eq": "==", "ne": "!=", "lt": "<", "le": "<=",
           "gt": ">", "ge": ">=", "and": "&", "or": "|", "xor": "^"}
_UNARY_TL = {"exp": "tl.exp", "exp2": "tl.exp2", "log": "tl.log", "sqrt": "tl.sqrt",
             "rsqrt": "tl.rsqrt", "abs": "tl.abs", "floor": "tl.floor", "ceil": "tl.ceil",
             "sin": "tl.sin", "cos": "tl.cos", "erf": "tl.erf"}
class _ScratchNeedsMemory(Exception):
    """Raised while writing when scratch ``index`` is accessed other than as a whole block."""

    def __init__(self, index: int):
        super().__init__(index)
        self.index = index


class KernelWriter:
    """Writes the Triton source of one resolved pallas_call.

    Args:
      memory_scratch: indices of scratch buffers kept in global memory; every
        other scratch buffer is a loop-carried value (see :meth:`_scratch_ref`).
    """

    def __init__(self, call, memory_scratch: frozenset[int] = frozenset()):
        self.call = call
        self.memory_scratch = memory_scratch
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

    # ---- small helpers -------------------------------------------------------------
    def fresh(self, prefix="v") -> str:
        self.counter += 1
        return f"{prefix}{self.counter}"

    def emit(self, line: str) -> None:
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
        # Program ids: parallel axes decoded from the flat launch id, arbitrary axes looped.
        ids: dict[int, str] = {}
        if parallel:
            self.emit("pid = tl.program_id(0)")
            for pos, a in enumerate(reversed(parallel)):
                last = pos == len(parallel) - 1
                ids[a] = f"i{a}"
                self.emit(f"i{a} = pid % G{a}" if not last else f"i{a} = pid")
                if not last:
                    self.emit(f"pid = pid // G{a}")
        for ref in scratch_refs:
            if ref.register is not None:  # garbage is unspecified: zeros are as good as anything
                self.emit(f"{ref.register_name} = tl.full({_shape(ref.shape)}, 0, {tl_dtype(ref.dtype)})")
        for a in arbitrary:
            self.emit(f"for i{a} in range(G{a}):")
            self.indent += 1
            ids[a] = f"i{a}"
        env: dict = {}
        id_vars = jaxpr.invars[:len(grid)]
        for a, var in enumerate(id_vars):
            env[var] = Val(ids[a], (), np.dtype(np.int32))
        mappings = list(call.in_mappings) + list(call.out_mappings)
        operand_vars = jaxpr.invars[len(grid):len(grid) + len(mappings)]
        scratch_vars = jaxpr.invars[len(grid) + len(mappings):]
        self.ref_of_value: dict = {}
        for k, (m, var) in enumerate(zip(mappings, operand_vars)):
            self.ref_of_value[var] = self._operand_ref(k, m, ids)
        for ref, var in zip(scratch_refs, scratch_vars):
            self.ref_of_value[var] = ref
        self.body(jaxpr, closed.consts, env)
        self.emit("pass")  # keeps a loop over arbitrary axes well-formed if its body is empty
        header = self._header(len(mappings))
        helpers = "".join(jit_helpers.combiner_source(n) for n in sorted(self.combiners))
        helpers += "".join(jit_helpers.math_source(n) for n in jit_helpers.with_dependencies(self.math))
        return ("import triton.language as tl\n" + helpers + "\n\n@jit\n" + header + "\n"
                + "\n".join(self.lines) + "\n")

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
        dims, masked = [], []
        for d in range(rank):
            start = _mul(block_idx[d], blocks[d])
            if m.squeezed[d]:
                dims.append(start)
            else:
                dims.append(Range(start, m.block_shape[d], 1))
            masked.append(m.array_shape[d] % m.block_shape[d] != 0)
        numel = int(np.prod(m.array_shape)) if rank else 1
        return RefView(ptr=f"p{k}", array_shape=m.array_shape, dim_names=names, dims=tuple(dims),
                       masked=tuple(masked), dtype=np.dtype(m.dtype), wide=numel > _INT32_MAX)

    def _scratch_ref(self, k, s, parallel) -> RefView:
        """A scratch buffer: a loop-carried value, or private global memory.

        A scratch buffer only ever read and written whole (``acc_ref[...]``,
        the usual accumulator) is a value named ``acc{k}`` that Triton carries
        through the loops over arbitrary axes, i.e. registers: the classic
        Triton matmul. One accessed any other way (slices, atomics) lives in
        global memory, one private slice per launched program;
        :func:`generate` finds out which by writing the kernel again after
        :class:`_ScratchNeedsMemory`.
        """
        rank = len(s.shape)
        names = tuple(self.constexpr(f"S{k}_{d}", s.shape[d]) for d in range(rank))
        numel = int(np.prod(s.shape)) if rank else 1
        ptr = f"s{k}" if not parallel else f"(s{k} + tl.program_id(0) * {numel})"
        # Rank 0 stays in memory: a Triton scalar cannot be carried like a block.
        register = k if rank and k not in self.memory_scratch else None
        return RefView(ptr=ptr, array_shape=tuple(s.shape), dim_names=names,
                       dims=tuple(Range("0", n, 1) for n in s.shape), masked=(False,) * rank,
                       dtype=np.dtype(s.dtype), wide=False, register=register)

    def _index_map(self, m, ids) -> list[str]:
        grid = self.call.grid
        closed = jax.make_jaxpr(m.index_map)(*[jnp.int32(0)] * len(grid))
        env = {v: Val(ids[a], (), np.dtype(np.int32)) for a, v in enumerate(closed.jaxpr.invars)}
        outs = self.body(closed.jaxpr, closed.consts, env, returns=True)
        return [o.expr for o in outs]

    # ---- jaxpr walking -------------------------------------------------------------
    def read(self, env, atom) -> Any:
        if isinstance(atom, jex_core.Literal):
            return _literal(atom.val, atom.aval)
        if atom in self.ref_of_value:
            return self.ref_of_value[atom]
        return env[atom]

    def body(self, jaxpr, consts, env, returns=False):
        self.used.update(v for e in jaxpr.eqns for v in e.invars if not isinstance(v, jex_core.Literal))
        self.used.update(v for v in jaxpr.outvars if not isinstance(v, jex_core.Literal))
        for var, c in zip(jaxpr.constvars, consts):
            env[var] = _literal(c, var.aval)
        for eqn in jaxpr.eqns:
            self.equation(eqn, env)
        if returns:
            return [self.read(env, v) for v in jaxpr.outvars]
        return None

    def scalar(self, env):
        def convert(x):
            if isinstance(x, (int, np.integer)):
                return str(int(x))
            val = self.read(env, x)
            return val.expr
        return convert

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
            if name in _BINARY:
                a, b = args
                out = self.assign(f"{_expr(a)} {_BINARY[name]} {_expr(b)}", eqn.outvars[0].aval.shape,
                                  eqn.outvars[0].aval.dtype)
                env[eqn.outvars[0]] = out
                return
            if name in _UNARY_TL:
                env[eqn.outvars[0]] = self._unary(f"{_UNARY_TL[name]}({{x}})", args[0], eqn)
                return
            self.unsupported(eqn)
        outs = handler(eqn, env, *args)
        if outs is None:
            return
        if not isinstance(outs, (list, tuple)):
            outs = [outs]
        for var, out in zip(eqn.outvars, outs):
            env[var] = out

    def _unary(self, template, x, eqn):
        aval = eqn.outvars[0].aval
        xf = _expr(x)
        needs_f32 = np.dtype(aval.dtype) in (np.dtype(jnp.bfloat16), np.dtype(np.float16))
        if needs_f32 and not template.startswith("tl.abs"):
            xf = f"{xf}.to(tl.float32)"
            return self.assign(template.format(x=xf) + f".to({tl_dtype(aval.dtype)})", aval.shape, aval.dtype)
        return self.assign(template.format(x=xf), aval.shape, aval.dtype)

    # ---- refs ----------------------------------------------------------------------
    def _view(self, ref: RefView, transforms, env) -> RefView:
        for t in transforms:
            ref = ref.index(t, self.scalar(env))
        return ref

    def _addresses(self, ref: RefView):
        """(offsets expr, mask expr or None, result shape) of a view."""
        rank = len(ref.shape)
        axis = 0
        offsets, masks = [], []
        # Row-major strides, written with the constexpr array dims.
        strides = ["1"] * len(ref.array_shape)
        for d in reversed(range(len(ref.array_shape) - 1)):
            strides[d] = _mul(strides[d + 1], ref.dim_names[d + 1])
        for d, dim in enumerate(ref.dims):
            if isinstance(dim, Range):
                index = self.fresh("r")
                shape_ix = _axis_index(axis, rank)
                step = f" * {dim.stride}" if dim.stride != 1 else ""
                lanes = f"tl.arange(0, {next_power_of_2(dim.size)}){step}"
                self.emit(f"{index} = ({_add(dim.start, lanes)})[{shape_ix}]")
                if next_power_of_2(dim.size) != dim.size:  # padding lanes: never read or written
                    masks.append(_lane_mask(axis, dim.size, rank))
                axis += 1
            else:
                index = self.fresh("r")
                self.emit(f"{index} = {dim}")
            if ref.wide:
                index_wide = f"{index}.to(tl.int64)"
            else:
                index_wide = index
            offsets.append(_mul(index_wide, strides[d]))
            if ref.masked[d]:
                masks.append(f"({index} < {ref.dim_names[d]})")
        offset = " + ".join(offsets) if offsets else "0"
        mask = " & ".join(masks) if masks else None
        return offset, mask, ref.shape

    def _load(self, ref: RefView) -> Val:
        offset, mask, shape = self._addresses(ref)
        extra = f", mask={mask}, other=0" if mask else ""
        return self.assign(f"tl.load({ref.ptr} + {offset}{extra})", shape, ref.dtype)

    def _store(self, ref: RefView, val: Val) -> None:
        offset, mask, shape = self._addresses(ref)
        extra = f", mask={mask}" if mask else ""
        self.emit(f"tl.store({ref.ptr} + {offset}, {_fit(val, shape, ref.dtype)}{extra})")

    def _transforms(self, eqn, env, n_leading):
        return jax.tree.unflatten(eqn.params["tree"], eqn.invars[n_leading:])

    def _register(self, ref: RefView, transforms) -> str | None:
        """The value name of a register scratch accessed whole; raises if accessed otherwise."""
        if not isinstance(ref, RefView) or ref.register is None:
            return None
        if all(_is_whole(t, ref.shape) for t in transforms):
            return ref.register_name
        raise _ScratchNeedsMemory(ref.register)

    def _p_get(self, eqn, env, ref, *idx):
        transforms = self._transforms(eqn, env, 1)
        if register := self._register(ref, transforms):
            # A copy: the register is reassigned by later writes, this value must not be.
            return self.assign(register, ref.shape, ref.dtype)
        return self._load(self._view(ref, transforms, env))

    def _p_swap(self, eqn, env, ref, val, *idx):
        transforms = self._transforms(eqn, env, 2)
        if register := self._register(ref, transforms):
            old = self.assign(register, ref.shape, ref.dtype) if eqn.outvars[0] in self.used else None
            self.emit(f"{register} = {_fit(val, ref.shape, ref.dtype)}")
            return old
        view = self._view(ref, transforms, env)
        old = None
        if eqn.outvars[0] in self.used:  # the value a swap returns is rarely read
            old = self._load(view)
        self._store(view, val)
        return old

    def _p_addupdate(self, eqn, env, ref, val, *idx):
        transforms = self._transforms(eqn, env, 2)
        if register := self._register(ref, transforms):
            self.emit(f"{register} = {register} + {_expr(val)}")
            return
        view = self._view(ref, transforms, env)
        current = self._load(view)
        total = self.assign(f"{current.expr} + {_expr(val)}", current.shape, current.dtype)
        self._store(view, total)

    def _p_new_ref(self, eqn, env, value):
        if isinstance(value, RefView):  # the Ref over an operand (or scratch) block
            return value
        self.unsupported(eqn, "allocating a Ref inside the kernel (run_scoped)")

    def _p_freeze(self, eqn, env, ref):
        return None

    # ---- elementwise ---------------------------------------------------------------
    def _p_neg(self, eqn, env, x):
        # Triton negates as 0 - x, which turns -0.0 into +0.0; * -1 is IEEE negation.
        expr = f"{_expr(x)} * -1.0" if _is_float(x.dtype) else f"-{_expr(x)}"
        return self.assign(expr, x.shape, x.dtype)

    def _p_not(self, eqn, env, x):
        if np.dtype(x.dtype) == np.bool_:
            return self.assign(f"{_expr(x)} == 0", x.shape, x.dtype)
        return self.assign(f"~{_expr(x)}", x.shape, x.dtype)

    def _p_div(self, eqn, env, a, b):
        aval = eqn.outvars[0].aval
        op = "//" if np.issubdtype(aval.dtype, np.integer) else "/"
        return self.assign(f"{_expr(a)} {op} {_expr(b)}", aval.shape, aval.dtype)

    def _p_rem(self, eqn, env, a, b):
        aval = eqn.outvars[0].aval
        return self.assign(f"{_expr(a)} % {_expr(b)}", aval.shape, aval.dtype)

    def _p_max(self, eqn, env, a, b):
        return self._extremum("maximum", eqn, a, b)

    def _p_min(self, eqn, env, a, b):
        return self._extremum("minimum", eqn, a, b)

    def _extremum(self, fn, eqn, a, b):
        aval = eqn.outvars[0].aval
        return self.assign(f"tl.{fn}({_expr(a)}, {_expr(b)}{_nan_policy(aval.dtype)})", aval.shape, aval.dtype)

    def _p_clamp(self, eqn, env, lo, x, hi):
        keep = _nan_policy(x.dtype)
        return self.assign(f"tl.minimum(tl.maximum({_expr(x)}, {_expr(lo)}{keep}), {_expr(hi)}{keep})",
                           x.shape, x.dtype)

    def _p_pow(self, eqn, env, a, b):
        if not _is_float(eqn.outvars[0].aval.dtype):
            self.unsupported(eqn, "pow of integers")
        return self._math("pow", eqn, a, b)

    def _p_integer_pow(self, eqn, env, x):
        """x ** y by repeated squaring, like XLA (y is a static int)."""
        y = int(eqn.params["y"])
        if y == 0:
            return self.assign(f"tl.full({_shape(x.shape)}, 1, {tl_dtype(x.dtype)})", x.shape, x.dtype)
        result, square, n = None, x, abs(y)
        while n:
            if n & 1:
                result = square if result is None else self.assign(f"{_expr(result)} * {_expr(square)}",
                                                                   x.shape, x.dtype)
            n >>= 1
            if n:
                square = self.assign(f"{_expr(square)} * {_expr(square)}", x.shape, x.dtype)
        if y < 0:
            return self.assign(f"1.0 / {_expr(result)}", x.shape, x.dtype)
        return result

    def _p_square(self, eqn, env, x):
        return self.assign(f"{_expr(x)} * {_expr(x)}", x.shape, x.dtype)

    def _p_logistic(self, eqn, env, x):
        return self._unary("1.0 / (1.0 + tl.exp(-{x}))", x, eqn)

    def _p_tan(self, eqn, env, x):
        return self._unary("tl.sin({x}) / tl.cos({x})", x, eqn)

    def _p_tanh(self, eqn, env, x):
        return self._math("tanh", eqn, x)

    def _p_log1p(self, eqn, env, x):
        return self._math("log1p", eqn, x)

    def _p_expm1(self, eqn, env, x):
        return self._math("expm1", eqn, x)

    def _p_round(self, eqn, env, x):
        even = eqn.params["rounding_method"] == jax.lax.RoundingMethod.TO_NEAREST_EVEN
        return self._math("round_even" if even else "round_away", eqn, x)

    def _p_sign(self, eqn, env, x):
        # Zero returns itself, so -0.0 keeps its sign and NaN stays NaN, as lax.sign.
        v = _expr(x)
        return self.assign(f"tl.where({v} > 0, 1, tl.where({v} < 0, -1, {v})).to({tl_dtype(x.dtype)})",
                           x.shape, x.dtype)

    def _p_is_finite(self, eqn, env, x):
        v = _expr(x)
        return self.assign(f"({v} == {v}) & (tl.abs({v}) != float(\"inf\"))", x.shape, np.bool_)

    def _math(self, name, eqn, *xs):
        """``_<name>(*xs)``, a :data:`jit_helpers.MATH` helper, computed in float32."""
        aval = eqn.outvars[0].aval
        self.math.add(name)
        # Every argument as a float32 tensor of the result's shape, so helpers
        # never mix Triton scalars with tensors in bitwise ops.
        f32 = [x if np.dtype(x.dtype) == np.float32 else Val(_cast(x, "tl.float32"), x.shape, np.float32)
               for x in xs]
        args = ", ".join(_fit(x, aval.shape, np.float32) for x in f32)
        expr = f"_{name}({args})"
        if np.dtype(aval.dtype) != np.float32:
            expr = f"{expr}.to({tl_dtype(aval.dtype)})"
        return self.assign(expr, aval.shape, aval.dtype)

    # Shifts by the operand's bit width or more (or by a negative amount, which
    # is huge as unsigned) are defined by XLA, unlike in Triton / LLVM.
    def _p_shift_left(self, eqn, env, a, b):
        return self._shift(eqn, a, b, f"{_expr(a)} << {_expr(b)}", "0")

    def _p_shift_right_arithmetic(self, eqn, env, a, b):
        bits = np.dtype(a.dtype).itemsize * 8
        return self._shift(eqn, a, b, f"{_expr(a)} >> {_expr(b)}", f"{_expr(a)} >> {bits - 1}")

    def _p_shift_right_logical(self, eqn, env, a, b):
        dtype = np.dtype(a.dtype)
        if np.issubdtype(dtype, np.signedinteger):  # Triton's >> is logical only on unsigned ints
            unsigned = tl_dtype(np.dtype(f"uint{dtype.itemsize * 8}"))
            shifted = f"({_expr(a)}.to({unsigned}, bitcast=True) >> {_expr(b)}).to({tl_dtype(dtype)}, bitcast=True)"
        else:
            shifted = f"{_expr(a)} >> {_expr(b)}"
        return self._shift(eqn, a, b, shifted, "0")

    def _shift(self, eqn, a, b, shifted, out_of_range):
        aval = eqn.outvars[0].aval
        bits = np.dtype(a.dtype).itemsize * 8
        amount = _expr(b)
        if amount.lstrip("-").isdigit():  # a literal amount: decide here
            expr = shifted if 0 <= int(amount) < bits else out_of_range
            if expr == "0":
                expr = f"tl.full({_shape(aval.shape)}, 0, {tl_dtype(aval.dtype)})"
            return self.assign(expr, aval.shape, aval.dtype)
        return self.assign(f"tl.where(({amount} >= 0) & ({amount} < {bits}), {shifted}, {out_of_range})"
                           f".to({tl_dtype(aval.dtype)})", aval.shape, aval.dtype)

    def _p_select_n(self, eqn, env, pred, *cases):
        aval = eqn.outvars[0].aval
        if len(cases) != 2:
            self.unsupported(eqn, "select_n with more than two cases")
        return self.assign(f"tl.where({_expr(pred)}, {_expr(cases[1])}, {_expr(cases[0])})",
                           aval.shape, aval.dtype)

    def _p_copy_p(self, eqn, env, x):
        return x

    # Values only; autodiff never reaches inside a kernel.
    _p_copy = _p_stop_gradient = _p_copy_p

    def _p_bitcast_convert_type(self, eqn, env, x):
        aval = eqn.outvars[0].aval
        if np.dtype(aval.dtype).itemsize != np.dtype(x.dtype).itemsize:
            self.unsupported(eqn, "bitcast between dtypes of different widths")
        return self.assign(f"{_expr(x)}.to({tl_dtype(aval.dtype)}, bitcast=True)", aval.shape, aval.dtype)

    def _p_convert_element_type(self, eqn, env, x):
        aval = eqn.outvars[0].aval
        src, dst = np.dtype(x.dtype), np.dtype(aval.dtype)
        if _is_float(src) and np.issubdtype(dst, np.integer):
            return self._float_to_int(x, aval)
        # JAX rounds float downcasts to nearest-even; say so, Triton's default may differ.
        rounding = (', fp_downcast_rounding="rtne"'
                    if _is_float(src) and _is_float(dst)
                    and dst.itemsize < src.itemsize else "")
        return self.assign(_cast(x, f"{tl_dtype(dst)}{rounding}"), aval.shape, dst)

    def _float_to_int(self, x, aval):
        """XLA's conversion: truncate, saturate at the integer range, NaN -> 0.

        The value is clamped before the cast, so no lane ever converts out of
        range (undefined in LLVM; garbage in Triton's numpy interpreter).
        """
        dst = np.dtype(aval.dtype)
        info = np.iinfo(dst)
        wide = np.float64 if np.dtype(x.dtype) == np.float64 else np.float32  # exact for every 16-bit float
        v = _expr(x) if np.dtype(x.dtype) == np.dtype(wide) else _cast(x, tl_dtype(wide))
        hi = 2.0 ** (info.bits - (1 if info.min else 0))  # first value past the range
        below_hi = float(np.nextafter(wide(hi), wide(0)))
        lo = float(info.min)
        xw = self.assign(v, x.shape, wide, prefix="f")
        safe = self.assign(f"tl.minimum(tl.maximum(tl.where({xw.expr} != {xw.expr}, 0.0, {xw.expr}), {lo!r}), "
                           f"{below_hi!r})", x.shape, wide, prefix="f")
        converted = _cast(safe, tl_dtype(dst))
        return self.assign(f"tl.where({xw.expr} >= {hi!r}, {int(info.max)}, {converted}).to({tl_dtype(dst)})",
                           aval.shape, dst)

    def _p_iota(self, eqn, env):
        aval = eqn.outvars[0].aval
        shape, dim = aval.shape, eqn.params["dimension"]
        expr = f"tl.arange(0, {next_power_of_2(shape[dim])})[{_axis_index(dim, len(shape))}]"
        return self.assign(f"tl.broadcast_to({expr}, {_shape(shape)}).to({tl_dtype(aval.dtype)})",
                           shape, aval.dtype)

    def _p_broadcast_in_dim(self, eqn, env, x):
        aval = eqn.outvars[0].aval
        shape, dims = aval.shape, eqn.params["broadcast_dimensions"]
        if not x.shape:
            return self.assign(f"tl.full({_shape(shape)}, {_expr(x)}, {tl_dtype(aval.dtype)})",
                               shape, aval.dtype)
        ix = ", ".join(":" if k in dims else "None" for k in range(len(shape)))
        return self.assign(f"tl.broadcast_to({_expr(x)}[{ix}], {_shape(shape)})", shape, aval.dtype)

    def _p_reshape(self, eqn, env, x, *dyn):
        aval = eqn.outvars[0].aval
        if tuple(aval.shape) == tuple(x.shape):
            return x
        if not aval.shape:
            return self._reduce_to_scalar(x, aval)
        self._check_reshape(eqn, x.shape, aval.shape)
        return self.assign(f"tl.reshape({_expr(x)}, {_shape(aval.shape)})", aval.shape, aval.dtype)

    def _p_squeeze(self, eqn, env, x):
        aval = eqn.outvars[0].aval
        if not aval.shape:
            return self._reduce_to_scalar(x, aval)
        self._check_reshape(eqn, x.shape, aval.shape)
        return self.assign(f"tl.reshape({_expr(x)}, {_shape(aval.shape)})", aval.shape, aval.dtype)

    def _check_reshape(self, eqn, src, dst):
        """Padded tensors reshape lane for lane only when just unit dims come and go."""
        padded = any(next_power_of_2(d) != d for d in (*src, *dst))
        if padded and [d for d in src if d != 1] != [d for d in dst if d != 1]:
            self.unsupported(eqn, f"reshape {tuple(src)} -> {tuple(dst)} of non-power-of-two "
                                  "dims (it would mix padding lanes into values)")

    def _reduce_to_scalar(self, x, aval):
        self.combiners.add("sum")
        flat = f"tl.reshape({_expr(x)}, ({int(np.prod(_padded(x.shape)))},))"
        return self.assign(f"tl.reduce({flat}, 0, _combine_sum)", (), aval.dtype)

    def _p_transpose(self, eqn, env, x):
        aval = eqn.outvars[0].aval
        perm = tuple(eqn.params["permutation"])
        return self.assign(f"tl.permute({_expr(x)}, {perm})", aval.shape, aval.dtype)

    def _p_slice(self, eqn, env, x):
        self.unsupported(eqn, "slicing a value (slice the Ref instead)")

    def _reduce(self, eqn, x, combiner):
        aval = eqn.outvars[0].aval
        axes = sorted(eqn.params["axes"], reverse=True)
        self.combiners.add(combiner)
        expr, shape = self._mask_padding(x, axes, _identity(combiner, x.dtype)), list(x.shape)
        needs_f32 = combiner in ("sum", "prod") and np.dtype(x.dtype) in (np.dtype(jnp.bfloat16), np.dtype(np.float16))
        if needs_f32:
            expr = f"{expr}.to(tl.float32)"
        for axis in axes:
            expr = f"tl.reduce({expr}, {axis}, _combine_{combiner})"
            shape.pop(axis)
        if needs_f32:
            expr = f"({expr}).to({tl_dtype(aval.dtype)})"
        return self.assign(expr, aval.shape, aval.dtype)

    def _mask_padding(self, x: Val, axes, fill: str) -> str:
        """``x`` with the padding lanes of ``axes`` replaced by ``fill``, as an expression."""
        masks = [_lane_mask(a, x.shape[a], len(x.shape)) for a in axes if next_power_of_2(x.shape[a]) != x.shape[a]]
        if not masks:
            return _expr(x)
        return f"tl.where({' & '.join(masks)}, {_expr(x)}, {fill})"

    def _p_reduce_sum(self, eqn, env, x):
        return self._reduce(eqn, x, "sum")

    def _p_reduce_max(self, eqn, env, x):
        return self._reduce(eqn, x, "max")

    def _p_reduce_min(self, eqn, env, x):
        return self._reduce(eqn, x, "min")

    def _p_reduce_prod(self, eqn, env, x):
        return self._reduce(eqn, x, "prod")

    def _p_reduce_and(self, eqn, env, x):
        return self._reduce(eqn, x, "and")

    def _p_reduce_or(self, eqn, env, x):
        return self._reduce(eqn, x, "or")

    def _p_reduce_xor(self, eqn, env, x):
        return self._reduce(eqn, x, "xor")

    def _arg_reduce(self, eqn, x, kind):
        aval = eqn.outvars[0].aval
        (axis,) = eqn.params["axes"]
        self.combiners.add(kind)
        lanes = f"tl.arange(0, {next_power_of_2(x.shape[axis])})[{_axis_index(axis, len(x.shape))}]"
        index = f"tl.broadcast_to({lanes}, {_shape(x.shape)})"
        # Padding lanes hold the value that loses every comparison, and come last on ties.
        value = self._mask_padding(x, [axis], _identity("max" if kind == "argmax" else "min", x.dtype))
        pair = self.fresh("a")
        self.emit(f"_, {pair} = tl.reduce(({value}, {index}), {axis}, _combine_{kind})")
        return self.assign(f"{pair}.to({tl_dtype(aval.dtype)})", aval.shape, aval.dtype)

    def _p_argmax(self, eqn, env, x):
        return self._arg_reduce(eqn, x, "argmax")

    def _p_argmin(self, eqn, env, x):
        return self._arg_reduce(eqn, x, "argmin")

    def _scan(self, eqn, x, kind):
        if eqn.params.get("reverse"):
            self.unsupported(eqn, "a reversed cumulative op")
        self.combiners.add(kind)
        return self.assign(f"tl.associative_scan({_expr(x)}, {eqn.params['axis']}, _combine_{kind})",
                           x.shape, x.dtype)

    def _p_cumsum(self, eqn, env, x):
        return self._scan(eqn, x, "sum")

    def _p_cumprod(self, eqn, env, x):
        return self._scan(eqn, x, "prod")

    def _p_cummax(self, eqn, env, x):
        return self._scan(eqn, x, "max")

    def _p_cummin(self, eqn, env, x):
        return self._scan(eqn, x, "min")

    def _p_dot_general(self, eqn, env, a, b):
        aval = eqn.outvars[0].aval
        (ca, cb), (ba, bb) = eqn.params["dimension_numbers"]
        if ba or bb or len(a.shape) != 2 or len(b.shape) != 2:
            self.unsupported(eqn, "batched or non-2-D dot_general")
        # Zero both operands' padding along the contraction: either may hold inf or NaN there.
        a_expr = self._mask_padding(a, ca, "0.0" if _is_float(a.dtype) else "0")
        b_expr = self._mask_padding(b, cb, "0.0" if _is_float(b.dtype) else "0")
        lhs = a_expr if tuple(ca) == (1,) else f"tl.trans({a_expr})"
        rhs = b_expr if tuple(cb) == (0,) else f"tl.trans({b_expr})"
        for dim in (*a.shape, *b.shape):
            if next_power_of_2(dim) < 16:
                self.unsupported(eqn, f"dot_general with a dim of {dim} (< 16, tl.dot's minimum)")
        acc = "tl.float32" if _is_float(aval.dtype) else "tl.int32"
        precision = eqn.params.get("precision")
        ieee = np.dtype(a.dtype) == np.float32 and precision is not None and any(
            "HIGHEST" in str(p) for p in (precision if isinstance(precision, tuple) else (precision,)))
        prec = ', input_precision="ieee"' if ieee else ""
        acc_dtype = np.float32 if acc == "tl.float32" else np.int32
        out = self.assign(f"tl.dot({lhs}, {rhs}{prec}, out_dtype={acc})", aval.shape, acc_dtype)
        if np.dtype(aval.dtype) != acc_dtype:
            out = self.assign(f"{out.expr}.to({tl_dtype(aval.dtype)})", aval.shape, aval.dtype)
        return out

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
        return self._inline(eqn.params["jaxpr"], args, env)

    def _atomic(self, op, closed, args):
        """``tl.atomic_<op>`` at the address the atomic's body reads (pallas_core.triton.atomics)."""
        jaxpr = closed.jaxpr
        ref, val, mask, cmp = args[:4]
        if ref.register is not None:
            raise _ScratchNeedsMemory(ref.register)
        inner = {v: a for v, a in zip(jaxpr.invars, args) if not isinstance(a, RefView)}
        self.ref_of_value.update({v: a for v, a in zip(jaxpr.invars, args) if isinstance(a, RefView)})
        get = next(e for e in jaxpr.eqns if e.primitive.name == "get")
        view = self._view(ref, jax.tree.unflatten(get.params["tree"], get.invars[1:]), inner)
        offset, bounds, shape = self._addresses(view)
        masks = [m for m in (bounds, _expr(mask) if mask.expr != "True" else None) if m]
        where = f", mask={' & '.join(masks)}" if masks else ""
        if op == "cas":
            expr = f"tl.atomic_cas({view.ptr} + {offset}, {_expr(cmp)}, {_expr(val)})"
        else:
            expr = f"tl.atomic_{op}({view.ptr} + {offset}, {_expr(val)}{where})"
        return [self.assign(expr, shape, view.dtype)]

    _p_jit = _p_pjit

    def _p_closed_call(self, eqn, env, *args):
        return self._inline(eqn.params["call_jaxpr"], args, env)

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
        for k, branch in enumerate(branches):
            if k == 0:
                cond = f"{_expr(index)} == 0" if len(branches) > 1 else "True"
                self.emit(f"if {cond}:")
            elif k < len(branches) - 1:
                self.emit(f"elif {_expr(index)} == {k}:")
            else:
                self.emit("else:")
            self.indent += 1
            start = len(self.lines)
            outs = self._inline(branch, args, env)
            for name, out in zip(names, outs):
                self.emit(f"{name} = {_expr(out)}")
            if len(self.lines) == start:
                self.emit("pass")
            self.indent -= 1
        return [Val(n, v.aval.shape, np.dtype(v.aval.dtype)) for n, v in zip(names, eqn.outvars)]

    def _p_scan(self, eqn, env, *args):
        p = eqn.params
        n_consts, n_carry = p["num_consts"], p["num_carry"]
        if len(args) != n_consts + n_carry or p["reverse"]:
            self.unsupported(eqn, "scan with stacked inputs/outputs or reverse=True")
        consts, init = args[:n_consts], args[n_consts:]
        carry = [self.fresh("c") for _ in init]
        for name, value in zip(carry, init):
            self.emit(f"{name} = {_expr(value)}")
        self.emit(f"for _ in range({int(p['length'])}):")
        self.indent += 1
        avals = [v.aval for v in eqn.outvars]
        current = [Val(n, a.shape, np.dtype(a.dtype)) for n, a in zip(carry, avals)]
        outs = self._inline(p["jaxpr"], list(consts) + current, env)
        for name, out in zip(carry, outs):
            self.emit(f"{name} = {_expr(out)}")
        self.indent -= 1
        return current

    def _p_while(self, eqn, env, *args):
        p = eqn.params
        nc, nb = p["cond_nconsts"], p["body_nconsts"]
        cond_consts, body_consts, init = args[:nc], args[nc:nc + nb], args[nc + nb:]
        carry = [self.fresh("c") for _ in init]
        for name, value in zip(carry, init):
            self.emit(f"{name} = {_expr(value)}")
        avals = [v.aval for v in eqn.outvars]
        current = [Val(n, a.shape, np.dtype(a.dtype)) for n, a in zip(carry, avals)]
        flag = self.fresh("w")
        (first,) = self._inline(p["cond_jaxpr"], list(cond_consts) + current, env)
        self.emit(f"{flag} = {_expr(first)}")
        self.emit(f"while {flag}:")
        self.indent += 1
        outs = self._inline(p["body_jaxpr"], list(body_consts) + current, env)
        for name, out in zip(carry, outs):
            self.emit(f"{name} = {_expr(out)}")
        (again,) = self._inline(p["cond_jaxpr"], list(cond_consts) + current, env)
        self.emit(f"{flag} = {_expr(again)}")
        self.indent -= 1
        return current


def _fit(val: Val, shape, dtype) -> str:
    """``val`` as an expression of ``shape``: scalars filled, smaller tensors broadcast."""
    if shape and not val.shape:
        return f"tl.full({_shape(shape)}, {_expr(val)}, {tl_dtype(dtype)})"
    if tuple(val.shape) != tuple(shape):
        return f"tl.broadcast_to({_expr(val)}, {_shape(shape)})"
    return _expr(val)


def _cast(x: Val, tl_type: str) -> str:
    """``x`` converted to ``tl_type`` (which may carry keyword arguments)."""
    if not x.shape and not _is_tensor(x):  # a Python literal has no ``.to``
        return f"tl.cast({_expr(x)}, {tl_type})"
    return f"{_expr(x)}.to({tl_type})"


def _is_float(dtype) -> bool:
    """Floating point, bfloat16 included (``np.issubdtype`` says no to ml_dtypes' floats)."""
    return bool(jnp.issubdtype(dtype, jnp.floating))


def _nan_policy(dtype) -> str:
    """Extra ``tl.maximum`` / ``tl.minimum`` argument that keeps NaNs, as lax.max / lax.min do."""
    return ", propagate_nan=tl.PropagateNan.ALL" if _is_float(dtype) else ""


def _is_tensor(x) -> bool:
    return isinstance(x, Val) and bool(x.shape)


def _expr(x) -> str:
    if isinstance(x, Val):
        return x.expr
    raise NotImplementedError(f"triton backend: a Ref was used as a value ({x!r})")


def _padded(shape) -> tuple[int, ...]:
    return tuple(next_power_of_2(d) for d in shape)


def _shape(shape) -> str:
    """The Triton (padded) shape of a value of logical ``shape``, as a tuple literal."""
    dims = _padded(shape)
    return "(" + ", ".join(str(d) for d in dims) + ("," if len(dims) == 1 else "") + ")"


def _axis_index(axis: int, rank: int) -> str:
    """The subscript that lays a 1-D range along ``axis`` of a rank-``rank`` tensor."""
    return ", ".join(":" if k == axis else "None" for k in range(rank))


def _lane_mask(axis: int, size: int, rank: int) -> str:
    """True on the ``size`` valid lanes of ``axis``, False on its padding."""
    return f"(tl.arange(0, {next_power_of_2(size)}) < {size})[{_axis_index(axis, rank)}]"


def _identity(combiner: str, dtype) -> str:
    """The neutral element of a reduction, as a Triton expression of ``dtype``."""
    dtype = np.dtype(dtype)
    boolean = dtype == np.bool_
    if combiner in ("sum", "or", "xor"):
        return "False" if boolean else "0"
    if combiner == "prod":
        return "1"
    if combiner == "and":  # every bit set
        return "True" if boolean else str(int(np.iinfo(dtype).max if dtype.kind == "u" else -1))
    big = combiner == "min"
    if boolean:
        return "True" if big else "False"
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return str(int(info.max if big else info.min))
    return 'float("inf")' if big else 'float("-inf")'


def _literal(value, aval) -> Val:
    arr = np.asarray(value)
    if arr.shape:
        if arr.size and np.all(arr == arr.flat[0]):
            dtype = np.dtype(arr.dtype)
            scalar = _literal(arr.flat[0], jax.core.ShapedArray((), dtype))
            return Val(f"tl.full({_shape(arr.shape)}, {scalar.expr}, {tl_dtype(dtype)})",
                       tuple(arr.shape), dtype)
        raise NotImplementedError("triton backend: kernels cannot close over non-constant arrays; "
                                  "pass them as inputs.")
    dtype = np.dtype(getattr(aval, "dtype", arr.dtype))
    v = arr.item()
    if np.issubdtype(dtype, np.bool_):
        return Val("True" if v else "False", (), dtype)
    if np.issubdtype(dtype, np.integer):
        return Val(str(int(v)), (), dtype)
    if math.isnan(v):
        return Val('float("nan")', (), dtype)
    if math.isinf(v):
        return Val('float("inf")' if v > 0 else 'float("-inf")', (), dtype)
    return Val(repr(float(v)), (), dtype)


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


def generate(call) -> tuple[str, str, dict[str, int], list[str]]:
    """``(source, function name, constexprs, pointer parameter names)`` of a call.

    Pointer parameters are ``p<k>`` per operand (inputs, then outputs) and
    ``s<k>`` per scratch buffer kept in global memory.
    """
    closed = trace_kernel(call)
    memory: set[int] = set()
    while True:
        writer = KernelWriter(call, frozenset(memory))
        try:
            source = writer.write(closed)
        except _ScratchNeedsMemory as needs:
            memory.add(needs.index)
            continue
        return source, writer.name, dict(writer.constexprs), list(writer.params)
