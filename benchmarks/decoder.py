"""Llama 3, Mistral, Qwen3, Gemma 2 and Mixtral through our layers, checked against transformers.

Run as ``python -m benchmarks.decoder`` (``pip install -e ".[models]"``:
transformers and torch; nothing is downloaded, every model is built from a
tiny config with seeded random weights).

What it does, per family:

1. Reference. The transformers model (``LlamaForCausalLM``,
   ``MistralForCausalLM``, ``Qwen3ForCausalLM``, ``Gemma2ForCausalLM``,
   ``MixtralForCausalLM``: 4 experts, top-2, router loss coefficient 0.1) from a
   tiny config (:func:`tiny_hf_config`: width 64, 2 layers, 4 query heads of
   16 over 2 key/value heads, MLP width 128, 256 tokens), eager attention,
   float32 on the CPU. Its weights are redrawn from a seeded generator
   (:func:`randomize_`): embeddings ``N(0, 1)``, every projection ``N(0,
   1 / fan_in)`` (query and key projections three times that standard
   deviation, so that attention logits reach Gemma 2's soft cap), norm
   scales ``1 + N(0, 0.1)`` (Gemma: ``N(0, 0.1)``, its ``1 + scale``):
   transformers' own initialisation (``std = 0.02``) leaves the logits so
   small that the caps, norms and scalings would hardly matter.
2. Mapping. :func:`config_from_hf` turns a transformers config into our
   :class:`DecoderConfig` and one function per family (``llama3_params``,
   ``mistral_params``, ``qwen3_params``, ``gemma2_params``, ``mixtral_params``;
   :data:`MAPPERS`)
   turns its state dict (numpy arrays by transformers' names) into our
   parameter tree, with transposes and reshapes only. The same two calls load
   a real checkpoint of that family (``safetensors.numpy.load_file`` of its
   shards, its ``config.json`` through ``transformers.AutoConfig``).
3. Model. One decoder, :class:`Decoder`, written once from ``layers`` and
   ``ops``: ``nnx.Embed`` (scaled by ``sqrt(width)`` for Gemma), per layer a
   pre-norm ``layers.RMSNorm`` fused with the residual add (``norm(delta,
   residual=stream)`` returns the normalised sum and the sum, one kernel),
   ``layers.MultiHeadAttention`` with its decoder options (rotary embedding
   with the config's rope scaling, grouped-query heads, causal, sliding
   window on the layers the config names, q/k RMS norms for Qwen3, logit
   soft cap and ``query_pre_attn_scalar`` for Gemma 2), Gemma 2's post-norms,
   ``layers.GatedMLP`` (SwiGLU, or GeGLU with the tanh gelu for Gemma), a
   final norm, the head (tied to the embedding or not) with Gemma 2's final
   logit soft cap, and the loss through ``ops.linear_cross_entropy``
   (``ignore_index=-100``, mean over the labelled positions, the final soft
   cap inside), so the ``[tokens, vocab]`` logits are never formed for it.
4. Data. Byte tokens (vocabulary 256, no tokenizer: a byte is a token) of
   the Python standard library's sources, the text ``benchmarks/lm.py``
   trains on; sequences are random windows of it. Labels are the inputs with
   a seeded quarter of the positions set to -100 (ignored), shifted inside
   the loss as transformers' ``ForCausalLMLoss`` does.
5. Checks, on every implementation asked (``xla``: every op's XLA
   reference; ``interpret``: our kernels in our Pallas interpreter;
   ``triton``: our generated Triton code in Triton's CPU interpreter, with
   fewer tokens, ``--tokens-for triton=N``):

   * logits: ``max |ours - theirs| / max |theirs| <= 1e-4`` in float32;
     in bfloat16 (our weights and activations in bfloat16 against
     transformers in float32) at most twice the error of transformers' own
     bfloat16 run against its float32 run (or 1e-2, if larger): bfloat16's
     8-bit mantissa makes both about 1e-2 to 1e-1 of the scale here, so the
     bound is relative to what the same weights cost transformers;
   * the loss with ignored positions: ``|ours - theirs| <= 1e-5 * theirs``
     (Mixtral: plus the router's load-balancing loss times its coefficient,
     transformers' ``output_router_logits=True`` loss, and the load-balancing
     loss itself within the same bound);
   * the gradient of every parameter against torch autograd of the same
     loss: per parameter ``max |ours - theirs| / max |theirs| <=``
     :data:`GRAD_TOL`;
   * greedy generation (``--generate-tokens``, 32): two 16-byte prompts
     through :meth:`Decoder.generate` (dense key/value caches of rotated keys,
     the prompt in one call, then one token per call) must give exactly the
     greedy sequence of transformers' full forward pass (each token the
     argmax of its logits on the whole sequence so far). transformers' own
     ``generate(do_sample=False)`` (its cache, no end-of-sequence token) is
     reported beside it and agrees for every family. (``generate`` fills a
     ``None`` of the config it is given from the model's own generation config,
     whose ``eos_token_id`` is 2, a byte here: the model's is cleared for the
     call, else it stops at byte 2, as Mistral's and Mixtral's sequences did.)

6. Training (``--train-steps`` > 0, models of ``--train-models``): the model
   mapped from transformers' own initialisation (it starts near ln 256 nats,
   as a real pre-training run) trained twice with AdamW on the same batches of
   real text, with our kernels (``--train-implementation``, default
   ``interpret``) and with the XLA references (``implementation="xla"``, the
   stock-XLA model); the curves must stay within ``--train-tolerance`` of each
   other at every step (as ``benchmarks/lm.py``: the runs differ only in float32
   rounding, which training slowly amplifies; a wrong gradient moves a curve
   by tenths within a few steps) and both runs must lower the loss by
   ``--min-improvement`` nats (the default run goes from 5.6 to about 2.7,
   below the corpus's unigram entropy of about 3.15: the model uses context).

Results: a table on the terminal, ``decoder.json`` and ``decoder.md`` in
``--out-dir`` (default ``benchmarks/results/latest/``, ignored by git). Exit
status 1 if any check fails.

Extension points, for what is not built here:

* Other MLPs: :class:`Decoder` takes ``mlp_factory(cfg, layer, *, dtype,
  param_dtype, implementation, rngs) -> module``; the default builds
  ``layers.GatedMLP``, or ``layers.MoE`` when the config has experts
  (Mixtral: the router and experts' parameters under ``layers.<i>.mlp``).
  The block calls ``mlp(h)`` only; an MoE sows its router statistics, which
  :meth:`Decoder.router_aux_loss` collects.
* Paged caches: decoding goes through
  ``layers.MultiHeadAttention.attend_cached`` (the dense cache of nnx's
  ``init_cache``: rotated keys written at the cache index, queries masked by
  position and window); a paged cache replaces that one method (pages
  written with ``ops.update_kv_pages``, attention by ``ops.paged_attention``),
  and :meth:`Decoder.generate` stays as it is.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import json
import math
import os
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import layers
import ops
from benchmarks.lm import load_corpus, sample_batches

FAMILIES = ("llama3", "mistral", "qwen3", "gemma2", "mixtral")
IGNORE_INDEX = -100  # transformers' ignored label
VOCAB = 256  # byte tokens
LOGITS_TOL = 1e-4  # float32: max |ours - theirs| / max |theirs|
# bfloat16 (our weights and activations) against transformers in float32: at most
# BF16_FACTOR times the error of transformers' own bfloat16 run, or BF16_FLOOR.
BF16_FACTOR, BF16_FLOOR = 2.0, 1e-2
LOSS_RTOL = 1e-5
GRAD_TOL = 1e-3  # float32: per parameter, max |ours - theirs| / max |theirs|
BF16_LOSS_RTOL = 2e-2


# --------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Everything that differs between the families (static, hashable).

    ``layer_types`` names each layer's attention, ``"full_attention"`` or
    ``"sliding_attention"`` (a causal window of ``sliding_window`` keys, the
    query's own included), as transformers' configs do. ``rope_scaling`` is
    the rope type and parameters as sorted ``(name, value)`` items.
    """

    family: str
    vocab_size: int
    width: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mlp_width: int
    activation: str = "silu"
    norm_eps: float = 1e-6
    norm_offset: float = 0.0  # Gemma: 1.0, its (1 + scale)
    post_norms: bool = False  # Gemma 2: norms on the attention and MLP outputs too
    qk_norm: bool = False  # Qwen3: RMS norms over each query and key head
    rope_theta: float = 10000.0
    rope_scaling: tuple | None = None
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    attn_soft_cap: float | None = None
    final_soft_cap: float | None = None
    query_pre_attn_scalar: float | None = None
    scale_embeddings: bool = False  # Gemma: embeddings times sqrt(width)
    tie_embeddings: bool = False
    num_experts: int = 0  # Mixtral: an MoE MLP (layers.MoE) of this many experts
    experts_per_token: int = 0
    router_aux_loss_coef: float = 0.0

    def window(self, layer: int):
        """``local_window_size`` of a layer: ``(sliding_window - 1, 0)`` or None."""
        if self.layer_types[layer] == "sliding_attention" and self.sliding_window is not None:
            return (self.sliding_window - 1, 0)
        return None


def _rope(hf) -> tuple[float, tuple | None]:
    params = dict(getattr(hf, "rope_parameters", None) or {})
    theta = float(params.pop("rope_theta", getattr(hf, "rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    scaling = None if kind == "default" else tuple(sorted(params.items()))
    return theta, scaling


def _common(family: str, hf) -> dict:
    theta, scaling = _rope(hf)
    n = hf.num_hidden_layers
    return dict(family=family, vocab_size=hf.vocab_size, width=hf.hidden_size, num_layers=n,
                num_heads=hf.num_attention_heads, num_kv_heads=hf.num_key_value_heads,
                head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
                mlp_width=hf.intermediate_size, norm_eps=float(hf.rms_norm_eps),
                rope_theta=theta, rope_scaling=scaling,
                layer_types=tuple(getattr(hf, "layer_types", None) or ("full_attention",) * n),
                tie_embeddings=bool(hf.tie_word_embeddings))


def _check_supported(hf, family: str) -> None:
    for flag in ("attention_bias", "mlp_bias"):
        if getattr(hf, flag, False):
            raise ValueError(f"{family}: {flag}=True is not built here")
    act = getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", "silu")
    if act not in ("silu", "gelu_pytorch_tanh"):
        raise ValueError(f"{family}: activation {act!r} is not built here")


def config_from_hf(family: str, hf) -> DecoderConfig:
    """Our :class:`DecoderConfig` from a transformers config of ``family``."""
    _check_supported(hf, family)
    c = _common(family, hf)
    if family == "llama3":
        return DecoderConfig(**c)
    if family in ("mistral", "mixtral"):
        window = getattr(hf, "sliding_window", None)
        types = ("sliding_attention",) * c["num_layers"] if window else c["layer_types"]
        moe = {} if family == "mistral" else dict(
            num_experts=hf.num_local_experts, experts_per_token=hf.num_experts_per_tok,
            router_aux_loss_coef=float(hf.router_aux_loss_coef))
        return DecoderConfig(**{**c, "layer_types": types}, sliding_window=window, **moe)
    if family == "qwen3":
        window = hf.sliding_window if getattr(hf, "use_sliding_window", False) else None
        return DecoderConfig(**c, qk_norm=True, sliding_window=window)
    if family == "gemma2":
        return DecoderConfig(**c, activation="gelu", norm_offset=1.0, post_norms=True,
                             sliding_window=hf.sliding_window,
                             attn_soft_cap=hf.attn_logit_softcapping,
                             final_soft_cap=hf.final_logit_softcapping,
                             query_pre_attn_scalar=float(hf.query_pre_attn_scalar),
                             scale_embeddings=True)
    raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")


# --------------------------------------------------------------------------
# Model: one decoder from layers / ops
# --------------------------------------------------------------------------

def default_mlp(cfg: DecoderConfig, layer: int, *, dtype, param_dtype, implementation, rngs):
    """The families' gated MLP (SwiGLU / GeGLU), or Mixtral's ``layers.MoE``; the
    ``mlp_factory`` default."""
    del layer
    if cfg.num_experts:
        return layers.MoE(cfg.width, cfg.mlp_width, cfg.num_experts, cfg.experts_per_token,
                          activation=cfg.activation, dtype=dtype, param_dtype=param_dtype,
                          implementation=implementation, rngs=rngs)
    return layers.GatedMLP(cfg.width, cfg.mlp_width, activation=cfg.activation, dtype=dtype,
                           param_dtype=param_dtype, implementation=implementation, rngs=rngs)


class Block(nnx.Module):
    """One decoder layer: ``(delta, stream) -> (delta', stream')`` on the residual stream.

    The residual add of the previous sub-block is fused into this one's
    pre-norm: ``h, stream = norm(delta, residual=stream)``.
    """

    def __init__(self, cfg: DecoderConfig, layer: int, *, dtype, param_dtype, implementation,
                 mlp_factory: Callable, rngs: nnx.Rngs):
        common = dict(dtype=dtype, param_dtype=param_dtype, implementation=implementation)
        norm = lambda: _norm(cfg, rngs=rngs, **common)  # noqa: E731
        self.attn_norm = norm()
        rotary = layers.RotaryEmbedding(cfg.head_dim, theta=cfg.rope_theta,
                                        scaling=dict(cfg.rope_scaling or ()) or None,
                                        implementation=implementation)
        scale = (None if cfg.query_pre_attn_scalar is None
                 else cfg.query_pre_attn_scalar ** -0.5)
        self.attn = layers.MultiHeadAttention(
            cfg.num_heads, cfg.width, qkv_features=cfg.num_heads * cfg.head_dim,
            out_features=cfg.width, num_kv_heads=cfg.num_kv_heads, use_bias=False, decode=False,
            keep_rngs=False, deterministic=True, rotary=rotary,
            qk_norm="rms_norm" if cfg.qk_norm else None, qk_norm_epsilon=cfg.norm_eps,
            scale=scale, local_window_size=cfg.window(layer), logits_soft_cap=cfg.attn_soft_cap,
            rngs=rngs, **common)
        self.post_attn_norm = norm() if cfg.post_norms else nnx.data(None)
        self.mlp_norm = norm()
        self.mlp = mlp_factory(cfg, layer, rngs=rngs, **common)
        self.post_mlp_norm = norm() if cfg.post_norms else nnx.data(None)

    def __call__(self, delta, stream, positions, decode=False):
        h, stream = _add_norm(self.attn_norm, delta, stream)
        a = self.attn(h, positions=positions, is_causal=True, decode=decode)
        if self.post_attn_norm is not None:
            a = self.post_attn_norm(a)
        h, stream = _add_norm(self.mlp_norm, a, stream)
        m = self.mlp(h)
        if self.post_mlp_norm is not None:
            m = self.post_mlp_norm(m)
        return m, stream


def _norm(cfg: DecoderConfig, **kwargs):
    extra = {"scale_offset": cfg.norm_offset} if cfg.norm_offset else {}
    return layers.RMSNorm(cfg.width, epsilon=cfg.norm_eps, **extra, **kwargs)


def _add_norm(norm, delta, stream):
    """``(norm(delta + stream), delta + stream)`` in one kernel; the first layer has no stream."""
    if stream is None:
        return norm(delta), delta
    return norm(delta, residual=stream)


class Decoder(nnx.Module):
    """A decoder-only LM of any of the families: ``tokens [B, T]`` -> logits ``[B, T, V]``.

    Args:
      cfg: the family's :class:`DecoderConfig` (:func:`config_from_hf`).
      dtype: the compute dtype (None: the parameters').
      param_dtype: the parameters' dtype.
      implementation: every layer's and op's ``implementation=``.
      mlp_factory: builds each layer's MLP (default :func:`default_mlp`), the
        hook for a mixture of experts.
      rngs: parameter initialisation (a checkpoint replaces it).
    """

    def __init__(self, cfg: DecoderConfig, *, dtype=None, param_dtype=jnp.float32,
                 implementation=None, mlp_factory: Callable | None = None,
                 rngs: nnx.Rngs):
        self.cfg, self.implementation = cfg, implementation
        self.dtype = dtype
        self.embed = nnx.Embed(cfg.vocab_size, cfg.width, dtype=dtype, param_dtype=param_dtype,
                               rngs=rngs)
        self.layers = nnx.List([
            Block(cfg, i, dtype=dtype, param_dtype=param_dtype, implementation=implementation,
                  mlp_factory=mlp_factory or default_mlp, rngs=rngs)
            for i in range(cfg.num_layers)])
        self.final_norm = _norm(cfg, dtype=dtype, param_dtype=param_dtype,
                                implementation=implementation, rngs=rngs)
        self.lm_head = (nnx.data(None) if cfg.tie_embeddings else
                        layers.Dense(cfg.width, cfg.vocab_size, use_bias=False, dtype=dtype,
                                     param_dtype=param_dtype, implementation=implementation,
                                     rngs=rngs))

    def hidden_states(self, tokens, positions=None, *, decode: bool = False):
        """The final-normed hidden states ``[B, T, width]`` of ``tokens [B, T]``.

        ``positions``: int32 ``[B, T]`` or ``[T]`` (None: ``0 .. T - 1``, or with
        ``decode`` the positions after the cached tokens). ``decode``: attend over and
        extend the key/value caches of :meth:`init_cache`.
        """
        if positions is None and not decode:
            positions = jnp.arange(tokens.shape[-1], dtype=jnp.int32)
        x = self.embed(tokens)
        if self.cfg.scale_embeddings:  # Gemma: the normaliser rounded to the activations' dtype
            x = x * jnp.asarray(math.sqrt(self.cfg.width), x.dtype)
        delta, stream = x, None
        for block in self.layers:
            delta, stream = block(delta, stream, positions, decode)
        h, _ = _add_norm(self.final_norm, delta, stream)
        return h

    def init_cache(self, batch: int, max_length: int, dtype=None):
        """Empty dense key/value caches of ``max_length`` positions in every layer."""
        dtype = dtype or self.dtype or self.embed.embedding.dtype
        for block in self.layers:
            block.attn.init_cache((batch, max_length, self.cfg.width), dtype=dtype)

    def generate(self, prompt, steps: int):
        """Greedy decoding: ``prompt [B, P]`` int32 -> the ``[B, steps]`` next tokens.

        The prompt fills fresh caches in one call, then each step feeds the last token
        (each call jitted once per shape).
        """
        self.init_cache(prompt.shape[0], prompt.shape[1] + steps)

        @nnx.jit
        def step(model, tokens):
            logits = model.logits(model.hidden_states(tokens, decode=True)[:, -1])
            nnx.pop(model, nnx.Intermediate)  # an MoE's router statistics
            return jnp.argmax(logits.astype(jnp.float32), axis=-1).astype(jnp.int32)

        token, out = step(self, jnp.asarray(prompt, jnp.int32)), []
        for _ in range(steps):
            out.append(token)
            if len(out) < steps:
                token = step(self, token[:, None])
        return jnp.stack(out, axis=1)

    def head(self):
        """The unembedding ``[width, V]`` in the compute dtype."""
        w = self.embed.embedding[...].T if self.lm_head is None else self.lm_head.kernel[...]
        return w if self.dtype is None else w.astype(self.dtype)

    def logits(self, hidden):
        """``[..., width]`` -> ``[..., V]``, Gemma 2's final soft cap applied (in float32)."""
        w = self.head()
        y = ops.fused_matmul(hidden.astype(w.dtype), w, implementation=self.implementation)
        cap = self.cfg.final_soft_cap
        if cap is not None:
            y = (cap * jnp.tanh(y.astype(jnp.float32) / cap)).astype(y.dtype)
        return y

    def __call__(self, tokens, positions=None):
        return self.logits(self.hidden_states(tokens, positions))

    def loss(self, tokens, labels):
        """transformers' causal-LM loss: mean next-token cross-entropy over labels != -100.

        ``labels [B, T]`` are aligned with ``tokens`` (position ``t`` predicts
        ``labels[t + 1]``); computed by ``ops.linear_cross_entropy`` in float32. With
        experts, plus ``router_aux_loss_coef`` times :meth:`router_aux_loss`.
        """
        h = self.hidden_states(tokens)
        return self.loss_of_hidden(h, labels, self.router_aux_loss())

    def router_aux_loss(self):
        """The load-balancing loss of the MoE layers' router statistics sown by the last
        :meth:`hidden_states` (popped), pooled over the layers as transformers does; 0.0
        without experts."""
        stats = layers.moe.collect_router_stats(nnx.pop(self, nnx.Intermediate))
        return layers.moe.load_balancing_loss(stats) if stats else jnp.float32(0.0)

    def loss_of_hidden(self, h, labels, aux_loss=0.0):
        """:meth:`loss` from the hidden states ``[B, T, width]`` of :meth:`hidden_states` (and
        the :meth:`router_aux_loss` of that call)."""
        targets = jnp.concatenate(
            [labels[:, 1:], jnp.full((labels.shape[0], 1), IGNORE_INDEX, labels.dtype)], axis=1)
        w = self.head()
        loss = ops.linear_cross_entropy(h.astype(w.dtype), w, targets, ignore_index=IGNORE_INDEX,
                                        logits_soft_cap=self.cfg.final_soft_cap, reduction="mean",
                                        implementation=self.implementation)
        return loss + self.cfg.router_aux_loss_coef * aux_loss if self.cfg.num_experts else loss


def build_decoder(cfg: DecoderConfig, params: Mapping, *, implementation=None,
                  dtype=jnp.float32) -> Decoder:
    """A :class:`Decoder` holding ``params`` (a pure dict, e.g. from :data:`MAPPERS`), cast to
    ``dtype`` (weights and compute)."""
    model = nnx.eval_shape(lambda: Decoder(cfg, dtype=dtype, param_dtype=dtype,
                                           implementation=implementation, rngs=nnx.Rngs(0)))
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, jax.tree.map(lambda a: jnp.asarray(a, dtype), params))
    nnx.update(model, state)
    return model


# --------------------------------------------------------------------------
# transformers state dicts -> our parameter tree, one function per family
# --------------------------------------------------------------------------

def _attention(sd, p: str, cfg: DecoderConfig) -> dict:
    """q/k/v ``[heads * head_dim, width]`` -> ``[width, heads, head_dim]``; o -> ``[heads, head_dim, width]``."""
    d, n, k, h = cfg.width, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    return {"query": {"kernel": sd[f"{p}.q_proj.weight"].T.reshape(d, n, h)},
            "key": {"kernel": sd[f"{p}.k_proj.weight"].T.reshape(d, k, h)},
            "value": {"kernel": sd[f"{p}.v_proj.weight"].T.reshape(d, k, h)},
            "out": {"kernel": sd[f"{p}.o_proj.weight"].T.reshape(n, h, d)}}


def _mlp(sd, p: str) -> dict:
    return {name: {"kernel": sd[f"{p}.{name}.weight"].T}
            for name in ("gate_proj", "up_proj", "down_proj")}


def _model(sd, cfg: DecoderConfig, layer_fn) -> dict:
    params = {"embed": {"embedding": sd["model.embed_tokens.weight"]},
              "layers": {i: layer_fn(sd, f"model.layers.{i}") for i in range(cfg.num_layers)},
              "final_norm": {"scale": sd["model.norm.weight"]}}
    if not cfg.tie_embeddings:
        params["lm_head"] = {"kernel": sd["lm_head.weight"].T}
    return params


def llama3_params(sd: Mapping[str, np.ndarray], cfg: DecoderConfig) -> dict:
    """A ``LlamaForCausalLM`` state dict as our parameter tree."""
    def layer(sd, p):
        return {"attn_norm": {"scale": sd[f"{p}.input_layernorm.weight"]},
                "attn": _attention(sd, f"{p}.self_attn", cfg),
                "mlp_norm": {"scale": sd[f"{p}.post_attention_layernorm.weight"]},
                "mlp": _mlp(sd, f"{p}.mlp")}
    return _model(sd, cfg, layer)


def mistral_params(sd: Mapping[str, np.ndarray], cfg: DecoderConfig) -> dict:
    """A ``MistralForCausalLM`` state dict (Llama's names and layouts) as our parameter tree."""
    return llama3_params(sd, cfg)


def qwen3_params(sd: Mapping[str, np.ndarray], cfg: DecoderConfig) -> dict:
    """A ``Qwen3ForCausalLM`` state dict: Llama's plus the per-head q/k norms."""
    params = llama3_params(sd, cfg)
    for i, layer in params["layers"].items():
        p = f"model.layers.{i}.self_attn"
        layer["attn"]["query_norm"] = {"scale": sd[f"{p}.q_norm.weight"]}
        layer["attn"]["key_norm"] = {"scale": sd[f"{p}.k_norm.weight"]}
    return params


def gemma2_params(sd: Mapping[str, np.ndarray], cfg: DecoderConfig) -> dict:
    """A ``Gemma2ForCausalLM`` state dict: four norms per layer (its ``post_attention_layernorm``
    normalises the attention output; ``pre_feedforward_layernorm`` is the MLP's pre-norm)."""
    def layer(sd, p):
        return {"attn_norm": {"scale": sd[f"{p}.input_layernorm.weight"]},
                "attn": _attention(sd, f"{p}.self_attn", cfg),
                "post_attn_norm": {"scale": sd[f"{p}.post_attention_layernorm.weight"]},
                "mlp_norm": {"scale": sd[f"{p}.pre_feedforward_layernorm.weight"]},
                "mlp": _mlp(sd, f"{p}.mlp"),
                "post_mlp_norm": {"scale": sd[f"{p}.post_feedforward_layernorm.weight"]}}
    return _model(sd, cfg, layer)


def mixtral_params(sd: Mapping[str, np.ndarray], cfg: DecoderConfig) -> dict:
    """A ``MixtralForCausalLM`` state dict: Mistral's with the MoE block as ``layers.MoE``
    (router ``gate.weight [E, d]`` transposed; ``experts.gate_up_proj [E, 2h, d]`` and
    ``experts.down_proj [E, d, h]`` transposed in their last two axes)."""
    def layer(sd, p):
        moe = f"{p}.mlp"
        return {"attn_norm": {"scale": sd[f"{p}.input_layernorm.weight"]},
                "attn": _attention(sd, f"{p}.self_attn", cfg),
                "mlp_norm": {"scale": sd[f"{p}.post_attention_layernorm.weight"]},
                "mlp": {"router": {"kernel": sd[f"{moe}.gate.weight"].T},
                        "gate_up_proj": sd[f"{moe}.experts.gate_up_proj"].transpose(0, 2, 1),
                        "down_proj": sd[f"{moe}.experts.down_proj"].transpose(0, 2, 1)}}
    return _model(sd, cfg, layer)


MAPPERS: dict[str, Callable[[Mapping[str, np.ndarray], DecoderConfig], dict]] = {
    "llama3": llama3_params, "mistral": mistral_params, "qwen3": qwen3_params,
    "gemma2": gemma2_params, "mixtral": mixtral_params}


# --------------------------------------------------------------------------
# transformers reference
# --------------------------------------------------------------------------

def tiny_hf_config(family: str, *, tie: bool | None = None, window: int = 8):
    """A tiny transformers config of ``family`` (see the module docstring)."""
    import transformers
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=512, rms_norm_eps=1e-6, attn_implementation="eager")
    if tie is not None:
        common["tie_word_embeddings"] = tie
    if family == "llama3":
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
        return transformers.LlamaConfig(**{**common, "max_position_embeddings": 131072},
                                        rope_parameters=rope)
    if family == "mistral":
        return transformers.MistralConfig(**common, sliding_window=window,
                                          rope_parameters={"rope_type": "default",
                                                           "rope_theta": 1e6})
    if family == "qwen3":
        return transformers.Qwen3Config(**common, rope_parameters={"rope_type": "default",
                                                                   "rope_theta": 1e6})
    if family == "gemma2":
        return transformers.Gemma2Config(
            **common, sliding_window=window, query_pre_attn_scalar=16,
            attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
            hidden_activation="gelu_pytorch_tanh",
            layer_types=["sliding_attention", "full_attention"])
    if family == "mixtral":
        return transformers.MixtralConfig(**common, sliding_window=window, num_local_experts=4,
                                          num_experts_per_tok=2, router_aux_loss_coef=0.1,
                                          rope_parameters={"rope_type": "default",
                                                           "rope_theta": 1e6})
    raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")


def hf_model(family: str, hf_config, seed: int, *, randomize: bool = True):
    """The transformers causal LM of ``family`` in float32, its weights :func:`randomize_`'d
    (else transformers' own initialisation from ``seed``)."""
    import torch
    import transformers
    cls = {"llama3": transformers.LlamaForCausalLM, "mistral": transformers.MistralForCausalLM,
           "qwen3": transformers.Qwen3ForCausalLM, "gemma2": transformers.Gemma2ForCausalLM,
           "mixtral": transformers.MixtralForCausalLM}[family]
    torch.manual_seed(seed)
    model = cls(hf_config).float().eval()
    if randomize:
        randomize_(model, seed, offset_norms=family == "gemma2")
    return model


def randomize_(model, seed: int, *, offset_norms: bool, qk_gain: float = 3.0) -> None:
    """Redraws every parameter (see the module docstring for the distributions)."""
    import torch
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:  # a norm's scale
                base = 0.0 if offset_norms else 1.0
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                std = 1.0 / math.sqrt(p.shape[-1])  # fan_in (experts: [E, out, in])
                if name.endswith(("q_proj.weight", "k_proj.weight")):
                    std *= qk_gain
                p.copy_(std * torch.randn(p.shape, generator=g))


def hf_state(model) -> dict[str, np.ndarray]:
    """The state dict as float32 numpy arrays (what a safetensors checkpoint gives)."""
    return {k: v.detach().float().numpy() for k, v in model.state_dict().items()}


def hf_reference(model, tokens: np.ndarray, labels: np.ndarray, *, dtype: str = "float32"):
    """transformers' logits, loss and parameter gradients (by state-dict name) in float32, and
    the router's load-balancing loss (None without experts; the loss includes it times
    ``router_aux_loss_coef``)."""
    import torch
    if dtype == "bfloat16":
        model = _copy_to(model, torch.bfloat16)
    model.zero_grad(set_to_none=True)
    moe = {"output_router_logits": True} if getattr(model.config, "num_local_experts", 0) else {}
    out = model(input_ids=torch.from_numpy(tokens).long(), labels=torch.from_numpy(labels).long(),
                **moe)
    out.loss.backward()
    grads = {name: p.grad.detach().float().numpy() for name, p in model.named_parameters()}
    logits = out.logits.detach().float().numpy()
    model.zero_grad(set_to_none=True)
    aux = None if out.get("aux_loss") is None else float(out.aux_loss.detach())
    return logits, float(out.loss.detach()), grads, aux


def _copy_to(model, dtype):
    return copy.deepcopy(model).to(dtype)


# --------------------------------------------------------------------------
# Our side
# --------------------------------------------------------------------------

def ours(model: Decoder, tokens: np.ndarray, labels: np.ndarray):
    """Our logits (float32 numpy), loss, gradients (pure dict of float32 numpy) and router
    load-balancing loss (0.0 without experts)."""
    graphdef, params = nnx.split(model, nnx.Param)

    def loss_and_logits(params, tokens, labels):
        m = nnx.merge(graphdef, params)
        h = m.hidden_states(tokens)  # one trace of the model serves both
        aux = m.router_aux_loss()
        return m.loss_of_hidden(h, labels, aux), (m.logits(h), aux)

    run = jax.jit(jax.value_and_grad(loss_and_logits, has_aux=True))
    (loss, (logits, aux)), grads = run(params, jnp.asarray(tokens), jnp.asarray(labels))
    grads = jax.tree.map(lambda g: np.asarray(g, np.float32), grads.to_pure_dict())
    return np.asarray(logits, np.float32), float(loss), grads, float(aux)


def relative_error(ours_: np.ndarray, theirs: np.ndarray) -> float:
    """``max |ours - theirs| / max |theirs|`` in float64."""
    theirs = np.asarray(theirs, np.float64)
    scale = float(np.max(np.abs(theirs))) or 1.0
    return float(np.max(np.abs(np.asarray(ours_, np.float64) - theirs))) / scale


def grad_errors(ours_: dict, theirs: dict) -> dict[str, float]:
    """Per parameter (our tree path), the relative error of our gradient."""
    flat_o = dict(jax.tree_util.tree_leaves_with_path(ours_))
    errors = {}
    for path, ref in jax.tree_util.tree_leaves_with_path(theirs):
        errors[jax.tree_util.keystr(path)] = relative_error(flat_o[path], ref)
    return errors


# --------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------

def text_batch(data: np.ndarray, batch: int, length: int, seed: int):
    """``(tokens, labels)`` ``[batch, length]``: byte windows of real text, labels the tokens
    with a seeded quarter of them -100."""
    rng = np.random.default_rng(seed)
    windows = sample_batches(data, 1, batch, length - 1, rng)[0]
    labels = windows.copy()
    labels[rng.random(labels.shape) < 0.25] = IGNORE_INDEX
    return windows, labels


# --------------------------------------------------------------------------
# One family
# --------------------------------------------------------------------------

def check_family(name: str, family: str, hf_config, data: np.ndarray, args) -> dict:
    """Every comparison of one family (see the module docstring); a dict of rows and failures."""
    model = hf_model(family, hf_config, args.seed)
    cfg = config_from_hf(family, model.config)
    sd = hf_state(model)
    params = MAPPERS[family](sd, cfg)
    rows, failures = [], []
    for impl in args.implementations:
        tokens_n = args.tokens_for.get(impl, args.tokens)
        batch = max(1, tokens_n // args.seq_len)
        length = min(args.seq_len, tokens_n)
        tokens, labels = text_batch(data, batch, length, args.seed)
        ref_logits, ref_loss, ref_grads, ref_aux = hf_reference(model, tokens, labels)
        ref_tree = MAPPERS[family]({**sd, **ref_grads}, cfg)  # gradients in our layout
        for dtype in args.dtypes:
            start = time.perf_counter()
            m = build_decoder(cfg, params, implementation=impl, dtype=jnp.dtype(dtype))
            logits, loss, grads, aux = ours(m, tokens, labels)
            seconds = time.perf_counter() - start
            row = {"model": name, "family": family, "implementation": impl, "dtype": dtype,
                   "tokens": int(tokens.size), "shape": list(tokens.shape),
                   "labelled": int(np.sum(labels[:, 1:] != IGNORE_INDEX)),
                   "max_abs_logit": float(np.max(np.abs(ref_logits))),
                   "logits_rel_err": relative_error(logits, ref_logits),
                   "loss": loss, "ref_loss": ref_loss,
                   "loss_rel_err": abs(loss - ref_loss) / abs(ref_loss), "seconds": seconds}
            if ref_aux is not None:
                row.update(aux_loss=aux, ref_aux_loss=ref_aux,
                           aux_rel_err=abs(aux - ref_aux) / abs(ref_aux))
                _expect(failures, row, "aux_rel_err",
                        LOSS_RTOL if dtype == "float32" else BF16_LOSS_RTOL)
            if dtype == "float32":
                errs = grad_errors(grads, ref_tree)
                worst = max(errs, key=errs.get)
                row.update(grad_rel_err=errs[worst], grad_worst=worst, grads_checked=len(errs))
                _expect(failures, row, "logits_rel_err", LOGITS_TOL)
                _expect(failures, row, "loss_rel_err", LOSS_RTOL)
                _expect(failures, row, "grad_rel_err", GRAD_TOL)
            else:
                ref_bf16, ref_bf16_loss, _, _ = hf_reference(model, tokens, labels, dtype=dtype)
                row["ref_bf16_logits_rel_err"] = relative_error(ref_bf16, ref_logits)
                row["ref_bf16_loss_rel_err"] = abs(ref_bf16_loss - ref_loss) / abs(ref_loss)
                _expect(failures, row, "logits_rel_err",
                        max(BF16_FACTOR * row["ref_bf16_logits_rel_err"], BF16_FLOOR))
                _expect(failures, row, "loss_rel_err", BF16_LOSS_RTOL)
            rows.append(row)
            print(_row_line(row), flush=True)
    generation = [check_generation(name, model, cfg, params, data, impl, args, failures)
                  for impl in args.implementations] if args.generate_tokens else []
    return {"rows": rows, "failures": failures, "config": dataclasses.asdict(cfg),
            "generation": generation}


def check_generation(name: str, hf, cfg: DecoderConfig, params: dict, data: np.ndarray, impl,
                     args, failures: list) -> dict:
    """Greedy decoding of ``--generate-tokens`` after a 16-byte prompt (2 prompts): our dense
    key/value caches against the greedy sequence of transformers' full forward, token for
    token (transformers' cached ``generate`` reported beside it)."""
    import torch
    prompt, _ = text_batch(data, 2, 16, args.seed + 2)
    ids = torch.from_numpy(prompt).long()
    with torch.no_grad():  # the definition: argmax of transformers' full forward, step by step
        seq = ids
        for _ in range(args.generate_tokens):
            seq = torch.cat([seq, hf(seq).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        config = copy.deepcopy(hf.generation_config)
        config.eos_token_id = None  # byte 2 is no end of text here: never stop, never suppress
        config.pad_token_id = 0
        # generate() refills a None from the model's own config (eos_token_id=2): clear it there.
        eos, hf.generation_config.eos_token_id = hf.generation_config.eos_token_id, None
        try:
            cached = hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config,
                                 do_sample=False, max_new_tokens=args.generate_tokens).numpy()
        finally:
            hf.generation_config.eos_token_id = eos
    ref = seq.numpy()[:, prompt.shape[1]:]
    hf_generate_same = float(np.mean(cached[:, prompt.shape[1]:] == ref))
    start = time.perf_counter()
    ours_ = np.asarray(build_decoder(cfg, params, implementation=impl).generate(
        prompt, args.generate_tokens))
    same = ours_ == ref
    first = int(np.argmin(np.all(same, axis=0))) if not same.all() else None
    result = {"model": name, "implementation": impl, "tokens": args.generate_tokens,
              "prompts": int(prompt.shape[0]), "same_fraction": float(same.mean()),
              "first_difference": first, "seconds": time.perf_counter() - start,
              "transformers_generate_same_fraction": hf_generate_same}
    if first is not None:
        failures.append(f"{name} {impl}: greedy generation differs from transformers' forward from "
                        f"step {first} ({same.mean():.0%} of the tokens equal)")
    print(f"{name:<13} {impl:<9} greedy {args.generate_tokens} tokens x {prompt.shape[0]}: "
          f"{same.mean():.0%} equal to transformers' greedy forward (its cached generate: "
          f"{hf_generate_same:.0%})  {result['seconds']:.1f} s",
          flush=True)
    return result


def _expect(failures: list, row: dict, key: str, tol: float) -> None:
    value = row[key]
    if not value <= tol:
        failures.append(f"{row['model']} {row['implementation']} {row['dtype']}: {key} "
                        f"{value:.3e} > {tol:g}" + (f" ({row['grad_worst']})"
                                                    if key == "grad_rel_err" else ""))


def _row_line(row: dict) -> str:
    grad = (f"grad {row['grad_rel_err']:.2e}" if "grad_rel_err" in row else
            f"transformers bf16: logits {row['ref_bf16_logits_rel_err']:.2e}")
    return (f"{row['model']:<13} {row['implementation']:<9} {row['dtype']:<8} "
            f"{row['tokens']:>5} tok  logits {row['logits_rel_err']:.2e}  "
            f"loss {row['loss']:.5f} vs {row['ref_loss']:.5f} ({row['loss_rel_err']:.1e})  "
            f"{grad}  {row['seconds']:.1f} s")


# --------------------------------------------------------------------------
# Training: our kernels vs the XLA references
# --------------------------------------------------------------------------

def train_curves(cfg: DecoderConfig, params: dict, batches: np.ndarray, labels: np.ndarray,
                 implementation, lr: float) -> list[float]:
    """AdamW on ``batches`` from ``params``: the loss of every step."""
    import optax
    model = build_decoder(cfg, params, implementation=implementation)
    graphdef, state = nnx.split(model, nnx.Param)
    tx = optax.adamw(optax.linear_schedule(0.0, lr, 5), weight_decay=0.01)

    @jax.jit
    def step(state, opt_state, tokens, labels):
        loss, grads = jax.value_and_grad(
            lambda s: nnx.merge(graphdef, s).loss(tokens, labels))(state)
        updates, opt_state = tx.update(grads, opt_state, state)
        return optax.apply_updates(state, updates), opt_state, loss

    opt_state, losses = tx.init(state), []
    for tokens, lab in zip(batches, labels):
        state, opt_state, loss = step(state, opt_state, jnp.asarray(tokens), jnp.asarray(lab))
        losses.append(float(loss))
    return losses


def train_family(name: str, family: str, hf_config, data: np.ndarray, args) -> dict:
    """Trains from transformers' own initialisation (a model that starts near ln 256 nats,
    as a real pre-training run does) with our kernels and with the XLA references."""
    model = hf_model(family, hf_config, args.seed, randomize=False)
    cfg = config_from_hf(family, model.config)
    params = MAPPERS[family](hf_state(model), cfg)
    rng = np.random.default_rng(args.seed + 1)
    batches = sample_batches(data, args.train_steps, args.train_batch, args.seq_len - 1, rng)
    labels = batches.copy()
    start = time.perf_counter()
    stock = train_curves(cfg, params, batches, labels, "xla", args.lr)
    mid = time.perf_counter()
    kernels = train_curves(cfg, params, batches, labels, args.train_implementation, args.lr)
    end = time.perf_counter()
    diffs = np.abs(np.array(stock) - np.array(kernels))
    result = {"model": name, "implementation": args.train_implementation,
              "steps": args.train_steps, "batch": [args.train_batch, args.seq_len],
              "xla": stock, "ours": kernels, "max_abs_diff": float(diffs.max()),
              "seconds_xla": mid - start, "seconds_ours": end - mid, "failures": []}
    if not np.all(np.isfinite(diffs)) or diffs.max() > args.train_tolerance:
        result["failures"].append(
            f"{name} training: loss curves differ by {diffs.max():.3e} > {args.train_tolerance:g}")
    for run, curve in (("xla", stock), ("ours", kernels)):
        first, last = np.mean(curve[:3]), np.mean(curve[-3:])
        if not first - last >= args.min_improvement:
            result["failures"].append(f"{name} training ({run}): loss went from {first:.3f} to "
                                      f"{last:.3f}, less than {args.min_improvement:g} lower")
    print(f"{name:<13} train {args.train_steps} steps: xla {stock[0]:.4f} -> {stock[-1]:.4f}, "
          f"{args.train_implementation} {kernels[0]:.4f} -> {kernels[-1]:.4f}, "
          f"max |diff| {diffs.max():.2e}", flush=True)
    return result


# --------------------------------------------------------------------------
# Report and command line
# --------------------------------------------------------------------------

def markdown(result: dict) -> str:
    lines = ["# Decoder families through our layers vs transformers", "",
             f"{result['date']}, JAX {result['jax']}, transformers {result['transformers']}, "
             f"torch {result['torch']}, backend {result['backend']}. Byte tokens of stdlib "
             "source, a quarter of the labels -100. Errors are max |ours - transformers| / "
             "max |transformers|; gradients: the worst parameter.", "",
             "| model | impl | dtype | tokens | max abs logit | logits err | loss (ours / theirs) "
             "| loss err | grad err (worst param) | transformers bf16 logits err | s |",
             "|---|---|---|---:|---:|---:|---|---:|---|---:|---:|"]
    for r in result["rows"]:
        grad = (f"{r['grad_rel_err']:.2e} ({r['grad_worst']})" if "grad_rel_err" in r else "")
        bf16 = f"{r['ref_bf16_logits_rel_err']:.2e}" if "ref_bf16_logits_rel_err" in r else ""
        lines.append(f"| {r['model']} | {r['implementation']} | {r['dtype']} | {r['tokens']} | "
                     f"{r['max_abs_logit']:.2f} | {r['logits_rel_err']:.2e} | {r['loss']:.5f} / "
                     f"{r['ref_loss']:.5f} | {r['loss_rel_err']:.1e} | {grad} | {bf16} | "
                     f"{r['seconds']:.1f} |")
    lines += ["", f"Tolerances: float32 logits {LOGITS_TOL:g}, loss {LOSS_RTOL:g} (relative), "
              f"gradients {GRAD_TOL:g}; bfloat16 logits {BF16_FACTOR:g} x transformers' own "
              f"bfloat16 error (at least {BF16_FLOOR:g}), loss {BF16_LOSS_RTOL:g}.", ""]
    for g in result["generation"]:
        lines.append(f"Greedy generation {g['model']} on {g['implementation']}: {g['tokens']} "
                     f"tokens x {g['prompts']} prompts, {g['same_fraction']:.0%} equal to "
                     "transformers' greedy forward (its cached generate: "
                     f"{g['transformers_generate_same_fraction']:.0%}).")
    lines.append("")
    for t in result["training"]:
        lines.append(f"Training {t['model']} ({t['steps']} AdamW steps of "
                     f"{t['batch'][0]}x{t['batch'][1]} bytes): xla {t['xla'][0]:.4f} -> "
                     f"{t['xla'][-1]:.4f}, {t['implementation']} {t['ours'][0]:.4f} -> "
                     f"{t['ours'][-1]:.4f}, max |diff| {t['max_abs_diff']:.2e}.")
    lines += ["", "Result: " + ("PASS" if result["passed"] else "FAIL")]
    lines += [f"- {f}" for f in result["failures"]]
    return "\n".join(lines) + "\n"


def _models(text: str) -> list[tuple[str, str, bool | None]]:
    """``--models``: ``llama3,llama3-tied,...`` -> (name, family, tie)."""
    out = []
    for name in filter(None, (t.strip() for t in text.split(","))):
        family, _, variant = name.partition("-")
        if family not in FAMILIES or variant not in ("", "tied", "untied"):
            raise argparse.ArgumentTypeError(
                f"--models: unknown {name!r}; expected a family of {FAMILIES}, optionally "
                "with -tied or -untied")
        out.append((name, family, {"": None, "tied": True, "untied": False}[variant]))
    return out


def _per_impl(items: list[str]) -> dict[str, int]:
    out = {}
    for item in items:
        impl, _, n = item.partition("=")
        if impl not in ops.IMPLEMENTATIONS or not n.isdigit() or int(n) < 2:
            raise argparse.ArgumentTypeError(f"--tokens-for takes IMPL=N (N >= 2), got {item!r}")
        out[impl] = int(n)
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.decoder",
        description=__doc__.split("\n\n")[0] + " Exits 1 if a check fails.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--models", default="llama3,llama3-tied,mistral,qwen3,gemma2,mixtral",
                   help="Comma-separated families (llama3, mistral, qwen3, gemma2, mixtral), each "
                        "optionally with -tied / -untied (the head; without: the transformers "
                        "config default, tied for Gemma 2 only).")
    p.add_argument("--implementations", default="xla,interpret,triton",
                   help="Comma-separated implementations of our model to check.")
    p.add_argument("--dtypes", default="float32,bfloat16", help="Comma-separated dtypes.")
    p.add_argument("--tokens", type=int, default=128, help="Tokens per check (batch x seq-len).")
    p.add_argument("--tokens-for", action="append", default=None, metavar="IMPL=N",
                   help="Tokens for one implementation, repeatable (triton=32 unless given: "
                        "Triton's CPU interpreter costs about 0.1 ms of Python per operation).")
    p.add_argument("--seq-len", type=int, default=64, help="Sequence length.")
    p.add_argument("--seed", type=int, default=0, help="Weights, text windows and ignored labels.")
    p.add_argument("--data-bytes", type=int, default=1_000_000,
                   help="Bytes of standard-library source to read.")
    p.add_argument("--generate-tokens", type=int, default=32,
                   help="Greedy tokens generated with the key/value caches and compared with "
                        "transformers' generate, on every implementation (0: no generation).")
    p.add_argument("--train-models", default="llama3,gemma2",
                   help="Comma-separated models (as --models) to train; empty: none.")
    p.add_argument("--train-steps", type=int, default=60, help="Training steps (0: no training).")
    p.add_argument("--train-batch", type=int, default=8, help="Sequences per training step.")
    p.add_argument("--train-implementation", default="interpret",
                   help="Our kernels' implementation in the training run.")
    p.add_argument("--train-tolerance", type=float, default=2e-2,
                   help="Largest allowed |loss_xla - loss_ours| over every step.")
    p.add_argument("--min-improvement", type=float, default=1.0,
                   help="Both training runs must lower the loss (mean of the first 3 steps vs "
                        "the last 3) by this many nats.")
    p.add_argument("--lr", type=float, default=3e-3, help="Peak AdamW learning rate.")
    p.add_argument("--out-dir", default=str(Path(__file__).parent / "results" / "latest"),
                   help="Where decoder.json and decoder.md go.")
    args = p.parse_args(argv)
    args.implementations = [s.strip() for s in args.implementations.split(",") if s.strip()]
    for impl in args.implementations + [args.train_implementation]:
        if impl not in ops.IMPLEMENTATIONS:
            p.error(f"unknown implementation {impl!r}; expected one of {ops.IMPLEMENTATIONS}")
    args.dtypes = [s.strip() for s in args.dtypes.split(",") if s.strip()]
    if not set(args.dtypes) <= {"float32", "bfloat16"}:
        p.error("--dtypes takes float32 and/or bfloat16")
    try:
        args.tokens_for = {"triton": 32, **_per_impl(args.tokens_for or [])}
        args.models = _models(args.models)
        args.train_models = _models(args.train_models)
    except argparse.ArgumentTypeError as e:
        p.error(str(e))
    if args.tokens < 2 or args.seq_len < 2:
        p.error("--tokens and --seq-len must be >= 2")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    import transformers
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    data, _ = load_corpus(args.data_bytes)
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "jax": jax.__version__, "transformers": transformers.__version__,
              "torch": torch.__version__, "backend": jax.default_backend(),
              "args": {k: v for k, v in vars(args).items() if k not in ("models", "train_models")},
              "models": [m[0] for m in args.models], "rows": [], "configs": {}, "training": [],
              "generation": [],
              "failures": []}
    for name, family, tie in args.models:
        checked = check_family(name, family, tiny_hf_config(family, tie=tie), data, args)
        result["rows"] += checked["rows"]
        result["failures"] += checked["failures"]
        result["configs"][name] = checked["config"]
        result["generation"] += checked["generation"]
    if args.train_steps > 0:
        for name, family, tie in args.train_models:
            trained = train_family(name, family, tiny_hf_config(family, tie=tie), data, args)
            result["training"].append(trained)
            result["failures"] += trained["failures"]
    result["passed"] = not result["failures"]
    return write_report(result, args.out_dir, "decoder", markdown(result))


def write_report(result: dict, out_dir, stem: str, md: str) -> int:
    """Writes ``<stem>.json`` and ``<stem>.md`` to ``out_dir``, prints the failures; the exit
    status (0 when ``result["passed"]``)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1, default=str))
    (out / f"{stem}.md").write_text(md)
    print(f"wrote {out / f'{stem}.json'} and {out / f'{stem}.md'}")
    for f in result["failures"]:
        print(f"FAIL: {f}", file=sys.stderr)
    if result["passed"]:
        print("OK: every check passed")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
