"""Dropout on attention probabilities from a counter-based hash.

The keep/drop bit of entry ``(b, n, q, k)`` is a pure function of the seed
and those four coordinates, so a kernel draws the bits of the tile it is
working on, the backward kernels draw the same bits again instead of storing
a ``T x S`` mask, and the XLA reference draws the whole mask with the very
same function: every backend drops the same entries, bit for bit.

The hash is MurmurHash3's 32-bit finalizer (``fmix32``, Appleby 2011), a
bijection on 32-bit words with full avalanche. Coordinates are folded in
one by one, ``h = fmix32(h ^ coordinate)``, on int32 bit patterns with
wrap-around multiplication and logical shifts only, which XLA, Triton and
Mosaic all compute identically. This is a statistical hash, not a
cryptographic generator: right for dropout, wrong for secrets.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# fmix32's multipliers (0x85ebca6b, 0xc2b2ae35) as int32 bit patterns.
_C1 = np.int32(np.uint32(0x85EBCA6B).view(np.int32))
_C2 = np.int32(np.uint32(0xC2B2AE35).view(np.int32))
# Odd golden-ratio constant: spreads consecutive key positions before the mix.
_GOLDEN = np.int32(np.uint32(0x9E3779B9).view(np.int32))
_BITS = 24  # keep/drop compares the top 24 bits of the hash with the rate


def fmix32(h):
    """MurmurHash3's finalizer on int32 bit patterns (elementwise)."""
    h = h ^ lax.shift_right_logical(h, jnp.int32(16))
    h = h * _C1
    h = h ^ lax.shift_right_logical(h, jnp.int32(13))
    h = h * _C2
    return h ^ lax.shift_right_logical(h, jnp.int32(16))


def seed_from_rng(rng) -> jax.Array:
    """One int32 seed from a JAX PRNG key (typed ``jax.random.key`` or raw ``uint32[2]``)."""
    data = jax.random.key_data(rng) if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key) else rng
    words = lax.bitcast_convert_type(jnp.ravel(data).astype(jnp.uint32), jnp.int32)
    h = jnp.int32(0)
    for k in range(words.shape[0]):
        h = fmix32(h ^ words[k])
    return h


def threshold(rate: float) -> int:
    """Entries whose 24-bit draw is below this are dropped: P(drop) = threshold / 2**24 ~ rate."""
    return int(round(rate * (1 << _BITS)))


def keep_mask(seed, head, q_pos, k_pos, rate: float):
    """True where entry ``(head, q_pos, k_pos)`` is kept.

    Args:
      seed: int32 scalar from :func:`seed_from_rng`.
      head: int32, ``b * N + n`` (batch and query head), broadcastable.
      q_pos, k_pos: int32 absolute query / key positions, broadcastable
        against each other (a ``(bq, 1)`` column and a ``(1, bk)`` row in a
        kernel tile, or whole ``[T, 1]`` / ``[1, S]`` in the reference).
      rate: the drop probability, a Python float in ``[0, 1)``.
    """
    row = fmix32(fmix32(seed ^ head) ^ q_pos)
    h = fmix32(row ^ (k_pos * _GOLDEN))
    return lax.shift_right_logical(h, jnp.int32(32 - _BITS)) >= threshold(rate)
