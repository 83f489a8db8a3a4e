"""The static description of one attention call, shared by its kernels."""
from __future__ import annotations

import dataclasses

import pallas_core as pl
from ops.attention.block_sizes import BlockSizes
from ops.attention.masking import MaskSpec


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything static about one attention call (hashable: a custom_vjp nondiff argument),
    in three parts: the backend's (``backend``, ``layout`` and :attr:`strategy`), the
    call's problem (``spec`` to ``mask_full``, ``sinks``, ``value_head_dim``) and the
    tiles chosen for it (``block_q`` to ``num_stages``, ``k_splits``; :attr:`blocks` is
    that part as the op's config, :class:`~ops.attention.block_sizes.BlockSizes`).

    Attributes:
      layout: "BTNH" (operands as given) or "BNTH" (heads before the
        sequence, what TPU tiling needs; transposed outside the kernels).
      bias_full / mask_full: per dim of the 4-D bias / mask, whether it is full
        size (True) or broadcast (size 1); None when absent.
      block_q, block_k: forward / dQ tiles; block_q_dkv, block_k_dkv: dK/dV tiles.
      sinks: whether a per-head sink logit joins every row's softmax denominator.
      value_head_dim: the value (and output) head dim when it differs from the
        query/key ``head_dim`` (None: the same).
      k_splits: programs sharing one key/value range in split-KV decode (1: unsplit).
    """

    backend: str
    layout: str
    spec: MaskSpec
    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    scale: float
    softcap: float | None
    dropout_rate: float
    bias_full: tuple[bool, ...] | None
    mask_full: tuple[bool, ...] | None
    block_q: int
    block_k: int
    block_q_dkv: int
    block_k_dkv: int
    num_warps: int | None = None
    num_stages: int | None = None
    sinks: bool = False
    value_head_dim: int | None = None
    k_splits: int = 1

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    @property
    def v_dim(self) -> int:
        """The value / output head dim."""
        return self.head_dim if self.value_head_dim is None else self.value_head_dim

    @property
    def strategy(self) -> str:
        """How the kernels walk the other sequence: ``"loop"`` on the Triton backends
        (:mod:`ops.attention.loop_walk`), ``"grid"`` elsewhere (:mod:`ops.attention.grid_walk`)."""
        return "loop" if self.backend in pl.TRITON_BACKENDS else "grid"

    @property
    def blocks(self) -> BlockSizes:
        """The tiles of this call, as the op's config."""
        return BlockSizes(self.block_q, self.block_k, self.block_q_dkv, self.block_k_dkv,
                          self.num_warps, self.num_stages, self.k_splits)
