"""Makes Triton 3.6's CPU interpreter treat bfloat16 as a GPU does.

The interpreter (our CI's way of running generated kernels, docs/design.md §7.3) keeps
bfloat16 tensors as their uint16 bit patterns and then, unlike the GPU:

* arithmetic and comparisons between bfloat16 tensors (``x * 2``, ``x < y``)
  and ``tl.dot`` work on the bit patterns as integers (garbage);
* float32 -> bfloat16 truncates, though the GPU rounds to nearest even
  (``cvt.rn.bf16.f32``), as JAX does;
* conversions between bfloat16 and anything but float32 (ints, float64)
  convert the bit patterns, not the values;
* bfloat16 scalar constants (``x * 50`` for a bfloat16 ``x``) do not exist.

And, for speed: the interpreter computes ``tl.reduce`` / ``tl.associative_scan``
with numpy only for Triton's own combine functions; any other (ours:
``_combine_sum``, ``_combine_max`` …, which keep XLA's NaN propagation and
tie-breaking on the GPU) runs element by element in Python, about a second
per small reduction. :func:`apply` computes our combiners, recognised by name
and by the file our runtime loads generated modules from, with the numpy
reductions of equal semantics (``np.max`` / ``np.maximum.accumulate``
propagate NaNs as ``lax.max`` does; ``np.argmax`` returns the first NaN, else
the first maximum, as ``jnp.argmax``). The generated source, and so the GPU
code, is unchanged.

And ``tl.fma`` of float32 rounds once (the interpreter rounds the product, then the
sum; error-free transformations in our math helpers rely on the single rounding).

And, for every dtype, a loop bounded by a runtime scalar (``for j in
range(lo, hi)`` with ``lo`` computed from the program id, as flash attention's
key/value loop is) fails under numpy >= 2.4: the interpreter converts the
scalar with ``int()`` of a one-element array, which numpy no longer allows.

:func:`apply` patches those builder methods, once, before the first
interpreted launch (and one that makes ``tl.device_print`` of a message
without values print it, as a GPU does). Other dtypes take Triton's own code paths untouched.
"""
from __future__ import annotations

import functools

import ml_dtypes
import numpy as np


@functools.cache
def apply() -> None:
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    TensorHandle = interpreter.TensorHandle
    dot, cast_impl, binary_op, fma = (builder.create_dot, builder.cast_impl, builder.binary_op,
                                      builder.create_fma)

    def values(handle):
        """The handle's numbers as numpy values (bfloat16 as ml_dtypes' bfloat16)."""
        return handle.data.view(ml_dtypes.bfloat16) if handle.dtype == tl.bfloat16 else handle.data

    def create_dot(self, a, b, d, *args, **kwargs):
        if tl.bfloat16 in (a.dtype, b.dtype):  # widening is exact; products accumulate in float32
            a = TensorHandle(values(a).astype(np.float32), tl.float32)
            b = TensorHandle(values(b).astype(np.float32), tl.float32)
        return dot(self, a, b, d, *args, **kwargs)

    def cast(self, src, dst_type):
        dst = dst_type.scalar
        if tl.bfloat16 not in (src.dtype, dst):
            return cast_impl(self, src, dst_type)
        if dst == tl.bfloat16:  # ml_dtypes rounds to nearest even, like the GPU
            return TensorHandle(values(src).astype(ml_dtypes.bfloat16).view(np.uint16), dst)
        return TensorHandle(values(src).astype(interpreter._get_np_dtype(dst_type)), dst)

    def bf16_binary_op(self, lhs, rhs, op):
        """As the GPU: on the values, rounded back to bfloat16; comparisons give booleans."""
        if lhs.dtype != tl.bfloat16 or rhs.dtype != tl.bfloat16:
            return binary_op(self, lhs, rhs, op)
        out = op(values(lhs).astype(np.float32), values(rhs).astype(np.float32))
        if out.dtype == np.bool_:
            return TensorHandle(out, tl.int1)
        return TensorHandle(out.astype(ml_dtypes.bfloat16).view(np.uint16), tl.bfloat16)

    def get_bf16(self, value):  # scalar constants (x * 50 for a bf16 x); fp16 has its own
        return TensorHandle(np.array([value], np.float32).astype(ml_dtypes.bfloat16).view(np.uint16), tl.bfloat16)

    patch_tensor = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    create_print = builder.create_print

    def print_message(self, prefix, hex, values, is_signed):
        """``tl.device_print(prefix)`` with no value prints the prefix, as on a GPU (the
        interpreter prints one line per value, so nothing)."""
        if values:
            return create_print(self, prefix, hex, values, is_signed)
        print(f"({self.grid_idx[0]}, {self.grid_idx[1]}, {self.grid_idx[2]}) {prefix}".rstrip())
        return None

    def create_fma(self, x, y, z):
        """``tl.fma`` rounded once, as the GPU's fused multiply-add (the interpreter
        rounds the product and then the sum): float32 products are exact in float64."""
        if z.dtype.scalar == tl.float32:
            wide = x.data.astype(np.float64) * y.data.astype(np.float64) + z.data.astype(np.float64)
            return TensorHandle(wide.astype(np.float32), z.dtype.scalar)
        return fma(self, x, y, z)

    interpreter._patch_lang_tensor = patch_lang_tensor
    builder.create_print = print_message
    builder.create_fma = create_fma
    _numpy_reductions(interpreter, values)
    builder.create_dot = create_dot
    builder.get_bf16 = get_bf16
    builder.binary_op = bf16_binary_op  # every element-wise binary method calls self.binary_op
    builder.cast_impl = cast  # every conversion method calls self.cast_impl


# Our combine functions (pallas_core.triton.jit_helpers.COMBINERS) and the numpy
# reductions / scans with the same semantics.
_REDUCE = {"sum": np.sum, "prod": np.prod, "max": np.max, "min": np.min,
           "and": np.bitwise_and.reduce, "or": np.bitwise_or.reduce, "xor": np.bitwise_xor.reduce}
_SCAN = {"sum": np.cumsum, "prod": np.cumprod, "max": np.maximum.accumulate,
         "min": np.minimum.accumulate}
_ARG = {"argmax": np.argmax, "argmin": np.argmin}
_GENERATED_FILE = "<pallas_core triton "  # pallas_core.triton.runtime.load's file names


def _our_combiner(combine_fn) -> str | None:
    """``"sum"`` for our generated ``_combine_sum`` (and so on); None for any other function."""
    fn = getattr(combine_fn, "fn", None)
    name = getattr(fn, "__name__", "")
    code = getattr(fn, "__code__", None)
    if not name.startswith("_combine_") or code is None or not code.co_filename.startswith(_GENERATED_FILE):
        return None
    return name[len("_combine_"):]


def _numpy_reductions(interpreter, values) -> None:
    import ml_dtypes
    import triton.language as tl

    reduce_impl, scan_impl = interpreter.ReduceOps.apply_impl, interpreter.ScanOps.apply_impl

    def as_numbers(t):
        return values(t.handle)

    def back(array, dtype):
        if dtype == tl.bfloat16:
            array = np.asarray(array).astype(ml_dtypes.bfloat16).view(np.uint16)
        return array

    def fast_reduce(self, inputs):
        kind = _our_combiner(self.combine_fn)
        if kind is None or (kind not in _REDUCE and kind not in _ARG) or self.axis is None:
            return reduce_impl(self, inputs)
        if kind in _ARG:  # (value, index) pairs: take both at the winning lane
            data, index = as_numbers(inputs[0]), inputs[1].handle.data
            win = np.expand_dims(_ARG[kind](data, axis=self.axis), self.axis)
            value = np.take_along_axis(data, win, self.axis)
            picked = np.take_along_axis(index, win, self.axis)
            if not self.keep_dims:
                value, picked = value.squeeze(self.axis), picked.squeeze(self.axis)
            return [self.to_tensor(back(value, inputs[0].dtype), inputs[0].dtype),
                    self.to_tensor(picked, inputs[1].dtype)]
        (x,) = inputs
        out = _REDUCE[kind](as_numbers(x), axis=self.axis, keepdims=self.keep_dims)
        return self.to_tensor(back(out, x.dtype), x.dtype)

    def fast_scan(self, inputs):
        kind = _our_combiner(self.combine_fn)
        if kind not in _SCAN or len(inputs) != 1:
            return scan_impl(self, inputs)
        (x,) = inputs
        data = as_numbers(x)
        if self.reverse:
            data = np.flip(data, self.axis)
        out = _SCAN[kind](data, axis=self.axis)
        if self.reverse:
            out = np.flip(out, self.axis)
        return [self.to_tensor(back(out, x.dtype), x.dtype)]

    interpreter.ReduceOps.apply_impl = fast_reduce
    interpreter.ScanOps.apply_impl = fast_scan
