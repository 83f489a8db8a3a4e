"""Values as the Triton writer sees them, and the text that spells them.

A :class:`Val` is a Triton expression (usually a local name) with its JAX
shape and dtype. Triton tensors have power-of-two dims, so a value's Triton
shape is its logical shape padded up (:func:`padded`); the helpers here
write shapes, masks for the padding lanes, casts and literals.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_core.primitives import next_power_of_2

_TL_DTYPES = {
    "float32": "tl.float32", "float16": "tl.float16", "bfloat16": "tl.bfloat16",
    "float64": "tl.float64", "int8": "tl.int8", "int16": "tl.int16", "int32": "tl.int32",
    "int64": "tl.int64", "uint8": "tl.uint8", "uint16": "tl.uint16", "uint32": "tl.uint32",
    "uint64": "tl.uint64", "bool": "tl.int1",
}
INT32_MAX = 2**31 - 1


def tl_dtype(dtype) -> str:
    name = np.dtype(dtype).name
    try:
        return _TL_DTYPES[name]
    except KeyError:
        raise NotImplementedError(f"the triton backend has no dtype {name}") from None


@dataclasses.dataclass
class Val:
    """A Triton value: an expression (usually a local name) with its JAX type.

    ``zero_padding``: the lanes past the logical shape (the padding up to
    powers of two) are known to hold 0, as a masked ``tl.load`` with
    ``other=0`` leaves them; consumers that need zero padding (dots) then skip
    re-masking it. False unless a writer proves it.
    """

    expr: str
    shape: tuple[int, ...]
    dtype: Any
    zero_padding: bool = False



def fit(val: Val, shape, dtype) -> str:
    """``val`` as an expression of ``shape``: scalars filled, smaller tensors broadcast."""
    if shape and not val.shape:
        return f"tl.full({tl_shape(shape)}, {as_code(val)}, {tl_dtype(dtype)})"
    if tuple(val.shape) != tuple(shape):
        return f"tl.broadcast_to({as_code(val)}, {tl_shape(shape)})"
    return as_code(val)


def cast(x: Val, tl_type: str) -> str:
    """``x`` converted to ``tl_type`` (which may carry keyword arguments)."""
    if not x.shape and not is_tensor(x):  # a Python literal has no ``.to``
        return f"tl.cast({as_code(x)}, {tl_type})"
    return f"{as_code(x)}.to({tl_type})"


def is_float(dtype) -> bool:
    """Floating point, bfloat16 included (``np.issubdtype`` says no to ml_dtypes' floats)."""
    return bool(jnp.issubdtype(dtype, jnp.floating))


def is_16bit_float(dtype) -> bool:
    """bfloat16 or float16: Triton's math and accumulations want these widened to float32."""
    return np.dtype(dtype) in (np.dtype(jnp.bfloat16), np.dtype(np.float16))


def nan_policy(dtype) -> str:
    """Extra ``tl.maximum`` / ``tl.minimum`` argument that keeps NaNs, as lax.max / lax.min do."""
    return ", propagate_nan=tl.PropagateNan.ALL" if is_float(dtype) else ""


def is_tensor(x) -> bool:
    return isinstance(x, Val) and bool(x.shape)


def as_code(x) -> str:
    if isinstance(x, Val):
        return x.expr
    raise NotImplementedError(f"triton backend: a Ref was used as a value ({x!r})")


def padded(shape) -> tuple[int, ...]:
    return tuple(next_power_of_2(d) for d in shape)


def tl_shape(shape) -> str:
    """The Triton (padded) shape of a value of logical ``shape``, as a tuple literal."""
    dims = padded(shape)
    return "(" + ", ".join(str(d) for d in dims) + ("," if len(dims) == 1 else "") + ")"


def axis_index(axis: int, rank: int) -> str:
    """The subscript that lays a 1-D range along ``axis`` of a rank-``rank`` tensor."""
    return ", ".join(":" if k == axis else "None" for k in range(rank))


def lane_mask(axis: int, size: int, rank: int) -> str:
    """True on the ``size`` valid lanes of ``axis``, False on its padding."""
    return f"(tl.arange(0, {next_power_of_2(size)}) < {size})[{axis_index(axis, rank)}]"


def identity(combiner: str, dtype) -> str:
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


def literal(value, aval) -> Val:
    arr = np.asarray(value)
    if arr.shape:
        if arr.size and np.all(arr == arr.flat[0]):
            dtype = np.dtype(arr.dtype)
            scalar = literal(arr.flat[0], jax.core.ShapedArray((), dtype))
            return Val(f"tl.full({tl_shape(arr.shape)}, {scalar.expr}, {tl_dtype(dtype)})",
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
