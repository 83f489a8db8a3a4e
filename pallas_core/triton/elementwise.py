"""Element-wise ops, reductions, scans and dots: the jaxpr primitives that map
to Triton arithmetic, written with XLA's semantics.

:class:`ElementwiseWriter` is a mixin of :class:`pallas_core.triton.codegen.KernelWriter`:
each ``_p_<primitive>`` method writes one equation and returns its value(s),
using the writer's ``assign`` / ``emit`` / ``unsupported`` and recording the
:mod:`pallas_core.triton.jit_helpers` it needs in ``combiners`` / ``math``.
Where a ``tl`` builtin differs from XLA (NaN-dropping ``tl.maximum``,
``0 - x`` negation, ``log(1 + x)``, out-of-range conversions and shifts) a
helper or an explicit guard is written instead.
"""
from __future__ import annotations

import functools

import jax
import numpy as np

from pallas_core import _jax_internals
from pallas_core.primitives import next_power_of_2
from pallas_core.triton.values import (Val, as_code, axis_index, cast, fit, identity, is_16bit_float, is_float,
                                       lane_mask, literal, nan_policy, padded, tl_dtype, tl_shape)

_BINARY = {"add": "+", "add_any": "+", "sub": "-", "mul": "*", "eq": "==", "ne": "!=", "lt": "<", "le": "<=",
           "gt": ">", "ge": ">=", "and": "&", "or": "|", "xor": "^"}
_UNARY_TL = {"exp2": "tl.exp2", "log": "tl.log", "sqrt": "tl.sqrt",
             "rsqrt": "tl.rsqrt", "abs": "tl.abs", "floor": "tl.floor", "ceil": "tl.ceil",
             "sin": "tl.sin", "cos": "tl.cos", "erf": "tl.erf"}
# Reductions and scans: primitive -> jit_helpers.COMBINERS entry.
_REDUCTIONS = {f"reduce_{c}": c for c in ("sum", "max", "min", "prod", "and", "or", "xor")}
_ARG_REDUCTIONS = {"argmax": "argmax", "argmin": "argmin"}
_SCANS = {"cumsum": "sum", "cumprod": "prod", "cummax": "max", "cummin": "min"}


class ElementwiseWriter:
    """The element-wise part of the kernel writer (a mixin; see the module docstring)."""

    def table_handler(self, name):
        """A handler for a primitive spelled by an operator, a ``tl`` function or a
        combine function (reductions, scans), or None."""
        if name in _BINARY:
            return functools.partial(self._binary, _BINARY[name])
        if name in _UNARY_TL:
            return functools.partial(self._unary_tl, _UNARY_TL[name])
        for table, method in ((_REDUCTIONS, self._reduce), (_ARG_REDUCTIONS, self._arg_reduce),
                              (_SCANS, self._scan)):
            if name in table:
                return lambda eqn, env, x, method=method, combiner=table[name]: method(eqn, x, combiner)
        if name in _jax_internals.LATER_ELEMENTWISE:
            return self._as_in_0_10
        return None

    def _as_in_0_10(self, eqn, env, *xs):
        """A primitive of later JAX (``log2``) written as JAX 0.10.2's spelling of it,
        so its numerics and Triton source are those of 0.10.2's jnp function."""
        try:
            spelled = _jax_internals.spelled_as_in_0_10(eqn)
        except NotImplementedError:
            self.unsupported(eqn, "a complex operand of primitive")
        return self._inline(spelled, xs, env)

    def _binary(self, op, eqn, env, a, b):
        aval = eqn.outvars[0].aval
        return self.assign(f"{as_code(a)} {op} {as_code(b)}", aval.shape, aval.dtype)

    def _unary_tl(self, fn, eqn, env, x):
        return self._unary(f"{fn}({{x}})", x, eqn)

    def _unary(self, template, x, eqn):
        """``template`` (text with ``{x}``) applied to ``x``; 16-bit floats go through
        float32, the only width (with float64) Triton's math functions take."""
        aval = eqn.outvars[0].aval
        xf = as_code(x)
        needs_f32 = is_16bit_float(aval.dtype)
        if needs_f32 and not template.startswith("tl.abs"):
            xf = cast(x, "tl.float32") if not x.shape and not xf.isidentifier() else f"{xf}.to(tl.float32)"
            return self.assign(template.format(x=xf) + f".to({tl_dtype(aval.dtype)})", aval.shape, aval.dtype)
        return self.assign(template.format(x=xf), aval.shape, aval.dtype)

    def _p_neg(self, eqn, env, x):
        # Triton negates as 0 - x, which turns -0.0 into +0.0; * -1 is IEEE negation.
        expr = f"{as_code(x)} * -1.0" if is_float(x.dtype) else f"-{as_code(x)}"
        return self.assign(expr, x.shape, x.dtype)

    def _p_not(self, eqn, env, x):
        if np.dtype(x.dtype) == np.bool_:
            return self.assign(f"{as_code(x)} == 0", x.shape, x.dtype)
        return self.assign(f"~{as_code(x)}", x.shape, x.dtype)

    def _p_div(self, eqn, env, a, b):
        aval = eqn.outvars[0].aval
        op = "//" if np.issubdtype(aval.dtype, np.integer) else "/"
        return self.assign(f"{as_code(a)} {op} {as_code(b)}", aval.shape, aval.dtype)

    def _p_rem(self, eqn, env, a, b):
        aval = eqn.outvars[0].aval
        return self.assign(f"{as_code(a)} % {as_code(b)}", aval.shape, aval.dtype)

    def _p_max(self, eqn, env, a, b):
        return self._extremum("maximum", eqn, a, b)

    def _p_min(self, eqn, env, a, b):
        return self._extremum("minimum", eqn, a, b)

    def _extremum(self, fn, eqn, a, b):
        aval = eqn.outvars[0].aval
        return self.assign(f"tl.{fn}({as_code(a)}, {as_code(b)}{nan_policy(aval.dtype)})", aval.shape, aval.dtype)

    def _p_clamp(self, eqn, env, lo, x, hi):
        keep = nan_policy(x.dtype)
        return self.assign(f"tl.minimum(tl.maximum({as_code(x)}, {as_code(lo)}{keep}), {as_code(hi)}{keep})",
                           x.shape, x.dtype)

    def _p_pow(self, eqn, env, a, b):
        if not is_float(eqn.outvars[0].aval.dtype):
            self.unsupported(eqn, "pow of integers")
        return self._math("pow", eqn, a, b)

    def _p_integer_pow(self, eqn, env, x):
        """x ** y by repeated squaring, like XLA (y is a static int)."""
        y = int(eqn.params["y"])
        if y == 0:
            return self.assign(f"tl.full({tl_shape(x.shape)}, 1, {tl_dtype(x.dtype)})", x.shape, x.dtype)
        result, square, n = None, x, abs(y)
        while n:
            if n & 1:
                result = square if result is None else self.assign(f"{as_code(result)} * {as_code(square)}",
                                                                   x.shape, x.dtype)
            n >>= 1
            if n:
                square = self.assign(f"{as_code(square)} * {as_code(square)}", x.shape, x.dtype)
        if y < 0:
            return self.assign(f"1.0 / {as_code(result)}", x.shape, x.dtype)
        return result

    def _p_square(self, eqn, env, x):
        return self.assign(f"{as_code(x)} * {as_code(x)}", x.shape, x.dtype)

    def _p_exp(self, eqn, env, x):
        # float32 (and 16-bit floats, through it): jit_helpers' argument-reduced exp;
        # float64 keeps tl.exp (libdevice's exp there).
        if np.dtype(eqn.outvars[0].aval.dtype) == np.float64:
            return self._unary("tl.exp({x})", x, eqn)
        return self._math("exp", eqn, x)

    def _p_logistic(self, eqn, env, x):
        if np.dtype(eqn.outvars[0].aval.dtype) == np.float64:
            return self._unary("1.0 / (1.0 + tl.exp(-{x}))", x, eqn)
        # jit_helpers' sigmoid (float32, corrected sum and quotient), rounded once to
        # the result's dtype.
        return self._math("sigmoid", eqn, x)

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
        v = as_code(x)
        return self.assign(f"tl.where({v} > 0, 1, tl.where({v} < 0, -1, {v})).to({tl_dtype(x.dtype)})",
                           x.shape, x.dtype)

    def _p_is_finite(self, eqn, env, x):
        v = as_code(x)
        return self.assign(f"({v} == {v}) & (tl.abs({v}) != float(\"inf\"))", x.shape, np.bool_)

    def _math(self, name, eqn, *xs, wrap: str = "{}({})"):
        """``_<name>(*xs)``, a :data:`jit_helpers.MATH` helper, computed in float32;
        ``wrap`` places the helper's name and arguments in a longer float32 expression."""
        aval = eqn.outvars[0].aval
        self.math.add(name)
        # Every argument as a float32 tensor of the result's shape, so helpers
        # never mix Triton scalars with tensors in bitwise ops.
        f32 = [x if np.dtype(x.dtype) == np.float32 else Val(cast(x, "tl.float32"), x.shape, np.float32)
               for x in xs]
        args = ", ".join(fit(x, aval.shape, np.float32) for x in f32)
        expr = wrap.format(f"_{name}", args)
        if np.dtype(aval.dtype) != np.float32:
            expr = f"{expr}.to({tl_dtype(aval.dtype)})"
        return self.assign(expr, aval.shape, aval.dtype)

    # Shifts by the operand's bit width or more (or by a negative amount, which
    # is huge as unsigned) are defined by XLA, unlike in Triton / LLVM.
    def _p_shift_left(self, eqn, env, a, b):
        return self._shift(eqn, a, b, f"{as_code(a)} << {as_code(b)}", "0")

    def _p_shift_right_arithmetic(self, eqn, env, a, b):
        bits = np.dtype(a.dtype).itemsize * 8
        return self._shift(eqn, a, b, f"{as_code(a)} >> {as_code(b)}", f"{as_code(a)} >> {bits - 1}")

    def _p_shift_right_logical(self, eqn, env, a, b):
        dtype = np.dtype(a.dtype)
        if np.issubdtype(dtype, np.signedinteger):  # Triton's >> is logical only on unsigned ints
            unsigned = tl_dtype(np.dtype(f"uint{dtype.itemsize * 8}"))
            shifted = f"({as_code(a)}.to({unsigned}, bitcast=True) >> {as_code(b)}).to({tl_dtype(dtype)}, bitcast=True)"
        else:
            shifted = f"{as_code(a)} >> {as_code(b)}"
        return self._shift(eqn, a, b, shifted, "0")

    def _shift(self, eqn, a, b, shifted, out_of_range):
        aval = eqn.outvars[0].aval
        bits = np.dtype(a.dtype).itemsize * 8
        amount = as_code(b)
        if amount.lstrip("-").isdigit():  # a literal amount: decide here
            expr = shifted if 0 <= int(amount) < bits else out_of_range
            if expr == "0":
                expr = f"tl.full({tl_shape(aval.shape)}, 0, {tl_dtype(aval.dtype)})"
            return self.assign(expr, aval.shape, aval.dtype)
        return self.assign(f"tl.where(({amount} >= 0) & ({amount} < {bits}), {shifted}, {out_of_range})"
                           f".to({tl_dtype(aval.dtype)})", aval.shape, aval.dtype)

    def _p_select_n(self, eqn, env, pred, *cases):
        aval = eqn.outvars[0].aval
        if len(cases) != 2:
            self.unsupported(eqn, "select_n with more than two cases")
        return self.assign(f"tl.where({as_code(pred)}, {as_code(cases[1])}, {as_code(cases[0])})",
                           aval.shape, aval.dtype)

    def _p_copy_p(self, eqn, env, x):
        return x

    # Values only; autodiff never reaches inside a kernel.
    _p_copy = _p_stop_gradient = _p_copy_p
    # Mesh-layout casts JAX records when a kernel is traced inside shard_map or under
    # explicit sharding: one program's tile has no layout, so they change nothing.
    _p_reshard = _p_pvary = _p_copy_p

    def _p_bitcast_convert_type(self, eqn, env, x):
        aval = eqn.outvars[0].aval
        if np.dtype(aval.dtype).itemsize != np.dtype(x.dtype).itemsize:
            self.unsupported(eqn, "bitcast between dtypes of different widths")
        return self.assign(f"{as_code(x)}.to({tl_dtype(aval.dtype)}, bitcast=True)", aval.shape, aval.dtype)

    def _p_convert_element_type(self, eqn, env, x):
        aval = eqn.outvars[0].aval
        src, dst = np.dtype(x.dtype), np.dtype(aval.dtype)
        if is_float(src) and np.issubdtype(dst, np.integer):
            return self._float_to_int(x, aval)
        # JAX rounds float downcasts to nearest-even; say so, Triton's default may differ.
        rounding = (', fp_downcast_rounding="rtne"'
                    if is_float(src) and is_float(dst)
                    and dst.itemsize < src.itemsize else "")
        return self.assign(cast(x, f"{tl_dtype(dst)}{rounding}"), aval.shape, dst)

    def _float_to_int(self, x, aval):
        """XLA's conversion: truncate, saturate at the integer range, NaN -> 0.

        The value is clamped before the cast, so no lane ever converts out of
        range (undefined in LLVM; garbage in Triton's numpy interpreter).
        """
        dst = np.dtype(aval.dtype)
        info = np.iinfo(dst)
        wide = np.float64 if np.dtype(x.dtype) == np.float64 else np.float32  # exact for every 16-bit float
        v = as_code(x) if np.dtype(x.dtype) == np.dtype(wide) else cast(x, tl_dtype(wide))
        hi = 2.0 ** (info.bits - (1 if info.min else 0))  # first value past the range
        below_hi = float(np.nextafter(wide(hi), wide(0)))
        lo = float(info.min)
        xw = self.assign(v, x.shape, wide, prefix="f")
        safe = self.assign(f"tl.minimum(tl.maximum(tl.where({xw.expr} != {xw.expr}, 0.0, {xw.expr}), {lo!r}), "
                           f"{below_hi!r})", x.shape, wide, prefix="f")
        converted = cast(safe, tl_dtype(dst))
        return self.assign(f"tl.where({xw.expr} >= {hi!r}, {int(info.max)}, {converted}).to({tl_dtype(dst)})",
                           aval.shape, dst)

    def _p_iota(self, eqn, env):
        aval = eqn.outvars[0].aval
        shape, dim = aval.shape, eqn.params["dimension"]
        expr = f"tl.arange(0, {next_power_of_2(shape[dim])})[{axis_index(dim, len(shape))}]"
        return self.assign(f"tl.broadcast_to({expr}, {tl_shape(shape)}).to({tl_dtype(aval.dtype)})",
                           shape, aval.dtype)

    def _p_broadcast_in_dim(self, eqn, env, x):
        aval = eqn.outvars[0].aval
        shape, dims = aval.shape, eqn.params["broadcast_dimensions"]
        if not x.shape:
            return self.assign(f"tl.full({tl_shape(shape)}, {as_code(x)}, {tl_dtype(aval.dtype)})",
                               shape, aval.dtype)
        ix = ", ".join(":" if k in dims else "None" for k in range(len(shape)))
        return self.assign(f"tl.broadcast_to({as_code(x)}[{ix}], {tl_shape(shape)})", shape, aval.dtype)

    def _p_broadcast_to(self, eqn, env, x):
        """The state primitive a Ref indexer uses to broadcast its index arrays (NumPy rules)."""
        aval = eqn.outvars[0].aval
        if tuple(x.shape) == tuple(aval.shape):
            return x
        if not x.shape:
            return self.assign(f"tl.full({tl_shape(aval.shape)}, {as_code(x)}, {tl_dtype(aval.dtype)})",
                               aval.shape, aval.dtype)
        ix = ", ".join(["None"] * (len(aval.shape) - len(x.shape)) + [":"] * len(x.shape))
        return self.assign(f"tl.broadcast_to({as_code(x)}[{ix}], {tl_shape(aval.shape)})", aval.shape, aval.dtype)

    def _p_reshape(self, eqn, env, x, *dyn):
        aval = eqn.outvars[0].aval
        if tuple(aval.shape) == tuple(x.shape):
            return x
        if not aval.shape:
            return self._reduce_to_scalar(x, aval)
        self._check_reshape(eqn, x.shape, aval.shape)
        return self.assign(f"tl.reshape({as_code(x)}, {tl_shape(aval.shape)})", aval.shape, aval.dtype)

    def _p_squeeze(self, eqn, env, x):
        aval = eqn.outvars[0].aval
        if not aval.shape:
            return self._reduce_to_scalar(x, aval)
        self._check_reshape(eqn, x.shape, aval.shape)
        return self.assign(f"tl.reshape({as_code(x)}, {tl_shape(aval.shape)})", aval.shape, aval.dtype)

    def _check_reshape(self, eqn, src, dst):
        """Padded tensors reshape lane for lane only when just unit dims come and go."""
        has_padding = any(next_power_of_2(d) != d for d in (*src, *dst))
        if has_padding and [d for d in src if d != 1] != [d for d in dst if d != 1]:
            self.unsupported(eqn, f"reshape {tuple(src)} -> {tuple(dst)} of non-power-of-two "
                                  "dims (it would mix padding lanes into values)")

    def _reduce_to_scalar(self, x, aval):
        self.combiners.add("sum")
        flat = f"tl.reshape({as_code(x)}, ({int(np.prod(padded(x.shape)))},))"
        return self.assign(f"tl.reduce({flat}, 0, _combine_sum)", (), aval.dtype)

    def _p_transpose(self, eqn, env, x):
        aval = eqn.outvars[0].aval
        perm = tuple(eqn.params["permutation"])
        return self.assign(f"tl.permute({as_code(x)}, {perm})", aval.shape, aval.dtype)

    def _p_slice(self, eqn, env, x):
        self.unsupported(eqn, "slicing a value (slice the Ref instead, or jnp.split it into "
                              "equal power-of-two pieces)")

    def _p_split(self, eqn, env, x):
        """``jnp.split`` into equal pieces: Triton has no value slicing, so the value is
        halved in turn (the dim reshaped to ``(2, n / 2)``, that pair moved last,
        ``tl.split``), as JAX's Pallas Triton lowering does. The dim and the number
        of pieces must be powers of two (a padded dim would mix padding into pieces)."""
        axis, sizes = eqn.params["axis"], tuple(int(s) for s in eqn.params["sizes"])
        n, parts = x.shape[axis], len(sizes)
        if len(set(sizes)) != 1 or next_power_of_2(parts) != parts or next_power_of_2(n) != n:
            self.unsupported(eqn, f"splitting a dim of {n} into {sizes} (only equal power-of-two "
                                  "pieces of a power-of-two dim)")
        pieces = [x]
        while len(pieces) < parts:
            pieces = [half for piece in pieces for half in self._halves(piece, axis)]
        return pieces

    def _p_unstack(self, eqn, env, x):
        """``lax.unstack``, with which JAX 0.11 iterates over a traced array (0.10.2
        slices it, which no backend of ours writes for a value): the dim halved in
        turn down to single entries (as :meth:`_p_split`), each then squeezed away.
        The dim must be a power of two (a padded dim would mix padding into entries)."""
        axis = eqn.params["axis"]
        n = x.shape[axis]
        if next_power_of_2(n) != n:
            self.unsupported(eqn, f"unstacking (iterating over) a dim of {n} of a value (only a "
                                  "power-of-two dim; or index the Ref, x_ref[i]) with primitive")
        pieces = [x]
        while len(pieces) < n:
            pieces = [half for piece in pieces for half in self._halves(piece, axis)]
        outs = []
        for piece, var in zip(pieces, eqn.outvars):
            aval = var.aval
            if not aval.shape:
                outs.append(self._reduce_to_scalar(piece, aval))
            else:
                outs.append(self.assign(f"tl.reshape({as_code(piece)}, {tl_shape(aval.shape)})",
                                        aval.shape, aval.dtype))
        return outs

    def _p_empty(self, eqn, env):
        """``lax.empty``, which ``jnp.empty`` binds in JAX 0.11: zeros, as 0.10.2's
        ``jnp.empty`` (a broadcast 0) gives, spelled as that broadcast is."""
        aval = eqn.outvars[0].aval
        zero = literal(0, aval)
        if not aval.shape:
            return zero
        return self.assign(f"tl.full({tl_shape(aval.shape)}, {zero.expr}, {tl_dtype(aval.dtype)})",
                           aval.shape, aval.dtype)

    def _halves(self, x: Val, axis: int) -> tuple[Val, Val]:
        """The two halves of ``x`` along ``axis`` (a power-of-two dim)."""
        shape = padded(x.shape)
        pair = (*shape[:axis], 2, shape[axis] // 2, *shape[axis + 1:])
        perm = tuple(d for d in range(len(pair)) if d != axis) + (axis,)
        lo, hi = self.fresh("v"), self.fresh("v")
        self.emit(f"{lo}, {hi} = tl.split(tl.permute(tl.reshape({as_code(x)}, {tl_shape(pair)}), "
                  f"{perm}))")
        half = (*x.shape[:axis], x.shape[axis] // 2, *x.shape[axis + 1:])
        return (Val(lo, half, x.dtype, x.zero_padding), Val(hi, half, x.dtype, x.zero_padding))

    def _reduce(self, eqn, x, combiner):
        aval = eqn.outvars[0].aval
        axes = sorted(eqn.params["axes"], reverse=True)
        self.combiners.add(combiner)
        expr, shape = self._mask_padding(x, axes, identity(combiner, x.dtype)), list(x.shape)
        needs_f32 = combiner in ("sum", "prod") and is_16bit_float(x.dtype)
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
        masks = [lane_mask(a, x.shape[a], len(x.shape)) for a in axes if next_power_of_2(x.shape[a]) != x.shape[a]]
        if not masks or (x.zero_padding and fill in ("0", "0.0")):
            return as_code(x)
        return f"tl.where({' & '.join(masks)}, {as_code(x)}, {fill})"

    def _arg_reduce(self, eqn, x, kind):
        aval = eqn.outvars[0].aval
        (axis,) = eqn.params["axes"]
        self.combiners.add(kind)
        lanes = f"tl.arange(0, {next_power_of_2(x.shape[axis])})[{axis_index(axis, len(x.shape))}]"
        index = f"tl.broadcast_to({lanes}, {tl_shape(x.shape)})"
        # Padding lanes hold the value that loses every comparison, and come last on ties.
        value = self._mask_padding(x, [axis], identity("max" if kind == "argmax" else "min", x.dtype))
        pair = self.fresh("a")
        self.emit(f"_, {pair} = tl.reduce(({value}, {index}), {axis}, _combine_{kind})")
        return self.assign(f"{pair}.to({tl_dtype(aval.dtype)})", aval.shape, aval.dtype)

    def _scan(self, eqn, x, kind):
        if eqn.params.get("reverse"):
            self.unsupported(eqn, "a reversed cumulative op")
        self.combiners.add(kind)
        return self.assign(f"tl.associative_scan({as_code(x)}, {eqn.params['axis']}, _combine_{kind})",
                           x.shape, x.dtype)

    def _p_dot_general(self, eqn, env, a, b):
        aval = eqn.outvars[0].aval
        (ca, cb), (ba, bb) = eqn.params["dimension_numbers"]
        if ba or bb or len(a.shape) != 2 or len(b.shape) != 2:
            self.unsupported(eqn, "batched or non-2-D dot_general")
        # Zero both operands' padding along the contraction: either may hold inf or NaN there.
        a_expr = self._mask_padding(a, ca, "0.0" if is_float(a.dtype) else "0")
        b_expr = self._mask_padding(b, cb, "0.0" if is_float(b.dtype) else "0")
        lhs = a_expr if tuple(ca) == (1,) else f"tl.trans({a_expr})"
        rhs = b_expr if tuple(cb) == (0,) else f"tl.trans({b_expr})"
        for dim in (*a.shape, *b.shape):
            if next_power_of_2(dim) < 16:
                self.unsupported(eqn, f"dot_general with a dim of {dim} (< 16, tl.dot's minimum)")
        acc = "tl.float32" if is_float(aval.dtype) else "tl.int32"
        input_precision = _input_precision(eqn.params.get("precision"), a.dtype)
        prec = f', input_precision="{input_precision}"' if input_precision else ""
        acc_dtype = np.float32 if acc == "tl.float32" else np.int32
        out = self.assign(f"tl.dot({lhs}, {rhs}{prec}, out_dtype={acc})", aval.shape, acc_dtype)
        if np.dtype(aval.dtype) != acc_dtype:
            out = self.assign(f"{out.expr}.to({tl_dtype(aval.dtype)})", aval.shape, aval.dtype)
        return out


# lax.DotAlgorithmPreset -> tl.dot's input_precision, for float32 operands.
_ALGORITHM_PRECISION = {"TF32_TF32_F32": "tf32", "TF32_TF32_F32_X3": "tf32x3", "F32_F32_F32": "ieee"}


def _input_precision(precision, dtype) -> str | None:
    """tl.dot's ``input_precision`` for a ``dot_general``'s ``precision`` parameter.

    Only float32 operands have a choice. ``Precision.HIGHEST`` (on either
    operand) and the ``F32_F32_F32`` algorithm are exact float32 products
    ("ieee", FMA units); ``TF32_TF32_F32_X3`` is three TF32 tensor-core passes
    ("tf32x3": hi*hi + hi*lo + lo*hi, about 2^-21 relative error per product,
    on ``wgmma``); ``TF32_TF32_F32`` and the default precision are one TF32
    pass, as XLA's default on GPUs. Other algorithm presets leave Triton's
    default. None: no argument to emit.
    """
    if np.dtype(dtype) != np.float32 or precision is None:
        return None
    name = getattr(precision, "name", None)
    if name in _ALGORITHM_PRECISION:
        return _ALGORITHM_PRECISION[name]
    parts = precision if isinstance(precision, tuple) else (precision,)
    return "ieee" if any("HIGHEST" in str(p) for p in parts) else None
