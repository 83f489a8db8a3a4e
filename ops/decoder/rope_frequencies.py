"""Rotary-embedding frequencies: ``rope_frequencies(rotary_dim, theta=, scaling=)``.

The rope types and parameters of Hugging Face transformers' rotary modules
(``modeling_rope_utils.ROPE_INIT_FUNCTIONS`` and each model's default):

* ``default`` (Su et al. 2021, "RoFormer", section 3.2.2):
  ``inv_freq[i] = theta ** (-2i / R)`` for ``i < R/2``.
* ``linear`` (position interpolation; Chen et al. 2023, "Extending Context
  Window of Large Language Models via Positional Interpolation"): the default
  frequencies divided by ``factor``.
* ``dynamic`` (dynamic NTK scaling, as transformers computes it): at a
  sequence length ``L >= max_position_embeddings`` the base becomes
  ``theta * (factor * L / max_position_embeddings - (factor - 1)) ** (R / (R - 2))``;
  shorter sequences use ``L = max_position_embeddings``.
* ``llama3`` (Llama 3.1): wavelengths ``2 pi / inv_freq`` above
  ``original_max_position_embeddings / low_freq_factor`` divided by
  ``factor``, below ``original_max_position_embeddings / high_freq_factor``
  kept, interpolated smoothly in between.
* ``yarn`` (Peng et al. 2023, "YaRN: Efficient Context Window Extension of
  Large Language Models", section 3.2-3.3): per-frequency blend of
  interpolated and extrapolated frequencies over the correction range set by
  ``beta_fast`` / ``beta_slow``, and the attention factor ``0.1 ln(factor) + 1``
  (or ``mscale`` / ``mscale_all_dim``'s ratio, or ``attention_factor``) that
  multiplies ``cos`` and ``sin``.

The arithmetic is transformers' in float32 step by step (the exponent
``2i / R`` rounded to float32, the power, the reciprocal, each correction), so
``inv_freq`` agrees with theirs to float32 rounding (tests/test_rope.py
compares every type); scalars derived from the parameters are float64, as
Python computes them there.
"""
from __future__ import annotations

import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

_OP = "rope_frequencies"

# Per rope type: (required keys, optional keys with their defaults).
_PARAMETERS: dict[str, tuple[tuple[str, ...], dict]] = {
    "default": ((), {}),
    "linear": (("factor",), {}),
    "dynamic": (("factor", "max_position_embeddings"), {"sequence_length": None}),
    "llama3": (("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
               {}),
    "yarn": (("original_max_position_embeddings",),
             {"factor": None, "max_position_embeddings": None, "attention_factor": None,
              "mscale": None, "mscale_all_dim": None, "beta_fast": 32.0, "beta_slow": 1.0,
              "truncate": True}),
}
ROPE_TYPES = tuple(_PARAMETERS)


def rope_frequencies(rotary_dim: int, *, theta: float = 10000.0,
                     scaling: Mapping | None = None) -> tuple[jax.Array, float]:
    """The inverse frequencies and attention scaling of a rotary embedding.

    Args:
      rotary_dim: ``R``, the number of rotated features per head (a positive
        even int; ``int(head_dim * partial_rotary_factor)`` for partial rotary).
      theta: the base wavelength (transformers' ``rope_theta``), a positive number.
      scaling: None (the ``default`` type) or a mapping with ``"rope_type"``
        (``"type"`` is accepted too, as older configs spell it) in
        ``"default"``, ``"linear"``, ``"dynamic"``, ``"llama3"``, ``"yarn"`` and
        that type's parameters, named and meant as in transformers'
        ``rope_parameters`` (see the module docstring):

        * linear: ``factor``.
        * dynamic: ``factor``, ``max_position_embeddings`` and optionally
          ``sequence_length`` (the ``seq_len`` transformers recomputes at; None
          or shorter: ``max_position_embeddings``).
        * llama3: ``factor``, ``low_freq_factor``, ``high_freq_factor``,
          ``original_max_position_embeddings``.
        * yarn: ``original_max_position_embeddings``, ``factor`` (None: the
          ratio ``max_position_embeddings / original_max_position_embeddings``,
          which then needs ``max_position_embeddings``), and optionally
          ``attention_factor``, ``mscale``, ``mscale_all_dim``, ``beta_fast``
          (32), ``beta_slow`` (1), ``truncate`` (True).

        ``rope_theta`` may appear too (a config's ``rope_parameters`` passed
        whole) and must then equal ``theta``; ``partial_rotary_factor`` may
        appear and is ignored (``rotary_dim`` already says it).

    Returns:
      ``(inv_freq, attention_scaling)``: a float32 ``[rotary_dim // 2]`` array and a
      Python float (1.0 except for yarn), the arguments of
      :func:`ops.apply_rotary_embedding`. Computed on the host: every argument
      is a static Python number.

    Raises:
      TypeError: a non-integer rotary_dim, a non-numeric theta or parameter,
        scaling not a mapping.
      ValueError: rotary_dim not positive and even, theta not positive and
        finite, an unknown rope type, a missing or unknown parameter, a
        parameter out of range (factors must be positive).
    """
    r = _check_rotary_dim(rotary_dim)
    theta = _positive(theta, "theta")
    rope_type, params = _check_scaling(scaling, theta)
    exponent = np.arange(0, r, 2, dtype=np.float32) / np.float32(r)
    attention_scaling = 1.0
    if rope_type == "dynamic":
        length = params["sequence_length"]
        length = params["max_position_embeddings"] if length is None else max(
            length, params["max_position_embeddings"])
        factor = params["factor"]
        theta = theta * ((factor * length / params["max_position_embeddings"]) - (factor - 1)) ** (
            r / (r - 2)) if r > 2 else theta
    inv_freq = _reciprocal_power(theta, exponent)
    if rope_type == "linear":
        inv_freq = inv_freq / np.float32(params["factor"])
    elif rope_type == "llama3":
        inv_freq = _llama3(inv_freq, **{k: params[k] for k in _PARAMETERS["llama3"][0]})
    elif rope_type == "yarn":
        inv_freq, attention_scaling = _yarn(theta, exponent, r, params)
    return jnp.asarray(inv_freq.astype(np.float32)), float(attention_scaling)


def _reciprocal_power(base: float, exponent: np.ndarray) -> np.ndarray:
    """``1 / base ** exponent`` in float32: the power of float32 operands, correctly rounded."""
    power = np.power(np.float64(np.float32(base)), exponent.astype(np.float64)).astype(np.float32)
    return np.float32(1.0) / power


def _llama3(inv_freq, *, factor, low_freq_factor, high_freq_factor,
            original_max_position_embeddings):
    low_freq_wavelen = original_max_position_embeddings / low_freq_factor
    high_freq_wavelen = original_max_position_embeddings / high_freq_factor
    wavelen = np.float32(2 * math.pi) / inv_freq
    scaled = np.where(wavelen > np.float32(low_freq_wavelen), inv_freq / np.float32(factor), inv_freq)
    smooth = ((np.float32(original_max_position_embeddings) / wavelen - np.float32(low_freq_factor))
              / np.float32(high_freq_factor - low_freq_factor))
    smoothed = (1 - smooth) * scaled / np.float32(factor) + smooth * scaled
    medium = ~(wavelen < np.float32(high_freq_wavelen)) & ~(wavelen > np.float32(low_freq_wavelen))
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn(theta, exponent, r, params):
    original = params["original_max_position_embeddings"]
    factor = params["factor"]
    if factor is None:
        if params["max_position_embeddings"] is None:
            raise ValueError(f"{_OP}: yarn without factor needs max_position_embeddings (factor "
                             "defaults to max_position_embeddings / original_max_position_embeddings).")
        factor = params["max_position_embeddings"] / original

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params["attention_factor"]
    if attention_factor is None:
        if params["mscale"] and params["mscale_all_dim"]:
            attention_factor = mscale(factor, params["mscale"]) / mscale(factor, params["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast = params["beta_fast"] or 32
    beta_slow = params["beta_slow"] or 1

    def correction_dim(rotations):
        return r * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, r - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(r // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low),
                   0, 1).astype(np.float32)
    power = np.power(np.float64(np.float32(theta)), exponent.astype(np.float64)).astype(np.float32)
    extrapolation = np.float32(1.0) / power
    interpolation = np.float32(1.0) / (np.float32(factor) * power)
    keep = (1 - ramp).astype(np.float32)
    return interpolation * (1 - keep) + extrapolation * keep, attention_factor


def _check_rotary_dim(rotary_dim) -> int:
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, (int, np.integer)):
        raise TypeError(f"{_OP}: rotary_dim must be an int, got {type(rotary_dim).__name__}.")
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"{_OP}: rotary_dim must be a positive even int, got {rotary_dim}.")
    return int(rotary_dim)


def _number(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{_OP}: {name} must be a Python number, got {type(value).__name__}.")
    return float(value)


def _positive(value, name: str) -> float:
    v = _number(value, name)
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"{_OP}: {name} must be positive and finite, got {value!r}.")
    return v


def _check_scaling(scaling, theta: float) -> tuple[str, dict]:
    if scaling is None:
        return "default", {}
    if not isinstance(scaling, Mapping):
        raise TypeError(f"{_OP}: scaling must be None or a mapping with 'rope_type', got "
                        f"{type(scaling).__name__}.")
    params = dict(scaling)
    rope_type = params.pop("rope_type", None)
    legacy = params.pop("type", None)
    rope_type = rope_type if rope_type is not None else legacy
    if rope_type not in _PARAMETERS:
        raise ValueError(f"{_OP}: scaling['rope_type'] must be one of {ROPE_TYPES}, got {rope_type!r}.")
    given_theta = params.pop("rope_theta", None)
    if given_theta is not None and _number(given_theta, "scaling['rope_theta']") != theta:
        raise ValueError(f"{_OP}: scaling['rope_theta'] = {given_theta!r} differs from theta = {theta!r}; "
                         "pass the base once, as theta.")
    params.pop("partial_rotary_factor", None)
    required, optional = _PARAMETERS[rope_type]
    unknown = sorted(set(params) - set(required) - set(optional))
    if unknown:
        raise ValueError(f"{_OP}: unknown parameter(s) {unknown} for rope_type {rope_type!r}; "
                         f"it takes {sorted(required + tuple(optional))}.")
    missing = [k for k in required if params.get(k) is None]
    if missing:
        raise ValueError(f"{_OP}: rope_type {rope_type!r} needs scaling[{missing[0]!r}].")
    out = dict(optional)
    for k, v in params.items():
        if v is None:
            continue
        if k == "truncate":
            if not isinstance(v, (bool, np.bool_)):
                raise TypeError(f"{_OP}: scaling['truncate'] must be a bool, got {type(v).__name__}.")
            out[k] = bool(v)
        elif k in ("mscale", "mscale_all_dim"):
            out[k] = _number(v, f"scaling[{k!r}]")
        else:
            out[k] = _positive(v, f"scaling[{k!r}]")
    if rope_type == "llama3" and out["high_freq_factor"] <= out["low_freq_factor"]:
        raise ValueError(f"{_OP}: llama3 needs high_freq_factor > low_freq_factor, got "
                         f"{out['high_freq_factor']} and {out['low_freq_factor']}.")
    return rope_type, out
