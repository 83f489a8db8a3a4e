"""cuDNN's flash attention as ``ops.dot_product_attention(implementation="cudnn")``.

What a JAX user on an NVIDIA GPU already has: ``jax.nn.dot_product_attention(...,
implementation="cudnn")``, cuDNN's fused flash attention (forward and
backward). Registered beside our kernels (:func:`ops._op.register_implementation`),
it is one more implementation of the op: named explicitly it runs, and the
default (:mod:`ops._default`) ranks it with ours by measured time, so a call
cuDNN runs faster goes to cuDNN and the rest to ours.

It takes only the calls cuDNN expresses and that agree with the float32
reference as jax.nn passes them (:func:`supported` says why not, before
anything is traced): float16 or bfloat16; one head dim for query, key and
value, a multiple of 8 up to 128; full attention, or causal with ``T == S``
(cuDNN's causal mask is top-left aligned as ours, checked only for square
calls). Not: a soft cap, sinks, segment ids or dropout (cuDNN has none of
them through jax.nn), a local window (cuDNN takes only an exclusive left
window, not jax.nn's ``(left, right)`` pair), a bias, a mask or sequence
lengths (jax.nn routes them, but their results against the reference are
not yet checked on a GPU), ``return_residual`` (jax.nn returns the logsumexp
in the input dtype, ours in float32), explicit ``block_sizes`` (tiles for our
kernels), empty operands, and any device but a GPU. cuDNN's own checks still
apply at trace time (jax raises NotImplementedError for a shape its kernels
lack, and the next implementation runs).
"""
from __future__ import annotations

import jax
import numpy as np

from ops import _op

_OP = "dot_product_attention"
MAX_HEAD_DIM = 128
_DTYPES = ("float16", "bfloat16")


def supported(call: _op.Call) -> str | None:
    """None when cuDNN can run ``call`` (a checked attention call), else why not."""
    if call.target.platform != "gpu":
        return f"cuDNN runs on an NVIDIA GPU, not on {call.target.platform}"
    a = call.args["args"]
    q, k, v = a["q"], a["k"], a["v"]
    reasons = []
    if np.dtype(q.dtype).name not in _DTYPES:
        reasons.append(f"dtype {np.dtype(q.dtype).name} (cuDNN's flash attention takes "
                       f"{' or '.join(_DTYPES)})")
    H = q.shape[-1]
    if v.shape[-1] != H or H % 8 or H > MAX_HEAD_DIM:
        reasons.append(f"head dims H={H}, Hv={v.shape[-1]} (one head dim, a multiple of 8 up to "
                       f"{MAX_HEAD_DIM})")
    if 0 in q.shape or 0 in k.shape:
        reasons.append("empty operands")
    if call.args["is_causal"] and q.shape[1] != k.shape[1]:
        reasons.append("causal with T != S (checked only for T == S)")
    features = {"logits_soft_cap": a["cap"] is not None, "sinks": a["sinks"] is not None,
                "segment ids": a["q_seg"] is not None,
                "dropout": call.args["dropout_rate"] > 0,
                "local_window_size": a["left"] is not None or a["right"] is not None,
                "bias": a["bias"] is not None, "mask": a["mask"] is not None,
                "sequence lengths": a["q_len"] is not None or a["kv_len"] is not None,
                "return_residual": bool(call.args["return_residual"]),
                "block_sizes": call.args["block_sizes"] is not None}
    reasons += [name for name, present in features.items() if present]
    return None if not reasons else "cuDNN (through jax.nn) does not take " + ", ".join(reasons)


def run(call: _op.Call):
    """``jax.nn.dot_product_attention(..., implementation="cudnn")`` on the checked call."""
    a = call.args["args"]
    out = jax.nn.dot_product_attention(a["q"], a["k"], a["v"], scale=a["scale"],
                                       is_causal=bool(call.args["is_causal"]),
                                       implementation="cudnn")
    return out[0] if a["unbatched"] else out


IMPLEMENTATION = _op.register_implementation(
    _OP, _op.Implementation("cudnn", run, supported=supported, platforms=("gpu",)))
