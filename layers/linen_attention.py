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

import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from layers.attention import (DecoderOptions, _BoundAttention, _check_decoder_options,
                              dot_product_attention)
from layers.dense import _check_implementation
from layers.linen_norms import RMSNorm
from ops.attention import dot_product_attention as _flash_attention

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

_DECODER_DOC = """
    Decoder options (fields, all off by default; then the module is the drop-in
    above): ``num_kv_heads`` (grouped-query attention: ``key`` / ``value``
    project to that many heads, ``num_heads % num_kv_heads == 0``),
    ``rotary`` (a :class:`layers.linen.RotaryEmbedding`), ``qk_norm``
    (``"rms_norm"``: ``query_norm`` / ``key_norm`` RMS norms over the head
    dim), ``qk_norm_epsilon``, ``qk_norm_scale_offset``, ``scale``,
    ``local_window_size`` and ``logits_soft_cap``, with the meaning
    :class:`layers.MultiHeadAttention` gives them. With any set, ``__call__``
    also takes ``positions`` (int32 ``[B, T]`` / ``[T]``, None: ``0 .. T - 1``)
    and ``is_causal``, and runs the projections (``query``, ``key``, ``value``,
    ``out``, Linen's names and layouts), the norms, the rotary embedding and
    ``ops.dot_product_attention`` on every implementation; ``decode`` and
    ``sow_weights`` are not available there (NotImplementedError / ValueError).
"""



def _check_linen_decoder_options(module, owner: str) -> None:
    """Validates the decoder fields; keeps their :class:`layers.attention.DecoderOptions`
    (None when all are off) as ``module._decoder``."""
    kv = module.num_kv_heads
    if kv is not None and (isinstance(kv, bool) or not isinstance(kv, int) or kv <= 0
                           or module.num_heads % kv):
        raise ValueError(f"{owner}: invalid argument num_kv_heads={kv!r}; expected None or a "
                         f"positive int dividing num_heads={module.num_heads}.")
    fn = module.attention_fn
    custom_fn = not (fn is dot_product_attention or isinstance(fn, _BoundAttention))
    options = _check_decoder_options(
        owner, rotary=module.rotary, qk_norm=module.qk_norm,
        qk_norm_epsilon=module.qk_norm_epsilon, qk_norm_scale_offset=module.qk_norm_scale_offset,
        scale=module.scale, local_window_size=module.local_window_size,
        logits_soft_cap=module.logits_soft_cap, custom_fn=custom_fn)
    if options is None and kv is not None and kv != module.num_heads:
        if custom_fn:
            raise ValueError(f"{owner}: num_kv_heads is an option of the layer's own attention; "
                             "a custom attention_fn cannot take it.")
        options = DecoderOptions()  # grouped-query heads only
    object.__setattr__(module, "_decoder", options)


def _decoder_call(module, inputs_q, inputs_k, inputs_v, *, positions, mask, is_causal,
                  deterministic, dropout_rng):
    """The decoder path of the Linen twins (inside their compact ``__call__``)."""
    inputs_k = inputs_q if inputs_k is None else inputs_k
    inputs_v = inputs_k if inputs_v is None else inputs_v
    qkv_features = module.qkv_features or inputs_q.shape[-1]
    if qkv_features % module.num_heads:
        raise ValueError(f"qkv_features={qkv_features} is not a multiple of num_heads="
                         f"{module.num_heads}.")
    head_dim = qkv_features // module.num_heads
    kv_heads = module.num_kv_heads or module.num_heads
    dense = functools.partial(nn.DenseGeneral, axis=-1, dtype=module.dtype,
                              param_dtype=module.param_dtype, kernel_init=module.kernel_init,
                              bias_init=module.bias_init, use_bias=module.use_bias,
                              precision=module.precision)
    query = dense(features=(module.num_heads, head_dim), name="query")(inputs_q)
    key = dense(features=(kv_heads, head_dim), name="key")(inputs_k)
    value = dense(features=(kv_heads, head_dim), name="value")(inputs_v)
    if module.normalize_qk:
        ln = functools.partial(nn.LayerNorm, use_bias=False, dtype=module.dtype,
                               param_dtype=module.param_dtype)
        query, key = ln(name="query_ln")(query), ln(name="key_ln")(key)
    if module.qk_norm is not None:
        extra = ({"scale_offset": float(module.qk_norm_scale_offset)}
                 if module.qk_norm_scale_offset else {})
        norm = functools.partial(RMSNorm, epsilon=float(module.qk_norm_epsilon), dtype=module.dtype,
                                 param_dtype=module.param_dtype,
                                 implementation=module.implementation, **extra)
        query, key = norm(name="query_norm")(query), norm(name="key_norm")(key)
    if module.rotary is not None:
        if positions is None:
            positions = jnp.arange(query.shape[-3], dtype=jnp.int32)
        query, key = module.rotary(query, positions), module.rotary(key, positions)
    rate = 0.0
    if module.dropout_rate > 0.0 and not nn.merge_param("deterministic", module.deterministic,
                                                        deterministic):
        rate = module.dropout_rate
        dropout_rng = module.make_rng("dropout") if dropout_rng is None else dropout_rng
    else:
        dropout_rng = None
    if mask is not None:
        mask = jnp.asarray(mask).astype(jnp.bool_)
    opts = module._decoder
    out = _flash_attention(query, key, value, mask=mask, is_causal=bool(is_causal),
                           scale=opts.scale, local_window_size=opts.local_window_size,
                           logits_soft_cap=opts.logits_soft_cap, dropout_rate=rate,
                           dropout_rng=dropout_rng, implementation=module.implementation)
    return nn.DenseGeneral(features=module.out_features or inputs_q.shape[-1], axis=(-2, -1),
                           kernel_init=module.out_kernel_init or module.kernel_init,
                           bias_init=module.out_bias_init or module.bias_init,
                           use_bias=module.use_bias, dtype=module.dtype,
                           param_dtype=module.param_dtype, precision=module.precision,
                           name="out")(out)


def _call(module, parent_call, inputs_q, inputs_k, inputs_v, *, inputs_kv, mask, deterministic,
          dropout_rng, sow_weights, positions, is_causal):
    """The twins' ``__call__``: Linen's own, or the decoder path when an option is set."""
    if module._decoder is None:
        if positions is not None or is_causal:
            raise ValueError(f"{type(module).__name__}: positions= and is_causal= belong to the "
                             "decoder options (rotary, qk_norm, ...), none of which is set.")
        return parent_call(inputs_q, inputs_k, inputs_v, inputs_kv=inputs_kv, mask=mask,
                           deterministic=deterministic, dropout_rng=dropout_rng,
                           sow_weights=sow_weights)
    if sow_weights:
        raise ValueError(f"{type(module).__name__}: sow_weights=True needs Linen's attention, "
                         "which has none of the decoder options.")
    if module.decode:
        raise NotImplementedError(f"{type(module).__name__}: decode=True with the decoder "
                                  "options needs a key/value cache of rotated keys, not built yet.")
    if inputs_kv is not None:
        inputs_k = inputs_v = inputs_kv
    return _decoder_call(module, inputs_q, inputs_k, inputs_v, positions=positions, mask=mask,
                         is_causal=is_causal, deterministic=deterministic,
                         dropout_rng=dropout_rng)


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


def _with_decoder_options(parent, owner: str):
    """``parent`` with ``implementation`` and the decoder options as fields (the base of a twin)."""

    class Twin(parent):
        attention_fn: Callable[..., Any] = dot_product_attention
        implementation: str | None = None
        num_kv_heads: int | None = None
        rotary: Any = None
        qk_norm: str | None = None
        qk_norm_epsilon: float = 1e-6
        qk_norm_scale_offset: float = 0.0
        scale: float | None = None
        local_window_size: Any = None
        logits_soft_cap: float | None = None

        def __post_init__(self):
            _bind_default_attention_fn(self, owner)
            _check_linen_decoder_options(self, owner)
            super().__post_init__()

        @nn.compact
        def __call__(self, inputs_q, inputs_k=None, inputs_v=None, *, inputs_kv=None, mask=None,
                     deterministic=None, dropout_rng=None, sow_weights=False, positions=None,
                     is_causal=False):
            return _call(self, super().__call__, inputs_q, inputs_k, inputs_v,
                         inputs_kv=inputs_kv, mask=mask, deterministic=deterministic,
                         dropout_rng=dropout_rng, sow_weights=sow_weights, positions=positions,
                         is_causal=is_causal)

    Twin.__name__ = Twin.__qualname__ = f"_{parent.__name__}Fields"
    return Twin


class MultiHeadDotProductAttention(_with_decoder_options(
        nn.MultiHeadDotProductAttention, "layers.linen.MultiHeadDotProductAttention")):
    """Multi-head dot-product attention by flash-attention kernels.

    A drop-in for :class:`flax.linen.MultiHeadDotProductAttention`; the same
    ``__call__(inputs_q, inputs_k=None, inputs_v=None, *, inputs_kv=None,
    mask=None, deterministic=None, dropout_rng=None, sow_weights=False)``.
    """


class MultiHeadAttention(_with_decoder_options(nn.MultiHeadAttention,
                                               "layers.linen.MultiHeadAttention")):
    """Linen's alias of MultiHeadDotProductAttention (auto-named ``MultiHeadAttention_{i}``), by flash kernels.

    A drop-in for :class:`flax.linen.MultiHeadAttention`.
    """


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
for _cls in (MultiHeadDotProductAttention, MultiHeadAttention):
    _cls.__doc__ += _DECODER_DOC
del _cls
