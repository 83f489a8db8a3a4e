"""The static description of one attention call, shared by its kernels, in named parts.

A :class:`Config` is four parts, each a frozen dataclass (so the whole is hashable, the
``custom_vjp`` nondiff argument of :func:`ops.dot_product_attention`):

* :class:`Backend`: where the kernels run and how they walk the other sequence
  (the backend's name, its operand layout and walk strategy);
* :class:`AttentionProblem`: what is computed (shapes, heads, the mask spec,
  which optional operands are present and which of their dims are full);
* :class:`~ops.attention.tile_math.ScoreMath`: how a tile's products become
  probabilities (scale, soft cap, dropout, sinks), all the per-tile math reads;
* :class:`~ops.attention.block_sizes.BlockSizes`: the tiles (resolved: every
  block set, ``k_splits`` an int), the op's tunable config.
"""
from __future__ import annotations

import dataclasses

import pallas_core as pl
from ops.attention.block_sizes import BlockSizes
from ops.attention.masking import MaskSpec
from ops.attention.tile_math import ScoreMath

__all__ = ["AttentionProblem", "Backend", "BlockSizes", "Config", "ScoreMath"]


@dataclasses.dataclass(frozen=True)
class Backend:
    """The backend part: its name (``"interpret"``, ``"triton"``, ``"pallas_triton"``,
    ``"mosaic_tpu"``) and what follows from its traits (:meth:`of`, :attr:`traits`).

    Attributes:
      name: the backend.
      layout: "BTNH" (operands as given) or "BNTH" (heads before the sequence,
        what TPU tiling needs; transposed outside the kernels).
    """

    name: str
    layout: str = "BTNH"

    @classmethod
    def of(cls, name: str) -> "Backend":
        """The backend part for ``name``: BNTH operands on a TPU, BTNH elsewhere."""
        return cls(name, "BNTH" if pl.backend_traits(name).hardware == "tpu" else "BTNH")

    @property
    def traits(self) -> pl.BackendTraits:
        """What the backend declared about itself (:func:`pallas_core.backend_traits`)."""
        return pl.backend_traits(self.name)

    @property
    def strategy(self) -> str:
        """How the kernels walk the other sequence: the backend's preferred walk
        (``traits.walk``): ``"loop"`` on the Triton backends (:mod:`ops.attention.loop_walk`),
        ``"grid"`` elsewhere (:mod:`ops.attention.grid_walk`)."""
        return self.traits.walk


@dataclasses.dataclass(frozen=True)
class AttentionProblem:
    """The problem part: query ``[batch, T, heads, head_dim]``, key/value ``[batch, S,
    kv_heads, head_dim | value_head_dim]`` (``T`` and ``S`` are ``spec``'s).

    Attributes:
      spec: the positional and segment masking (:class:`~ops.attention.masking.MaskSpec`).
      value_head_dim: the value (and output) head dim when it differs from the
        query/key ``head_dim`` (None: the same).
      bias_full / mask_full: per dim of the 4-D bias / mask, whether it is full
        size (True) or broadcast (size 1); None when absent.
    """

    spec: MaskSpec
    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    value_head_dim: int | None = None
    bias_full: tuple[bool, ...] | None = None
    mask_full: tuple[bool, ...] | None = None

    @property
    def group(self) -> int:
        """Query heads per key/value head."""
        return self.heads // self.kv_heads

    @property
    def v_dim(self) -> int:
        """The value / output head dim."""
        return self.head_dim if self.value_head_dim is None else self.value_head_dim


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything static about one attention call: :class:`Backend`,
    :class:`AttentionProblem`, :class:`~ops.attention.tile_math.ScoreMath` and the tiles
    (:class:`~ops.attention.block_sizes.BlockSizes`, resolved: ``block_q_dkv`` /
    ``block_k_dkv`` set and ``k_splits`` the int the call runs with, 1 unsplit)."""

    backend: Backend
    problem: AttentionProblem
    score: ScoreMath
    blocks: BlockSizes
