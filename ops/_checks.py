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
