"""Curated fused kernels for model authors (docs/design.md §5).

Every op is jit/vmap/grad-compatible and takes ``implementation=``: None is
the default (XLA on a CPU; on a GPU the fastest implementation measured for
the call that can run it, ours or XLA or cuDNN; :func:`resolve_implementation`
says which and why), a name or a sequence of names tried in order; see
:mod:`ops._implementation`, :mod:`ops._default` and :mod:`ops._resolve`.
"""
from ops._resolve import resolve_implementation
from ops._implementation import IMPLEMENTATIONS
from ops.activations import ACTIVATIONS
from ops.attention import dot_product_attention
from ops.decoder import apply_rotary_embedding, gated_linear_unit, rope_frequencies
from ops.matmul import fused_matmul
from ops.moe import ragged_dot
from ops.reduction import (cross_entropy, layer_norm, linear_cross_entropy, log_softmax, logsumexp,
                           max, mean, rms_norm, softmax, sum)  # noqa: A004 - jnp's names
from ops.serving import paged_attention, ragged_paged_attention, update_kv_pages

__all__ = ["ACTIVATIONS", "IMPLEMENTATIONS", "apply_rotary_embedding", "cross_entropy", "dot_product_attention", "fused_matmul", "gated_linear_unit", "layer_norm",
           "linear_cross_entropy", "log_softmax", "logsumexp", "max", "mean", "paged_attention",
           "ragged_dot", "ragged_paged_attention", "resolve_implementation", "rms_norm", "rope_frequencies", "softmax", "sum", "update_kv_pages"]
