"""The language-model loss options shared by ``cross_entropy`` and ``linear_cross_entropy``.

Both ops compute, per row (token) with logits ``z`` over ``V`` classes, in
float32:

* ``logits_soft_cap`` (Gemma 2's final-logit cap; Team Gemma 2024, "Gemma 2:
  Improving Open Language Models at a Practical Size", section 2): ``z <- cap
  * tanh(z / cap)`` before anything else, so the loss, the softmax and the
  gradient are those of the capped logits (the gradient carries the cap's
  derivative ``1 - tanh(z / cap)**2``).
* ``lse = logsumexp(z)``.
* ``label_smoothing`` ``a`` (Szegedy et al. 2016, "Rethinking the Inception
  Architecture", section 7), optax's meaning (``optax.smooth_labels``): the
  target distribution is ``(1 - a) * onehot(label) + a / V``, so the loss is
  ``lse - (1 - a) * z[label] - a * mean(z)``; ``a = 0`` is the plain loss.
* ``z_loss`` weight ``w`` (Chowdhery et al. 2022, "PaLM", section 5): ``w *
  lse**2`` is added to the loss, pulling ``lse`` towards 0. Its value alone
  is returned too with ``return_z_loss=True`` (reduced as the loss is), the
  form t5x logs it in.
* ``ignore_index``: rows whose label equals it give loss 0, z-loss 0 and a
  zero gradient (transformers and PyTorch use -100 for padding).
* labels outside ``[0, V)`` that are not ``ignore_index``: the row's loss is
  NaN, whatever the options (a padding label that was not declared ignored
  must never train quietly towards some class); under
  ``jax.experimental.checkify.checkify`` the call reports them as a check
  error instead (:func:`finish`).
* ``reduction``: ``"none"`` gives the per-row losses in the logits' dtype;
  ``"sum"`` their float32 sum; ``"mean"`` the float32 sum divided by the
  number of rows that are not ignored (at least 1, so a batch of padding
  only gives 0, not NaN).

:func:`finish` applies z-loss, ignoring and the reduction to per-row
``(loss, lse)`` that the kernels (or :func:`row_losses`, the XLA reference)
produce; it is plain XLA on ``[rows]`` vectors, and its autodiff hands the
kernels' custom VJPs the row cotangents (zero on ignored rows).
"""
from __future__ import annotations

import dataclasses
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import checkify

__all__ = ["LossOptions", "check_options", "soft_cap", "row_losses", "finish", "REDUCTIONS"]

REDUCTIONS = ("none", "sum", "mean")


@dataclasses.dataclass(frozen=True)
class LossOptions:
    """The checked options (module docstring); hashable, so kernels can key on them."""

    ignore_index: int | None = None
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    logits_soft_cap: float | None = None
    reduction: str = "none"
    return_z_loss: bool = False

    @property
    def needs_lse_grad(self) -> bool:
        """Whether the loss depends on ``lse`` beyond the cross-entropy itself (z-loss)."""
        return self.z_loss != 0.0


def _static_real(value, name: str, op: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{op}: {name} must be a static real number, got "
                        f"{type(value).__name__} {value!r}.")
    value = float(value)
    if not np.isfinite(value):
        raise ValueError(f"{op}: {name} must be finite, got {value}.")
    return value


def check_options(op: str, *, ignore_index=None, label_smoothing=0.0, z_loss=0.0,
                  logits_soft_cap=None, reduction="none", return_z_loss=False) -> LossOptions:
    """Checks the loss options before anything is traced.

    Raises:
      TypeError: ignore_index not an int or None, a non-numeric
        label_smoothing / z_loss / logits_soft_cap, return_z_loss not a bool.
      ValueError: label_smoothing outside [0, 1], a negative or non-finite
        z_loss, a logits_soft_cap that is not > 0 and finite, an unknown
        reduction.
    """
    if ignore_index is not None and (isinstance(ignore_index, bool)
                                     or not isinstance(ignore_index, numbers.Integral)):
        raise TypeError(f"{op}: ignore_index must be an int or None, got "
                        f"{type(ignore_index).__name__} {ignore_index!r}.")
    smoothing = _static_real(label_smoothing, "label_smoothing", op)
    if not 0.0 <= smoothing <= 1.0:
        raise ValueError(f"{op}: label_smoothing must be in [0, 1], got {smoothing}.")
    z = _static_real(z_loss, "z_loss", op)
    if z < 0.0:
        raise ValueError(f"{op}: z_loss must be >= 0, got {z}.")
    cap = None
    if logits_soft_cap is not None:
        cap = _static_real(logits_soft_cap, "logits_soft_cap", op)
        if not cap > 0.0:
            raise ValueError(f"{op}: logits_soft_cap must be None or > 0, got {cap}.")
    if not isinstance(reduction, str) or reduction not in REDUCTIONS:
        raise ValueError(f"{op}: reduction must be one of {REDUCTIONS}, got {reduction!r}.")
    if not isinstance(return_z_loss, (bool, np.bool_)):
        raise TypeError(f"{op}: return_z_loss must be a bool, got {type(return_z_loss).__name__}.")
    return LossOptions(ignore_index=None if ignore_index is None else int(ignore_index),
                       label_smoothing=smoothing, z_loss=z, logits_soft_cap=cap,
                       reduction=reduction, return_z_loss=bool(return_z_loss))


def soft_cap(z, cap: float | None):
    """``cap * tanh(z / cap)`` (float32 in, float32 out); ``z`` itself without a cap."""
    return z if cap is None else cap * jnp.tanh(z / cap)


def row_losses(logits, labels, options: LossOptions):
    """The XLA reference of the per-row float32 ``(loss without z-loss, lse)``.

    ``loss = lse - (1 - a) * z[label] - a * mean(z)`` on the (capped) float32
    logits, written as ``(1 - a) * (m - z[label]) + a * (m - mean(z)) +
    log(sum(exp(z - m)))`` with ``m`` the row maximum (held constant for
    autodiff) so large logits lose nothing to a rounded ``lse``; NaN for
    labels outside ``[0, V)``. Differentiable by JAX's autodiff.
    """
    z = soft_cap(logits.astype(jnp.float32), options.logits_soft_cap)
    v = logits.shape[-1]
    m = lax.stop_gradient(jnp.max(z, axis=-1, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    log_s = jnp.log(jnp.sum(jnp.exp(z - m), axis=-1))
    m = m[..., 0]
    safe = jnp.clip(labels, 0, v - 1).astype(jnp.int32)
    picked = jnp.take_along_axis(z, safe[..., None], axis=-1)[..., 0]
    a = options.label_smoothing
    loss = (m - picked) + log_s
    if a:
        loss = (1.0 - a) * (m - picked) + a * (m - jnp.mean(z, axis=-1)) + log_s
    valid = (labels >= 0) & (labels < v)
    return jnp.where(valid, loss, jnp.nan), m + log_s


def finish(loss, lse, labels, num_classes: int, options: LossOptions, dtype):
    """Adds the z-loss, zeroes ignored rows and reduces (module docstring).

    Args:
      loss, lse: float32 per-row values, shaped like ``labels``.
      labels: the integer labels.
      num_classes: V.
      options: the checked options.
      dtype: the result dtype of ``reduction="none"`` (the logits').

    Returns:
      The loss, or ``(loss, z_loss)`` with ``options.return_z_loss``.
    """
    ignored = (labels == options.ignore_index) if options.ignore_index is not None else None
    valid = (labels >= 0) & (labels < num_classes)
    checkify.debug_check(jnp.all(valid if ignored is None else valid | ignored),
                         f"labels outside [0, {num_classes}) that are not ignore_index "
                         f"({options.ignore_index}) give a NaN loss")
    z = options.z_loss * lse * lse if options.z_loss else jnp.zeros_like(loss)
    if options.z_loss:
        loss = loss + z
    if ignored is not None:
        loss = jnp.where(ignored, 0.0, loss)
        z = jnp.where(ignored, 0.0, z)
    if options.reduction == "none":
        loss, z = loss.astype(dtype), z.astype(dtype)
    else:
        loss, z = jnp.sum(loss), jnp.sum(z)
        if options.reduction == "mean":
            count = jnp.float32(labels.size) if ignored is None else jnp.sum(~ignored)
            count = jnp.maximum(count, 1).astype(jnp.float32)
            loss, z = loss / count, z / count
    return (loss, z) if options.return_z_loss else loss


def reference(logits, labels, options: LossOptions):
    """The whole loss with XLA: :func:`row_losses` then :func:`finish`."""
    loss, lse = row_losses(logits, labels, options)
    return finish(loss, lse, labels, logits.shape[-1], options, logits.dtype)
