"""Makes Triton 3.6's CPU interpreter treat bfloat16 as a GPU does.

The interpreter (our CI's way of running generated kernels, DESIGN §6) keeps
bfloat16 tensors as their uint16 bit patterns and then, unlike the GPU:

* arithmetic and comparisons between bfloat16 tensors (``x * 2``, ``x < y``)
  and ``tl.dot`` work on the bit patterns as integers (garbage);
* float32 -> bfloat16 truncates, though the GPU rounds to nearest even
  (``cvt.rn.bf16.f32``), as JAX does;
* conversions between bfloat16 and anything but float32 (ints, float64)
  convert the bit patterns, not the values;
* bfloat16 scalar constants (``x * 50`` for a bfloat16 ``x``) do not exist.

And, for every dtype, a loop bounded by a runtime scalar (``for j in
range(lo, hi)`` with ``lo`` computed from the program id, as flash attention's
key/value loop is) fails under numpy >= 2.4: the interpreter converts the
scalar with ``int()`` of a one-element array, which numpy no longer allows.

:func:`apply` patches those builder methods, once, before the first
interpreted launch. Other dtypes take Triton's own code paths untouched.
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
    dot, cast_impl, binary_op = builder.create_dot, builder.cast_impl, builder.binary_op

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

    interpreter._patch_lang_tensor = patch_lang_tensor
    builder.create_dot = create_dot
    builder.get_bf16 = get_bf16
    builder.binary_op = bf16_binary_op  # every element-wise binary method calls self.binary_op
    builder.cast_impl = cast  # every conversion method calls self.cast_impl
