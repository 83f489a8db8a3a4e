"""``layers.RotaryEmbedding``: rotary position embeddings (RoPE) as an NNX module.

Su et al. 2021, "RoFormer: Enhanced Transformer with Rotary Position
Embedding", section 3.4: features are rotated in pairs by angles
``position * inv_freq``, so that the dot product of a rotated query and key
depends only on their relative position. The module holds no parameters: it
is its configuration (rotary dim, base ``theta``, the frequency scaling of
long-context models, the pair layout), computes the frequencies with
``ops.rope_frequencies`` when called and rotates with
``ops.apply_rotary_embedding`` (angles in float32 inside the kernel; no
``[T, R]`` cos/sin tables in memory). The Linen twin is
:class:`layers.linen.RotaryEmbedding`.

Use it on the query and key heads of attention, after their projection (and
after per-head q/k norms, as Qwen3 and Gemma 3 do), or give it to
:class:`layers.MultiHeadAttention` as ``rotary=``, which does exactly that.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flax import nnx

import ops
from layers.dense import _check_implementation

__all__ = ["RotaryEmbedding"]


def _frozen_scaling(scaling: Mapping[str, Any] | None, owner: str):
    """``scaling`` as a sorted tuple of items (hashable, static for jit and Flax), or None."""
    if scaling is None:
        return None
    if not isinstance(scaling, Mapping):
        raise TypeError(f"{owner}: invalid argument scaling={scaling!r}; expected None or a "
                        "mapping such as {'rope_type': 'llama3', 'factor': 8.0, ...}.")
    return tuple(sorted((str(k), v) for k, v in scaling.items()))


def _check_rotary_dim(rotary_dim, owner: str) -> int:
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int) or rotary_dim <= 0 \
            or rotary_dim % 2:
        raise ValueError(f"{owner}: invalid argument rotary_dim={rotary_dim!r}; expected a "
                         "positive even int (the rotated features of each head).")
    return rotary_dim


def _check_theta(theta, owner: str) -> float:
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 1.0:
        raise ValueError(f"{owner}: invalid argument theta={theta!r}; expected a number > 1 "
                         "(the frequency base).")
    return float(theta)


def rotate(x, positions, *, rotary_dim: int, theta: float, scaling, interleaved: bool,
           implementation):
    """``ops.apply_rotary_embedding`` of ``x`` with the frequencies of the configuration.

    Shared by the NNX module and its Linen twin; ``scaling`` is the frozen
    (tuple of items) form kept by the modules.
    """
    inv_freq, attention_scaling = ops.rope_frequencies(
        rotary_dim, theta=theta, scaling=None if scaling is None else dict(scaling))
    return ops.apply_rotary_embedding(x, positions, inv_freq, interleaved=interleaved,
                                      attention_scaling=attention_scaling,
                                      implementation=implementation)


class RotaryEmbedding(nnx.Module):
    """Rotary position embedding of the first ``rotary_dim`` features of every head.

    Args:
      rotary_dim: the rotated features of each head, a positive even int
        ``<= head_dim`` (``head_dim`` itself for Llama, Mistral, Qwen and
        Gemma; less for partial rotary, as GPT-NeoX and Phi: the other
        features pass through unchanged).
      theta: the frequency base (transformers' ``rope_theta``): ``inv_freq[i]
        = theta ** (-2 i / rotary_dim)``; 10000 by default, 500000 for Llama 3.
      scaling: None or a mapping of the rope type and its parameters, with
        transformers' names and meaning (``rope_parameters`` /
        ``rope_scaling`` of a model config), e.g. ``{"rope_type": "llama3",
        "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}``; passed to
        ``ops.rope_frequencies``, which documents every type.
      interleaved: False pairs features ``(i, i + rotary_dim / 2)``
        (Llama / NeoX / transformers' ``rotate_half``); True pairs ``(2i,
        2i + 1)`` (GPT-J, Meta's original Llama checkpoints).
      implementation: None (the platform's default, resolved at call time), a
        name from ``ops.IMPLEMENTATIONS`` or a sequence of them tried in order.
      rngs: unused (accepted so that the module builds like every other layer).

    Call: ``rope(x, positions)`` with ``x`` ``[B, T, N, H]`` (or ``[T, N, H]``)
    and int32 ``positions`` ``[B, T]`` (or ``[T]``); returns ``x`` rotated,
    same shape and dtype. The cos and sin are multiplied by the
    ``attention_scaling`` of the rope type (YaRN's; 1 otherwise). Gradients
    flow to ``x`` (a rotation by the negative angle).

    Raises:
      ValueError / TypeError: at construction, a bad ``rotary_dim``,
        ``theta``, ``scaling`` or ``implementation`` (naming the argument); at
        call time, ``ops.apply_rotary_embedding``'s shape errors (for instance
        ``rotary_dim`` larger than the head dim).
    """

    def __init__(self, rotary_dim: int, *, theta: float = 10000.0,
                 scaling: Mapping[str, Any] | None = None, interleaved: bool = False,
                 implementation=None, rngs: nnx.Rngs | None = None):
        del rngs
        owner = "layers.RotaryEmbedding"
        self.rotary_dim = _check_rotary_dim(rotary_dim, owner)
        self.theta = _check_theta(theta, owner)
        self.scaling = _frozen_scaling(scaling, owner)
        self.interleaved = bool(interleaved)
        self.implementation = _check_implementation(implementation, owner)

    def __call__(self, x, positions):
        """``x`` ``[B, T, N, H]`` / ``[T, N, H]`` rotated by ``positions`` ``[B, T]`` / ``[T]``."""
        return rotate(x, positions, rotary_dim=self.rotary_dim, theta=self.theta,
                      scaling=self.scaling, interleaved=self.interleaved,
                      implementation=self.implementation)
