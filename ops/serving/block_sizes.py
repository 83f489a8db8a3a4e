"""Launch configuration of the paged decode kernels: pages per grid step and KV splits."""
from __future__ import annotations

import dataclasses
import numbers

import pallas_core as pl

# Enough programs to fill a GPU: about two waves over an H100's 132 SMs.
TARGET_PROGRAMS = 264
MAX_SPLITS = 64


@dataclasses.dataclass(frozen=True)
class PagedBlockSizes:
    """Attributes:
      pages_per_block: pages each grid step (one trip of a Triton program's loop) reads.
      k_splits: how many programs split each row's page table (flash-decoding);
        1 writes the output directly, more add a merge kernel.
    """

    pages_per_block: int
    k_splits: int


def heuristic(backend: str, programs: int, page_size: int, pages_per_row: int) -> PagedBlockSizes:
    """The default: about 128 keys per step on a GPU (64 elsewhere, where a step is a
    grid iteration), and on the GPU backends as many splits as it takes to launch
    :data:`TARGET_PROGRAMS` programs for ``programs`` (rows x key/value heads), each
    split keeping at least one block; one split on the interpreter and TPU unless the
    table is long (a TPU core walks its programs in order, so splits add only merge work)."""
    keys = 128 if backend in pl.TRITON_BACKENDS else 64
    per_block = max(1, min(pages_per_row, keys // max(page_size, 1), 16))
    blocks = pl.cdiv(pages_per_row, per_block)
    if backend in pl.TRITON_BACKENDS:
        splits = pl.cdiv(TARGET_PROGRAMS, max(programs, 1))
    else:
        splits = 1
    splits = max(1, min(splits, blocks, MAX_SPLITS))
    return PagedBlockSizes(per_block, splits)


def check_block_sizes(block_sizes, op: str) -> PagedBlockSizes | None:
    """None, a :class:`PagedBlockSizes`, a dict of its fields or a pair ``(pages_per_block,
    k_splits)``.

    Raises:
      ValueError: anything else, or a field that is not a positive int.
    """
    if block_sizes is None or isinstance(block_sizes, PagedBlockSizes):
        bs = block_sizes
    elif isinstance(block_sizes, dict) and set(block_sizes) == {"pages_per_block", "k_splits"}:
        bs = PagedBlockSizes(**block_sizes)
    elif isinstance(block_sizes, (tuple, list)) and len(block_sizes) == 2:
        bs = PagedBlockSizes(*block_sizes)
    else:
        raise ValueError(f"{op}: block_sizes must be None, a PagedBlockSizes, a dict with keys "
                         f"'pages_per_block' and 'k_splits', or a pair of them; got {block_sizes!r}.")
    if bs is not None:
        for f in dataclasses.fields(bs):
            x = getattr(bs, f.name)
            if isinstance(x, bool) or not isinstance(x, numbers.Integral) or x < 1:
                raise ValueError(f"{op}: block_sizes.{f.name} must be a positive int, got {x!r}.")
    return bs
