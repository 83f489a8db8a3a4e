"""Input checks shared by every op: clear errors before anything is traced."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def check_array(x, name: str, op: str):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{op}: {name} must be a JAX or NumPy array, got {type(x).__name__}.")
    return x


def check_float_dtype(x, name: str, op: str) -> None:
    if np.dtype(x.dtype) not in [np.dtype(d) for d in FLOAT_DTYPES]:
        raise TypeError(f"{op}: {name} has dtype {np.dtype(x.dtype).name}; expected one of "
                        "float32, bfloat16, float16.")


def check_same_dtype(x, ref, name: str, ref_name: str, op: str) -> None:
    if np.dtype(x.dtype) != np.dtype(ref.dtype):
        raise TypeError(f"{op}: {name} has dtype {np.dtype(x.dtype).name} but {ref_name} has "
                        f"{np.dtype(ref.dtype).name}; cast them to one dtype first.")


def check_matmul_operands(x, w, op: str, *, contract: str = "K", out: str = "N") -> None:
    """``x [..., contract]`` and ``w [contract, out]`` of one float dtype.

    Raises:
      TypeError: non-arrays, integer or mismatched dtypes.
      ValueError: w not rank 2, x a scalar, or the contracted dims differ.
    """
    check_array(x, "x", op)
    check_array(w, "w", op)
    check_float_dtype(x, "x", op)
    check_same_dtype(w, x, "w", "x", op)
    if w.ndim != 2:
        raise ValueError(f"{op}: w must have rank 2 [{contract}, {out}], got shape {tuple(w.shape)}.")
    if x.ndim < 1:
        raise ValueError(f"{op}: x must have rank >= 1 [..., {contract}], got a scalar.")
    if x.shape[-1] != w.shape[0]:
        raise ValueError(f"{op}: x's last dim ({x.shape[-1]}) must equal w's first dim "
                         f"({w.shape[0]}); got x {tuple(x.shape)} and w {tuple(w.shape)}.")
