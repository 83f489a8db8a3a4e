"""JAX's own Pallas GPU ops as a benchmark implementation column, ``jax_pallas``.

The yardstick beside ours, XLA's and cuDNN's: the kernels JAX ships in
``jax.experimental.pallas.ops.gpu`` for the same problems, called with the
case's inputs and computing the case's math:

* ``attention.mha`` (FlashAttention-2 forward, fused dK/dV + dQ backward as a
  custom VJP), ``sm_scale = 1/sqrt(head_dim)`` (its default is 1.0);
* ``layer_norm.layer_norm`` and ``rms_norm.rms_norm`` (custom VJPs: a per-row
  dx kernel and a column-blocked dweight / dbias kernel), the case's epsilon
  (theirs defaults to 1e-5);
* ``softmax.softmax`` (last axis, forward only: it has no VJP, and reverse
  mode through its ``pallas_call`` fails, so the ``fwd+bwd`` cases get no
  column).

On GPUs (platform ``gpu`` / ``cuda``) the kernels run compiled by JAX's Pallas
Triton lowering; on CPUs on JAX's Pallas interpreter (``interpret=True``), a
check of accuracy only, and only in full runs: a quick CPU run (CI's smoke
test of the suite) leaves the column out. Other platforms get no column (the
kernels are Triton kernels).

What the kernels cannot express gets no column (:func:`mha_unsupported`), never
a reshaped problem: ``mha`` reads key/value head ``n`` for query head ``n``
(no grouped-query attention) and needs sequence lengths that its blocks (128
queries and keys forward, 32 backward, capped at the lengths) divide.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu import attention as jax_attention
from jax.experimental.pallas.ops.gpu import layer_norm as jax_layer_norm
from jax.experimental.pallas.ops.gpu import rms_norm as jax_rms_norm
from jax.experimental.pallas.ops.gpu import softmax as jax_softmax

NAME = "jax_pallas"

_GPU_PLATFORMS = ("gpu", "cuda")


def interpret_mode(platform: str, quick: bool) -> bool | None:
    """How the column runs on ``platform``: False (compiled) on GPUs, True (JAX's
    interpreter) on CPUs in full runs, None (no column) in quick CPU runs and on
    other platforms."""
    if platform in _GPU_PLATFORMS:
        return False
    if platform == "cpu" and not quick:
        return True
    return None


def mha_unsupported(q_len: int, kv_len: int, heads: int, kv_heads: int) -> str | None:
    """Why ``attention.mha`` cannot compute this problem (None if it can).

    Mirrors its own checks (its default forward blocks, ``min(128, length)``,
    must divide the lengths; the fused backward needs as many query blocks as
    key blocks) and the limits it does not check: its backward blocks
    (``min(32, length)``) are not masked, so they must divide the lengths too,
    and its key/value BlockSpecs index head ``n`` of k and v for query head
    ``n``, so fewer key/value heads (grouped-query attention) would read past
    them.
    """
    if kv_heads != heads:
        return f"no grouped-query attention ({heads} query heads, {kv_heads} key/value heads)"
    blocks = jax_attention.BlockSizes.get_default()
    for name, length, sizes in (
            ("q_len", q_len, (blocks.block_q, blocks.block_q_dq, blocks.block_q_dkv)),
            ("kv_len", kv_len, (blocks.block_k, blocks.block_kv_dq, blocks.block_kv_dkv))):
        for block in (min(size, length) for size in sizes):
            if length % block:
                return f"{name}={length} is not a multiple of its block {block}"
    if q_len // min(blocks.block_q_dq, q_len) != kv_len // min(blocks.block_kv_dkv, kv_len):
        return "the fused backward needs as many query blocks as key blocks"
    return None


def mha(q, k, v, *, causal: bool, interpret: bool):
    """``attention.mha`` on ``q [B, T, N, H]``, ``k, v [B, S, N, H]``, scaled by
    ``1/sqrt(H)``; causal masking top-left aligned (query i sees keys j <= i)."""
    return jax_attention.mha(q, k, v, None, sm_scale=q.shape[-1] ** -0.5, causal=causal,
                             interpret=interpret)


def layer_norm(x, scale, bias, *, epsilon: float, interpret: bool):
    """``layer_norm.layer_norm`` on ``x [rows, hidden]``: its kernel vmaps over
    exactly two leading axes, so ``x`` goes in as ``[1, rows, hidden]`` (a free
    reshape). Its backward keeps the per-row mean and 1/std in x's dtype."""
    return jax_layer_norm.layer_norm(x[None], scale, bias, eps=epsilon, interpret=interpret)[0]


def rms_norm(x, scale, *, epsilon: float, interpret: bool):
    """``rms_norm.rms_norm`` on ``x [rows, hidden]`` (as ``[1, rows, hidden]``).

    JAX's op requires a bias (its kernels load and add it, and its backward
    writes its gradient): a zero bias of ``hidden`` elements goes in, one
    extra parameter read (and, in the backward, one extra parameter-sized
    write) that the case's ``bytes_accessed`` does not count.
    """
    bias = jnp.zeros_like(scale)
    return jax_rms_norm.rms_norm(x[None], scale, bias, eps=epsilon, interpret=interpret)[0]


def softmax(x, *, interpret: bool):
    """``softmax.softmax`` over the last axis (one program per row, the whole row in
    one power-of-two block). Forward only: it has no VJP."""
    return jax_softmax.softmax(x, axis=-1, interpret=interpret)
