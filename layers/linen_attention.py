"""``layers.linen.MultiHeadDotProductAttention`` / ``MultiHeadAttention`` / ``SelfAttention``.

Subclasses of the Flax Linen modules of the same names with one more
dataclass field, ``implementation`` (default None), and a different default
``attention_fn``: :func:`layers.dot_product_attention` (flash-attention
kernels) with ``implementation`` bound. Everything else (fields and defaults,
projections ``query`` / ``key`` / ``value`` / ``out`` and ``query_ln`` /
``key_ln``, the ``cache`` collection of decode mode, dropout-rng handling,
``sow_weights``) is Linen's own code, so ``init`` with the same key gives the
same variables as the stock module, and the stock module's variables apply
unchanged. The class names are Linen's, so auto-named submodules
(``MultiHeadDotProductAttention_0``) and checkpoints keep their paths.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn

from layers.attention import _BoundAttention, dot_product_attention
from layers.dense import _check_implementation

__all__ = ["MultiHeadAttention", "MultiHeadDotProductAttention", "SelfAttention"]

_COMMON_DOC = """
    Attributes:
      implementation: None (the platform's default, resolved at call time) or
        a name from ``ops.IMPLEMENTATIONS``, validated at construction
        (ValueError naming the argument). Used by the default
        ``attention_fn`` only; an explicit ``attention_fn`` runs as given.
      everything else: exactly as the Flax module (same defaults), except
        that ``attention_fn`` defaults to :func:`layers.dot_product_attention`.

    On the ``"xla"`` implementation (the CPU default) the attention is Linen's
    own ``dot_product_attention``: outputs, gradients and variables are the
    stock module's bit for bit (dropout included). On the kernel
    implementations they agree with the stock module up to float rounding,
    except where :func:`layers.dot_product_attention` documents a difference:
    a query row that sees no key gives 0 (Linen: the mean of the values), and
    dropout draws different bits (independent per batch element and head).
    ``sow_weights=True`` and Linen's einsum hooks run Linen's own attention
    (warned once), since the kernel never forms the probabilities.
"""


def _bind_default_attention_fn(module, owner: str) -> None:
    """Validates ``implementation`` and binds it into the default ``attention_fn``.

    Runs in ``__post_init__`` (before Linen freezes the module); a clone with
    another ``implementation`` rebinds, an explicit ``attention_fn`` is kept.
    """
    object.__setattr__(module, "implementation",  # a sequence as a tuple: hashable
                       _check_implementation(module.implementation, owner))
    fn = module.attention_fn
    if fn is dot_product_attention or isinstance(fn, _BoundAttention):
        object.__setattr__(module, "attention_fn", _BoundAttention(module.implementation))


class MultiHeadDotProductAttention(nn.MultiHeadDotProductAttention):
    """Multi-head dot-product attention by flash-attention kernels.

    A drop-in for :class:`flax.linen.MultiHeadDotProductAttention`; the same
    ``__call__(inputs_q, inputs_k=None, inputs_v=None, *, inputs_kv=None,
    mask=None, deterministic=None, dropout_rng=None, sow_weights=False)``.
    """

    attention_fn: Callable[..., Any] = dot_product_attention
    implementation: str | None = None

    def __post_init__(self):
        _bind_default_attention_fn(self, "layers.linen.MultiHeadDotProductAttention")
        super().__post_init__()


class MultiHeadAttention(nn.MultiHeadAttention):
    """Linen's alias of MultiHeadDotProductAttention (auto-named ``MultiHeadAttention_{i}``), by flash kernels.

    A drop-in for :class:`flax.linen.MultiHeadAttention`.
    """

    attention_fn: Callable[..., Any] = dot_product_attention
    implementation: str | None = None

    def __post_init__(self):
        _bind_default_attention_fn(self, "layers.linen.MultiHeadAttention")
        super().__post_init__()


class SelfAttention(nn.SelfAttention):
    """Self-attention by flash-attention kernels: a drop-in for :class:`flax.linen.SelfAttention`.

    ``__call__(inputs_q, mask=None, deterministic=None, dropout_rng=None,
    sow_weights=False)`` as Linen's (which is deprecated upstream in favour of
    ``MultiHeadDotProductAttention(inputs_q)``, and warns so).
    """

    attention_fn: Callable[..., Any] = dot_product_attention
    implementation: str | None = None

    def __post_init__(self):
        _bind_default_attention_fn(self, "layers.linen.SelfAttention")
        super().__post_init__()


for _cls in (MultiHeadDotProductAttention, MultiHeadAttention, SelfAttention):
    _cls.__doc__ += _COMMON_DOC
del _cls
