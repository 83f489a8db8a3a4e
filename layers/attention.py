"""``layers.dot_product_attention`` and ``layers.MultiHeadAttention``: flash attention for Flax.

:func:`dot_product_attention` takes every keyword that ``flax.nnx.MultiHeadAttention``
and ``flax.linen.MultiHeadDotProductAttention`` pass to their ``attention_fn``
and computes the attention with ``ops.dot_product_attention`` (FlashAttention-2
kernels: the ``T x S`` probabilities are never stored). What the kernel cannot
express runs Flax's own ``dot_product_attention`` instead, after a one-time
warning naming the reason.

:class:`MultiHeadAttention` is a subclass of ``flax.nnx.MultiHeadAttention``
whose default ``attention_fn`` is that function (Flax's own on the ``"xla"``
implementation, so the stock layer's bits there): projections, ``normalize_qk``,
the decode cache, dropout-rng handling and the parameter tree are all
nnx.MultiHeadAttention's own code, so state made by the stock module loads
unchanged. The Linen twins are in :mod:`layers.linen_attention`.
"""
from __future__ import annotations

import dataclasses
import inspect
import math
import numbers
import warnings

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx.nn import dtypes as nnx_dtypes
from jax import lax

from layers.dense import _FUSED_DTYPES, _as_precision, _check_implementation
from layers.norms import RMSNorm
from ops._implementation import platform_default, run_implementation
from ops.attention import dot_product_attention as _flash_attention

__all__ = ["AttentionFallbackWarning", "MultiHeadAttention", "dot_product_attention"]


class AttentionFallbackWarning(UserWarning):
    """``layers.dot_product_attention`` ran Flax's attention instead of the flash kernel."""


# Reasons already warned about: each fallback reason warns once per process.
_WARNED: set[str] = set()


def _warn_once(reason: str, message: str) -> None:
    if reason in _WARNED:
        return
    _WARNED.add(reason)
    warnings.warn(f"layers.dot_product_attention: {message}; running Flax's "
                  "dot_product_attention instead (this warning is shown once).",
                  AttentionFallbackWarning, stacklevel=3)


def dot_product_attention(query, key, value, bias=None, mask=None, broadcast_dropout=True,
                          dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
                          precision=None, module=None, promote_dtype=None, is_causal=False, *,
                          force_fp32_for_softmax=None, einsum_dot_general=None,
                          qk_attn_weights_einsum=None, attn_weights_value_einsum=None,
                          implementation: str | None = None, block_sizes=None):
    """Flax's ``dot_product_attention`` by flash-attention kernels (``ops.dot_product_attention``).

    A drop-in for the ``attention_fn`` of :class:`flax.nnx.MultiHeadAttention`
    and :class:`flax.linen.MultiHeadDotProductAttention` (and for direct calls
    of ``flax.nnx.dot_product_attention`` / ``flax.linen.dot_product_attention``)::

      nnx.MultiHeadAttention(..., attention_fn=layers.dot_product_attention)
      nn.MultiHeadDotProductAttention(..., attention_fn=functools.partial(
          layers.dot_product_attention, implementation="triton"))

    Args:
      query: ``[batch..., T, N, H]`` (any number of batch dims, also none).
      key, value: ``[batch..., S, K, H]`` with the same batch dims; ``N % K == 0``
        (grouped-query attention, as nnx's ``num_kv_heads``).
      bias: optional, broadcastable to ``[batch..., N, T, S]``; added to the
        logits (in float32; Flax adds it in the compute dtype).
      mask: optional, broadcastable to ``[batch..., N, T, S]``; nonzero / True
        attends (Linen's float masks from ``make_attention_mask`` work as is).
      broadcast_dropout, dropout_rng, dropout_rate, deterministic: as Flax;
        see "Dropout" below.
      dtype: the compute dtype (None: the promoted type of query, key and
        value), applied as Flax does; the output has it.
      precision: None, ``DEFAULT`` or ``HIGHEST`` (alone or as a pair) run the
        kernel, which multiplies float32 at full precision; anything else
        falls back to Flax.
      module: when given (``sow_weights=True``), Flax's function runs so that
        it can sow the attention probabilities into ``module`` (the kernel
        never forms them).
      promote_dtype: nnx's promotion hook, ``promote_dtype((q, k, v), dtype=...)``
        (None: ``flax.nnx``'s default).
      is_causal: query ``i`` sees keys ``j <= i`` (top-left aligned when
        ``T != S``, as Flax).
      force_fp32_for_softmax, einsum_dot_general, qk_attn_weights_einsum,
        attn_weights_value_einsum: Linen's keywords. The softmax always runs
        in float32 here; with ``force_fp32_for_softmax=True`` and a 16-bit
        compute dtype the output is float32, as Linen returns it. The einsum
        hooks (quantized einsums, e.g. AQT) fall back to Linen's function.
      implementation: keyword-only; None (the platform's default) or a name
        from ``ops.IMPLEMENTATIONS``, passed to ``ops.dot_product_attention``.
      block_sizes: keyword-only; passed to ``ops.dot_product_attention``.

    Returns:
      ``[batch..., T, N, H]`` in the compute dtype.

    Fully masked query rows: a query that sees no key (every entry of its
    mask row False) gets output 0 here, with zero gradients; Flax masks with a
    large negative logit and returns the mean of all values for such a row.
    Padding *queries* under a padding mask are such rows. Rows with at least
    one visible key agree with Flax up to float rounding.

    Dropout (``dropout_rate > 0`` and ``deterministic=False``): applied inside
    the kernel, each probability dropped with probability ``dropout_rate`` and
    the survivors scaled by ``1 / (1 - dropout_rate)``, exactly as Flax in
    distribution, but the keep/drop bits come from the kernel's counter hash
    seeded by ``dropout_rng`` (``ops.attention.dropout``), not from
    ``jax.random.bernoulli``: for the same ``dropout_rng`` the dropped entries
    differ from Flax's. The bits are also drawn independently for each batch
    element and head, whatever ``broadcast_dropout`` says (Flax's default
    ``broadcast_dropout=True`` reuses one ``[T, S]`` mask for all of them).
    Forward and backward passes draw the same bits. ``dropout_rng`` is
    required then (ValueError otherwise).

    Fallback to Flax (warned once per reason with an
    :class:`AttentionFallbackWarning`): ``module`` given (probabilities
    requested), a ``precision`` other than None/DEFAULT/HIGHEST, Linen's einsum
    hooks, a compute dtype other than float32/bfloat16/float16 (float64,
    complex), a value head dim different from the query's, a traced
    ``deterministic`` or ``dropout_rate``. The fallback is
    ``flax.linen.dot_product_attention`` when Linen called (``module`` is a
    Linen module, or any Linen-only keyword above is given: Linen's
    MultiHeadDotProductAttention always passes ``force_fp32_for_softmax``),
    else ``flax.nnx.dot_product_attention``; ``is_causal`` and grouped heads
    are expressed for Linen's function as a mask and repeated heads.

    Raises:
      ValueError: query, key and value of different ranks or batch dims,
        dropout without ``dropout_rng``, and ``ops.dot_product_attention``'s
        shape and argument errors (ValueError / TypeError naming the argument).
    """
    given = (query, key, value)  # unpromoted, for Flax's function (it promotes them itself)
    linen = _called_by_linen(module, force_fp32_for_softmax, einsum_dot_general,
                             qk_attn_weights_einsum, attn_weights_value_einsum)
    if promote_dtype is not None:
        query, key, value = promote_dtype((query, key, value), dtype=dtype)
    else:
        query, key, value = nnx_dtypes.promote_dtype((query, key, value), dtype=dtype)
    flax_args = dict(bias=bias, mask=mask, broadcast_dropout=broadcast_dropout,
                     dropout_rng=dropout_rng, dropout_rate=dropout_rate,
                     deterministic=deterministic, dtype=dtype, precision=precision,
                     module=module, is_causal=is_causal, promote_dtype=promote_dtype,
                     force_fp32_for_softmax=force_fp32_for_softmax,
                     einsum_dot_general=einsum_dot_general,
                     qk_attn_weights_einsum=qk_attn_weights_einsum,
                     attn_weights_value_einsum=attn_weights_value_einsum)
    reason = _fallback_reason(query, key, value, module, precision, deterministic, dropout_rate,
                              einsum_dot_general, qk_attn_weights_einsum,
                              attn_weights_value_einsum)
    if reason is not None:
        _warn_once(*reason)
        return _flax_attention(*given, linen=linen, **flax_args)

    if query.ndim != key.ndim or query.ndim != value.ndim or query.ndim < 3:
        raise ValueError("layers.dot_product_attention: query, key and value must be "
                         "[batch..., length, heads, head_dim] of one rank, got shapes "
                         f"{query.shape}, {key.shape}, {value.shape}.")
    batch = query.shape[:-3]
    if key.shape[:-3] != batch or value.shape[:-3] != batch:
        raise ValueError("layers.dot_product_attention: query, key and value must have the same "
                         f"batch dims, got shapes {query.shape}, {key.shape}, {value.shape}.")
    if mask is not None:
        mask = jnp.asarray(mask)
        if mask.dtype != jnp.bool_:
            mask = mask.astype(jnp.bool_)
    if bias is not None:
        bias = jnp.asarray(bias)
        if not jnp.issubdtype(bias.dtype, jnp.floating):
            bias = bias.astype(jnp.float32)
    dropping = not deterministic and dropout_rate > 0
    if dropping and dropout_rng is None:
        raise ValueError("layers.dot_product_attention: dropout_rate="
                         f"{dropout_rate} with deterministic=False needs a dropout_rng.")
    if len(batch) > 1:  # ops takes one batch dim: flatten them, and restore below
        flat = (math.prod(batch),)
        query, key, value = (jnp.reshape(x, flat + x.shape[-3:]) for x in (query, key, value))
        mask, bias = (_flatten_pair(x, batch) for x in (mask, bias))
    out = _flash_attention(query, key, value, bias, mask, is_causal=bool(is_causal),
                           dropout_rate=float(dropout_rate) if dropping else 0.0,
                           dropout_rng=dropout_rng if dropping else None,
                           implementation=implementation, block_sizes=block_sizes)
    if len(batch) > 1:
        out = jnp.reshape(out, batch + out.shape[1:])
    if force_fp32_for_softmax and out.dtype != jnp.float32:
        out = out.astype(jnp.promote_types(out.dtype, jnp.float32))  # Linen's output dtype
    return out


def _precision_ok(precision) -> bool:
    """None, DEFAULT or HIGHEST (alone or a pair): the kernel's full float32 precision serves."""
    ok = (lax.Precision.DEFAULT, lax.Precision.HIGHEST)
    if precision is None:
        return True
    if isinstance(precision, (tuple, list)):
        return len(precision) == 2 and all(_as_precision(p) in ok for p in precision)
    return _as_precision(precision) in ok


def _fallback_reason(query, key, value, module, precision, deterministic, dropout_rate,
                     einsum_dot_general, qk_einsum, value_einsum):
    """None when the kernel can run, else (reason key, message) for the one-time warning."""
    if module is not None:
        return ("module", "the attention probabilities were requested (module given, e.g. "
                          "sow_weights=True) and the flash kernel never forms them")
    if einsum_dot_general is not None or qk_einsum is not None or value_einsum is not None:
        return ("einsum", "a custom einsum / einsum_dot_general (e.g. a quantized einsum) "
                          "cannot run inside the kernel")
    if not _precision_ok(precision):
        return ("precision", f"precision={precision!r} is not one the kernel computes (it "
                             "multiplies float32 at full precision: None, DEFAULT or HIGHEST)")
    if jnp.dtype(query.dtype) not in _FUSED_DTYPES:
        return ("dtype", f"compute dtype {jnp.dtype(query.dtype).name} is not float32, "
                         "bfloat16 or float16")
    if value.shape[-1:] != query.shape[-1:] or key.shape[-1:] != query.shape[-1:]:
        return ("head_dim", f"query/key/value head dims differ ({query.shape[-1:]}, "
                            f"{key.shape[-1:]}, {value.shape[-1:]})")
    if not isinstance(deterministic, (bool, np.bool_)):
        return ("traced", "deterministic is not a Python bool (traced?)")
    if not deterministic and (isinstance(dropout_rate, bool)
                              or not isinstance(dropout_rate, numbers.Real)):
        return ("traced", "dropout_rate is not a Python number (traced?)")
    return None


def _flatten_pair(x, batch):
    """A mask / bias broadcastable to ``[*batch, N, T, S]`` as ``[B or 1, N, T, S]``."""
    if x is None or x.ndim <= 3:
        return x
    if x.ndim > len(batch) + 3:
        raise ValueError(f"layers.dot_product_attention: a mask/bias of shape {x.shape} does not "
                         f"broadcast to [*batch, N, T, S] with batch dims {batch}.")
    x = jnp.reshape(x, (1,) * (len(batch) + 3 - x.ndim) + x.shape)
    lead, tail = x.shape[:len(batch)], x.shape[len(batch):]
    if all(d == 1 for d in lead):
        return jnp.reshape(x, (1,) + tail)
    return jnp.reshape(jnp.broadcast_to(x, batch + tail), (math.prod(batch),) + tail)


def _called_by_linen(module, force_fp32_for_softmax, einsum_dot_general, qk_einsum,
                     value_einsum) -> bool:
    """Whether Linen called: a Linen module, or a Linen-only keyword (Linen's
    MultiHeadDotProductAttention always passes ``force_fp32_for_softmax``)."""
    return (isinstance(module, nn.Module) or force_fp32_for_softmax is not None
            or einsum_dot_general is not None or qk_einsum is not None
            or value_einsum is not None)


def _flax_attention(query, key, value, *, linen, promote_dtype, force_fp32_for_softmax,
                    einsum_dot_general, qk_attn_weights_einsum, attn_weights_value_einsum,
                    **flax_args):
    """Flax's own ``dot_product_attention``: Linen's when Linen called, else nnx's."""
    if linen:
        return _linen_attention(query, key, value, **flax_args,
                                force_fp32_for_softmax=bool(force_fp32_for_softmax),
                                einsum_dot_general=einsum_dot_general,
                                qk_attn_weights_einsum=qk_attn_weights_einsum,
                                attn_weights_value_einsum=attn_weights_value_einsum)
    return nnx.dot_product_attention(query, key, value, **flax_args,
                                     promote_dtype=promote_dtype or nnx_dtypes.promote_dtype)


def _stock_attention(query, key, value, bias=None, mask=None, broadcast_dropout=True,
                    dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
                    precision=None, module=None, promote_dtype=None, is_causal=False, *,
                    force_fp32_for_softmax=None, einsum_dot_general=None,
                    qk_attn_weights_einsum=None, attn_weights_value_einsum=None):
    """The attention layers' ``"xla"`` implementation: Flax's own ``dot_product_attention``.

    ``flax.linen.dot_product_attention`` when Linen calls (a Linen ``module`` or a
    Linen-only keyword), else ``flax.nnx.dot_product_attention``, with every
    argument as given: the same operations in the same order as the stock
    modules, so :class:`MultiHeadAttention` and the Linen twins give the stock
    module's bits on ``"xla"`` (its treatment of fully masked rows, its dropout
    bits and ``broadcast_dropout`` included).
    """
    args = dict(locals())  # every argument, by name, as _flax_attention takes them
    qkv = [args.pop(n) for n in ("query", "key", "value")]
    linen = _called_by_linen(module, force_fp32_for_softmax, einsum_dot_general,
                             qk_attn_weights_einsum, attn_weights_value_einsum)
    return _flax_attention(*qkv, linen=linen, **args)


def _linen_attention(query, key, value, *, mask, is_causal, **kwargs):
    """``flax.linen.dot_product_attention``, with is_causal as a mask and GQA as repeated heads."""
    if is_causal:
        T, S = query.shape[-3], key.shape[-3]
        causal = jnp.tril(jnp.ones((T, S), jnp.bool_))
        mask = causal if mask is None else jnp.logical_and(jnp.asarray(mask).astype(bool), causal)
    if key.shape[-2] != query.shape[-2] and key.shape[-2] and not query.shape[-2] % key.shape[-2]:
        groups = query.shape[-2] // key.shape[-2]
        key, value = (jnp.repeat(x, groups, axis=-2) for x in (key, value))
    return nn.dot_product_attention(query, key, value, mask=mask, **kwargs)


class _BoundAttention:
    """:func:`dot_product_attention` with ``implementation`` bound: the layers' default ``attention_fn``.

    Compared and hashed by value (module graphs and Linen fields stay equal
    across instances), and it shows :func:`dot_product_attention`'s signature
    so that Linen's keyword filtering passes it every keyword it knows.
    """

    def __init__(self, implementation: str | None):
        self.implementation = implementation
        self.__signature__ = _BOUND_SIGNATURE

    def __call__(self, *args, **kwargs):
        if self.implementation is None and platform_default() != "xla":
            # Off a CPU the op's own default: the fastest measured implementation for the call.
            return dot_product_attention(*args, implementation=None, **kwargs)

        def body(impl):
            if impl == "xla":
                return _stock_attention(*args, **kwargs)  # stock Flax, bit for bit
            return dot_product_attention(*args, implementation=impl, **kwargs)
        return run_implementation(self.implementation, "layers attention", body)

    def __eq__(self, other):
        return type(other) is _BoundAttention and other.implementation == self.implementation

    def __hash__(self):
        return hash((_BoundAttention, self.implementation))

    def __repr__(self):
        return f"layers.dot_product_attention[implementation={self.implementation!r}]"


_BOUND_SIGNATURE = inspect.signature(dot_product_attention).replace(parameters=[
    p for p in inspect.signature(dot_product_attention).parameters.values()
    if p.name != "implementation"])


class MultiHeadAttention(nnx.MultiHeadAttention):
    """Multi-head attention by flash-attention kernels: a drop-in for :class:`flax.nnx.MultiHeadAttention`.

    Every constructor argument and default (``num_heads``, ``in_features``,
    ``qkv_features``, ``out_features``, ``num_kv_heads``, ``in_kv_features``,
    ``dtype``, ``param_dtype``, ``broadcast_dropout``, ``dropout_rate``,
    ``deterministic``, ``precision``, initializers, ``use_bias``, ``decode``,
    ``normalize_qk``, promote/dot_general hooks, ``rngs``, ``keep_rngs``,
    metadata), the ``__call__`` signature (``inputs_q, inputs_k=None,
    inputs_v=None, *, mask, deterministic, rngs, sow_weights, decode,
    is_causal, out_sharding, qkv_sharding``), ``init_cache`` / ``set_view``
    and the parameter and cache tree are nnx.MultiHeadAttention's own: the
    class only changes the default ``attention_fn`` to
    :func:`dot_product_attention` with this layer's ``implementation`` bound.
    So ``MultiHeadAttention(..., rngs=nnx.Rngs(s))`` holds the same state as
    the stock layer built with the same arguments and either's state (or
    checkpoint) loads into the other. On the ``"xla"`` implementation (the CPU
    default) the attention is Flax's own ``dot_product_attention``: outputs,
    gradients and state are the stock layer's bit for bit (dropout bits and
    fully masked rows included). On the kernel implementations they agree up
    to float rounding, except where :func:`dot_product_attention` documents a
    difference: fully masked query rows give 0 (Flax: the mean of the
    values), and dropout draws different (per batch element and head) bits.
    ``sow_weights=True`` runs Flax's attention (warned once on the kernel
    implementations), since the kernel never forms the probabilities.

    Decoder options (keyword-only; all off by default, and then the layer is
    the drop-in above). With any of them set, ``__call__`` takes
    ``positions`` too and runs: projections, per-head q/k norms, rotary
    embedding of q and k, then ``ops.dot_product_attention`` with the scale,
    window and soft cap below (on every implementation, ``"xla"`` included:
    Flax's attention has none of these), then the output projection; the
    parameter tree is the stock layer's plus ``query_norm`` / ``key_norm``:

      rotary: None or a :class:`layers.RotaryEmbedding` (any callable
        ``rotary(x, positions)`` on ``[B, T, heads, head_dim]``), applied to
        the query and key heads after their projection and norms, before
        attention (Su et al. 2021, RoFormer).
      qk_norm: None or ``"rms_norm"``: a :class:`layers.RMSNorm` over the head
        dim of the queries and of the keys, ``query_norm`` and ``key_norm``
        with ``scale`` ``[head_dim]`` shared by all heads (Qwen3, Gemma 3;
        Flax's ``normalize_qk`` is a LayerNorm instead).
      qk_norm_epsilon: those norms' epsilon (1e-6).
      qk_norm_scale_offset: their scale offset (0; 1 is Gemma 3's ``1 + scale``).
      scale: the logit scale (None: ``1 / sqrt(head_dim)``; Gemma 2:
        ``query_pre_attn_scalar ** -0.5``).
      local_window_size: None, ``w`` or ``(left, right)``: query ``i`` sees
        keys ``i - left <= j <= i + right`` (with ``is_causal``, a sliding
        window of ``left + 1`` keys: Mistral's and Gemma 2's ``sliding_window
        = left + 1``).
      logits_soft_cap: None or ``c > 0``: logits ``c tanh(logits / c)``
        before masking (Gemma 2: 50).

    With these options ``mask`` must be boolean-like and broadcast to
    ``[B, heads, T, S]``, ``sow_weights`` and a custom ``attention_fn`` combined
    with ``scale`` / ``local_window_size`` / ``logits_soft_cap`` raise a
    ``ValueError``. ``decode=True`` (after nnx's ``init_cache``) uses the dense
    cache of :meth:`attend_cached`: rotated keys are cached, new tokens take
    the positions after the cached ones (or ``positions``), any number of new
    tokens per call (a prompt, then one token at a time); a paged cache or a
    split-KV decode kernel replaces that method.

    Args:
      implementation: keyword-only. None (the platform's default: "xla" on
        CPU, "triton" on GPU, resolved at call time) or a name from
        ``ops.IMPLEMENTATIONS``, validated at construction (ValueError naming
        the argument). Used by the default ``attention_fn``, the q/k norms and
        the decoder path's attention (the ``rotary`` module keeps its own); an
        explicit ``attention_fn`` is used as given.
      everything else: exactly as :class:`flax.nnx.MultiHeadAttention`.
    """

    def __init__(self, *args, implementation: str | None = None, rotary=None,
                 qk_norm: str | None = None, qk_norm_epsilon: float = 1e-6,
                 qk_norm_scale_offset: float = 0.0, scale: float | None = None,
                 local_window_size=None, logits_soft_cap: float | None = None, **kwargs):
        owner = "layers.MultiHeadAttention"
        implementation = _check_implementation(implementation, owner)
        custom_fn = "attention_fn" in kwargs
        if not custom_fn:
            kwargs["attention_fn"] = _BoundAttention(implementation)
        super().__init__(*args, **kwargs)
        self.implementation = implementation
        self.decoder_options = _check_decoder_options(
            owner, rotary=rotary, qk_norm=qk_norm, qk_norm_epsilon=qk_norm_epsilon,
            qk_norm_scale_offset=qk_norm_scale_offset, scale=scale,
            local_window_size=local_window_size, logits_soft_cap=logits_soft_cap,
            custom_fn=custom_fn)
        self.rotary = rotary
        if qk_norm is not None:
            norm = dict(epsilon=float(qk_norm_epsilon), dtype=self.dtype,
                        param_dtype=self.param_dtype, implementation=implementation,
                        rngs=kwargs["rngs"])
            if qk_norm_scale_offset:
                norm["scale_offset"] = float(qk_norm_scale_offset)
            self.query_norm = RMSNorm(self.head_dim, **norm)
            self.key_norm = RMSNorm(self.head_dim, **norm)
        else:
            self.query_norm = nnx.data(None)
            self.key_norm = nnx.data(None)

    def __call__(self, inputs_q, inputs_k=None, inputs_v=None, *, positions=None, mask=None,
                 deterministic=None, rngs=None, sow_weights=False, decode=None, is_causal=False,
                 **kwargs):
        """Attention of ``inputs_q`` over ``inputs_k`` / ``inputs_v`` (default: self-attention).

        ``positions``: int32 ``[B, T]`` or ``[T]`` positions of the queries and
        keys for the rotary embedding (None: ``0 .. T - 1``); only with the
        decoder options. Everything else as :class:`flax.nnx.MultiHeadAttention`.
        """
        if self.decoder_options is None:
            if positions is not None:
                raise ValueError("layers.MultiHeadAttention: positions= is used by the rotary "
                                 "embedding; this layer was built without rotary=.")
            return super().__call__(inputs_q, inputs_k, inputs_v, mask=mask,
                                    deterministic=deterministic, rngs=rngs,
                                    sow_weights=sow_weights, decode=decode, is_causal=is_causal,
                                    **kwargs)
        if sow_weights:
            raise ValueError("layers.MultiHeadAttention: sow_weights=True needs Flax's attention, "
                             "which has no rotary embedding, q/k RMS norm, window or soft cap.")
        decode = self.decode if decode is None else decode
        inputs_k = inputs_q if inputs_k is None else inputs_k
        inputs_v = inputs_k if inputs_v is None else inputs_v
        if inputs_q.shape[-1] != self.in_features:
            raise ValueError(f"layers.MultiHeadAttention: inputs_q has {inputs_q.shape[-1]} "
                             f"features, the layer expects in_features={self.in_features}.")
        qkv_sharding = kwargs.pop("qkv_sharding", None)
        query = self.query(inputs_q, out_sharding=qkv_sharding)
        key = self.key(inputs_k, out_sharding=qkv_sharding)
        value = self.value(inputs_v, out_sharding=qkv_sharding)
        if self.normalize_qk:
            query, key = self.query_ln(query), self.key_ln(key)
        if self.query_norm is not None:
            query, key = self.query_norm(query), self.key_norm(key)
        if decode and positions is None:  # the new tokens follow the cached ones
            if self.cache_index is None:
                raise ValueError("layers.MultiHeadAttention: decode=True needs a cache; call "
                                 "init_cache first.")
            positions = self.cache_index[...] + jnp.arange(query.shape[-3], dtype=jnp.int32)
        if self.rotary is not None:
            if positions is None:
                positions = jnp.arange(query.shape[-3], dtype=jnp.int32)
            query, key = self.rotary(query, positions), self.rotary(key, positions)
        if decode:
            out = self.attend_cached(query, key, value, positions=positions, mask=mask)
        else:
            out = self.attend(query, key, value, mask=mask, is_causal=is_causal,
                              dropout_rng=self._dropout_rng(deterministic, rngs))
        return self.out(out, out_sharding=kwargs.pop("out_sharding", None))

    def attend_cached(self, query, key, value, *, positions, mask=None):
        """Decoding with the dense cache of ``init_cache``: the new rotated keys and values
        ``[B, T, K, H]`` are written at ``cache_index`` (advanced by ``T``), and the queries
        attend over the cache, query ``i`` at position ``positions[i]`` seeing the cached keys
        at positions ``<= positions[i]`` (within the sliding window, if any). A paged cache
        replaces this method.
        """
        if self.cached_key is None or self.cached_value is None or self.cache_index is None:
            raise ValueError("layers.MultiHeadAttention: decode=True needs a cache; call "
                             "init_cache first.")
        cached_key, cached_value = self.cached_key[...], self.cached_value[...]
        start = self.cache_index[...]
        zero = jnp.zeros((), start.dtype)
        at = (zero,) * (key.ndim - 3) + (start, zero, zero)
        cached_key = lax.dynamic_update_slice(cached_key, key.astype(cached_key.dtype), at)
        cached_value = lax.dynamic_update_slice(cached_value, value.astype(cached_value.dtype), at)
        self.cached_key[...], self.cached_value[...] = cached_key, cached_value
        self.cache_index[...] = start + key.shape[-3]
        q_pos = jnp.asarray(positions, jnp.int32)[..., :, None]  # [(B,) T, 1]
        k_pos = jnp.arange(cached_key.shape[-3], dtype=jnp.int32)
        visible = k_pos <= q_pos
        window = self.decoder_options.local_window_size
        if window is not None:
            left, right = (window, window) if isinstance(window, int) else window
            visible &= (k_pos >= q_pos - left) & (k_pos <= q_pos + right)
        visible = visible[..., None, :, :] if visible.ndim == 3 else visible[None, None]
        if mask is not None:
            visible = jnp.logical_and(visible, jnp.asarray(mask).astype(jnp.bool_))
        opts = self.decoder_options
        return _flash_attention(query.astype(cached_key.dtype), cached_key, cached_value,
                                mask=visible, scale=opts.scale,
                                logits_soft_cap=opts.logits_soft_cap,
                                implementation=self.implementation)

    def attend(self, query, key, value, *, mask, is_causal, dropout_rng):
        """The decoder path's attention of projected, normed, rotated heads ``[B, T, N, H]``.

        The one place a key/value cache (dense or paged) or a split-KV decode
        kernel plugs in: it receives the new keys and values and attends over
        the cache instead.
        """
        opts = self.decoder_options
        rate = self.dropout_rate if dropout_rng is not None else 0.0
        if not isinstance(self.attention_fn, _BoundAttention):  # a user's attention_fn
            return self.attention_fn(query, key, value, mask=mask, dropout_rng=dropout_rng,
                                     dropout_rate=rate, broadcast_dropout=self.broadcast_dropout,
                                     deterministic=dropout_rng is None, dtype=self.dtype,
                                     precision=self.precision, module=None, is_causal=is_causal)
        if mask is not None:
            mask = jnp.asarray(mask).astype(jnp.bool_)
        return _flash_attention(query, key, value, mask=mask, is_causal=bool(is_causal),
                                scale=opts.scale, local_window_size=opts.local_window_size,
                                logits_soft_cap=opts.logits_soft_cap, dropout_rate=rate,
                                dropout_rng=dropout_rng, implementation=self.implementation)

    def _dropout_rng(self, deterministic, rngs):
        """nnx.MultiHeadAttention's choice of the dropout key (None: no dropout)."""
        if self.dropout_rate <= 0.0:
            return None
        deterministic = self.deterministic if deterministic is None else deterministic
        if deterministic is None:
            raise ValueError("layers.MultiHeadAttention: no deterministic= given to __call__ or "
                             "the constructor, and dropout_rate > 0.")
        if deterministic:
            return None
        stream = self.rngs if rngs is None else getattr(rngs, "dropout", rngs)
        if stream is None:
            raise ValueError("layers.MultiHeadAttention: dropout needs rngs= in __call__ (the "
                             "layer was built with keep_rngs=False).")
        return stream()


_QK_NORMS = (None, "rms_norm")


@dataclasses.dataclass(frozen=True)
class DecoderOptions:
    """The attention options of :class:`MultiHeadAttention`'s decoder path (static, hashable)."""

    scale: float | None = None
    local_window_size: int | tuple[int, int] | None = None
    logits_soft_cap: float | None = None


def _check_decoder_options(owner, *, rotary, qk_norm, qk_norm_epsilon, qk_norm_scale_offset,
                           scale, local_window_size, logits_soft_cap, custom_fn):
    """The :class:`DecoderOptions`, None when every option is off; bad values raise, naming them."""
    if rotary is not None and not callable(rotary):
        raise TypeError(f"{owner}: invalid argument rotary={rotary!r}; expected None or a "
                        "layers.RotaryEmbedding (a callable rotary(x, positions)).")
    if qk_norm not in _QK_NORMS:
        raise ValueError(f"{owner}: invalid argument qk_norm={qk_norm!r}; expected one of "
                         f"{_QK_NORMS} (Flax's LayerNorm q/k norm is normalize_qk=True).")
    for name, value in (("qk_norm_epsilon", qk_norm_epsilon),
                        ("qk_norm_scale_offset", qk_norm_scale_offset)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{owner}: invalid argument {name}={value!r}; expected a number.")
    if qk_norm_epsilon < 0:
        raise ValueError(f"{owner}: invalid argument qk_norm_epsilon={qk_norm_epsilon!r}; "
                         "expected >= 0.")
    for name, value in (("scale", scale), ("logits_soft_cap", logits_soft_cap)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)
                                  or not value > 0):
            raise ValueError(f"{owner}: invalid argument {name}={value!r}; expected None or a "
                             "number > 0.")
    if local_window_size is not None:
        sides = (local_window_size if isinstance(local_window_size, (tuple, list))
                 else (local_window_size,))
        if len(sides) not in (1, 2) or any(isinstance(w, bool) or not isinstance(w, int) or w < 0
                                           for w in sides):
            raise ValueError(f"{owner}: invalid argument local_window_size={local_window_size!r};"
                             " expected None, an int w >= 0 or a pair (left, right) of them.")
        local_window_size = tuple(local_window_size) if len(sides) == 2 else local_window_size
    kernel_only = {"scale": scale, "local_window_size": local_window_size,
                   "logits_soft_cap": logits_soft_cap}
    if custom_fn and any(v is not None for v in kernel_only.values()):
        raise ValueError(f"{owner}: scale, local_window_size and logits_soft_cap are options of "
                         "the layer's own attention; a custom attention_fn cannot take them.")
    if rotary is None and qk_norm is None and all(v is None for v in kernel_only.values()):
        return None
    return DecoderOptions(scale=None if scale is None else float(scale),
                          local_window_size=local_window_size,
                          logits_soft_cap=None if logits_soft_cap is None else float(logits_soft_cap))


_DECODER_KEYWORDS = (("rotary", None), ("qk_norm", None), ("qk_norm_epsilon", 1e-6),
                     ("qk_norm_scale_offset", 0.0), ("scale", None), ("local_window_size", None),
                     ("logits_soft_cap", None))


def _signature_with_implementation(parent, extras=()):
    """``parent.__init__``'s signature plus ``implementation=None`` and ``extras`` (name,
    default) as keyword-only arguments, our attention_fn as default."""
    base = inspect.signature(parent.__init__)
    params = []
    for p in base.parameters.values():
        if p.name == "attention_fn":
            p = p.replace(default=dot_product_attention)
        params.append(p)
    extra = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default)
             for name, default in (("implementation", None), *extras)]
    first_kw = next((i for i, p in enumerate(params) if p.kind == p.KEYWORD_ONLY), len(params))
    return base.replace(parameters=params[:first_kw] + extra + params[first_kw:])


try:
    MultiHeadAttention.__init__.__signature__ = _signature_with_implementation(
        nnx.MultiHeadAttention, _DECODER_KEYWORDS)
except (TypeError, ValueError):  # an unexpected Flax signature: keep the plain one
    pass
