"""Argument checks shared by the serving ops: a clear error naming the argument
before anything is traced."""
from __future__ import annotations

import numbers

import numpy as np

from ops._checks import check_array, check_float_dtype

QUANTIZED_DTYPES = (np.dtype(np.int8),)


def check_rank(x, name: str, rank: int, layout: str, op: str):
    check_array(x, name, op)
    if x.ndim != rank:
        raise ValueError(f"{op}: {name} must have rank {rank} {layout}, got shape {tuple(x.shape)}.")
    return x


def check_int32(x, name: str, shape: tuple, layout: str, op: str):
    """An int32 array of exactly ``shape`` (None entries: any size)."""
    check_array(x, name, op)
    if np.dtype(x.dtype) != np.dtype(np.int32):
        raise TypeError(f"{op}: {name} must be int32 {layout}, got {np.dtype(x.dtype).name}.")
    if len(x.shape) != len(shape) or any(s is not None and s != d for s, d in zip(shape, x.shape)):
        want = tuple("*" if s is None else s for s in shape)
        raise ValueError(f"{op}: {name} must have shape {want} {layout}, got {tuple(x.shape)}.")
    return x


def check_pages_dtype(pages, name: str, q, op: str) -> bool:
    """Pages hold q's dtype or int8 (dequantized in the kernel); returns whether quantized."""
    if np.dtype(pages.dtype) == np.dtype(q.dtype):
        return False
    if np.dtype(pages.dtype) in QUANTIZED_DTYPES:
        return True
    raise TypeError(f"{op}: {name} has dtype {np.dtype(pages.dtype).name}; expected q's dtype "
                    f"({np.dtype(q.dtype).name}) or int8.")


def check_positive_float(x, name: str, op: str) -> float | None:
    if x is None:
        return None
    if isinstance(x, bool) or not isinstance(x, numbers.Real) or not np.isfinite(x) or x <= 0:
        raise ValueError(f"{op}: {name} must be None or a finite Python number > 0, got {x!r}.")
    return float(x)


def check_scale(scale, op: str) -> float:
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not np.isfinite(scale):
        raise ValueError(f"{op}: scale must be a finite Python number, got {scale!r}.")
    return float(scale)


def check_sinks(sinks, heads: int, op: str):
    if sinks is None:
        return None
    check_array(sinks, "sinks", op)
    check_float_dtype(sinks, "sinks", op)
    if tuple(sinks.shape) != (heads,):
        raise ValueError(f"{op}: sinks must have shape ({heads},) [N], one logit per query head; "
                         f"got {tuple(sinks.shape)}.")
    return sinks


def check_heads(num_heads: int, num_kv_heads: int, op: str) -> None:
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"{op}: the number of query heads ({num_heads}) must be a multiple of "
                         f"the number of key/value heads ({num_kv_heads}).")
