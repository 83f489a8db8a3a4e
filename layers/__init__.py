"""Drop-in Flax layers backed by the fused kernels in :mod:`ops` (docs/design.md §6).

* :class:`layers.Dense` -- a subclass of ``flax.nnx.Linear`` computing
  ``activation(x @ kernel + bias)`` with ``ops.fused_matmul``.
* :class:`layers.linen.Dense` -- the same for ``flax.linen.Dense``.
* :class:`layers.LayerNorm`, :class:`layers.RMSNorm` -- subclasses of
  ``flax.nnx.LayerNorm`` / ``RMSNorm`` over ``ops.layer_norm`` / ``ops.rms_norm``,
  with Linen twins ``layers.linen.LayerNorm`` / ``RMSNorm``.
* :func:`layers.dot_product_attention` -- an ``attention_fn`` for the stock
  ``flax.nnx.MultiHeadAttention`` / ``flax.linen.MultiHeadDotProductAttention``
  that runs ``ops.dot_product_attention`` (flash attention), falling back to
  Flax's own function (warned once) for what the kernel cannot express.
* :class:`layers.MultiHeadAttention` -- a subclass of
  ``flax.nnx.MultiHeadAttention`` whose default ``attention_fn`` is that
  function, with Linen twins ``layers.linen.MultiHeadDotProductAttention``,
  ``MultiHeadAttention`` and ``SelfAttention``; with its decoder options it
  also takes a rotary embedding, per-head q/k RMS norms, a logit scale,
  sliding window and logit soft cap.
* :class:`layers.GatedMLP` -- the gated MLP of Llama / Gemma (SwiGLU, GeGLU)
  through ``ops.gated_linear_unit``; :class:`layers.RotaryEmbedding` -- rotary
  position embeddings through ``ops.apply_rotary_embedding``.
* :class:`layers.MoE` -- a mixture-of-experts SwiGLU block (Mixtral's top-k
  router, experts through ``ops.ragged_dot``, load-balancing statistics,
  optional expert parallelism), Linen twin ``layers.linen.MoE``.

All keep their Flax parent's constructor arguments, defaults, parameter
names, shapes, initializers and metadata, so state and checkpoints made by
the Flax layer load unchanged; they add keyword ``implementation`` (None,
one of ``ops.IMPLEMENTATIONS``, or a sequence of them tried in order, kept as
a tuple), validated at construction, and the Dense
layers keyword ``activation`` (None, a name from ``ops.ACTIVATIONS`` or a
callable).
"""
from layers import linen
from layers.attention import MultiHeadAttention, dot_product_attention
from layers.dense import Dense
from layers.mlp import GatedMLP
from layers.moe import MoE
from layers.norms import LayerNorm, RMSNorm
from layers.rotary import RotaryEmbedding

__all__ = ["Dense", "GatedMLP", "LayerNorm", "MoE", "MultiHeadAttention", "RMSNorm",
           "RotaryEmbedding", "dot_product_attention", "linen"]
