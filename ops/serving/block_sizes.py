"""Launch configuration of the paged attention kernels: pages per step, KV splits and the
query block (the op layer's config of ``paged_attention`` and ``ragged_paged_attention``)."""
from __future__ import annotations

import dataclasses
import numbers

import pallas_core as pl
from ops._op import Device, KernelConfig, Problem, tunable

# Enough programs to fill a GPU: about two waves over an H100's 132 SMs.
TARGET_PROGRAMS = 264
MAX_SPLITS = 64
# The problem dims the config is chosen by (Op.dims of both paged ops).
DIMS = ("rows", "kv_heads", "group", "head_dim", "page_size", "pages_per_row")


@dataclasses.dataclass(frozen=True)
class PagedBlockSizes(KernelConfig):
    """Attributes:
      pages_per_block: pages each grid step (one trip of a Triton program's loop) reads.
      k_splits: how many programs split each row's page table (flash-decoding);
        1 writes the output directly, more add a merge kernel. Asked for without
        ``block_q``, it selects a query block of 1 in ``ragged_paged_attention``;
        the query-blocked kernel splits each query block's key tiles too.
      num_warps, num_stages: Triton launch parameters (None: 4 warps, 2 stages).
      block_q: ``ragged_paged_attention`` only: query tokens of one sequence per
        program. More than 1 runs the query-blocked kernel
        (:mod:`ops.serving.prefill_kernels`), which reads a sequence's pages once
        per block of ``block_q`` tokens; an explicit 1 serves every token as its
        own row of the per-page split-KV decode kernel. None:
        :func:`ragged_block_q` chooses (1 when ``k_splits > 1``), and a query
        block of 1 runs on the query-blocked kernel's multi-page key tiles where
        :func:`multi_page_decode` says so.
    """

    pages_per_block: int = tunable()
    k_splits: int = tunable()
    num_warps: int | None = tunable(None)
    num_stages: int | None = tunable(None)
    block_q: int | None = tunable(None)

    @classmethod
    def heuristic(cls, problem: Problem, device: Device) -> "PagedBlockSizes":
        """About 128 keys per step on a GPU (64 elsewhere, where a step is a grid
        iteration); on the Triton backends as many splits as it takes to launch
        :data:`TARGET_PROGRAMS` programs over rows x key/value heads, each split keeping
        at least one block; one split on the interpreter and TPU (a TPU core walks its
        programs in order, so splits would add only the merge's work)."""
        rows, kv_heads, _, _, page_size, pages_per_row = problem.shape
        gpu = device.traits.triton
        keys = 128 if gpu else 64
        per_block = max(1, min(pages_per_row, keys // max(page_size, 1), 16))
        blocks = pl.cdiv(pages_per_row, per_block)
        splits = pl.cdiv(TARGET_PROGRAMS, max(rows * kv_heads, 1)) if gpu and not device.interpreter else 1
        return cls(per_block, max(1, min(splits, blocks, MAX_SPLITS)))

    @classmethod
    def candidates(cls, problem: Problem, device: Device) -> tuple["PagedBlockSizes", ...]:
        """The heuristic's pages per step at a half and twice, its splits at a half and
        twice, at 4 and 8 warps (Triton GPUs; the heuristic elsewhere)."""
        base = cls.heuristic(problem, device)
        if not device.traits.triton or device.interpreter:
            return (base,)
        pages_per_row = problem.shape[-1]
        out = []
        for per_block in (base.pages_per_block, base.pages_per_block // 2, base.pages_per_block * 2):
            per_block = max(1, min(per_block, pages_per_row, 16))
            blocks = pl.cdiv(pages_per_row, per_block)
            for splits in (base.k_splits, base.k_splits // 2, base.k_splits * 2):
                splits = max(1, min(splits, blocks, MAX_SPLITS))
                for warps in (4, 8):
                    c = cls(per_block, splits, warps)
                    if c not in out:
                        out.append(c)
        return tuple(out)


def check_block_sizes(block_sizes, op: str) -> PagedBlockSizes | None:
    """None, a :class:`PagedBlockSizes`, a dict of its fields or a pair ``(pages_per_block,
    k_splits)``.

    Raises:
      ValueError: anything else, a field that is not a positive int (or None for the
        launch parameters and ``block_q``), or a ``block_q`` for another op than
        ``ragged_paged_attention``.
    """
    fields = {f.name for f in dataclasses.fields(PagedBlockSizes)}
    if block_sizes is None or isinstance(block_sizes, PagedBlockSizes):
        bs = block_sizes
    elif (isinstance(block_sizes, dict) and {"pages_per_block", "k_splits"} <= set(block_sizes)
          <= fields):
        bs = PagedBlockSizes(**block_sizes)
    elif isinstance(block_sizes, (tuple, list)) and len(block_sizes) == 2:
        bs = PagedBlockSizes(*block_sizes)
    else:
        optional = sorted(fields - {"pages_per_block", "k_splits"})
        raise ValueError(f"{op}: block_sizes must be None, a PagedBlockSizes, a dict with keys "
                         f"'pages_per_block' and 'k_splits' (optionally {optional}), or a pair "
                         f"of them; got {block_sizes!r}.")
    if bs is not None:
        for f in dataclasses.fields(bs):
            x = getattr(bs, f.name)
            if x is None and f.name in ("num_warps", "num_stages", "block_q"):
                continue
            if isinstance(x, bool) or not isinstance(x, numbers.Integral) or x < 1:
                raise ValueError(f"{op}: block_sizes.{f.name} must be a positive int, got {x!r}.")
        if bs.block_q is not None and op != "ragged_paged_attention":
            raise ValueError(f"{op}: block_sizes.block_q is ragged_paged_attention's (query "
                             f"tokens per program); {op} has one query token per row. Got "
                             f"{bs.block_q!r}.")
    return bs


# Query-tile rows the query-blocked kernel aims for: block_q tokens x the GQA group.
TARGET_QUERY_ROWS = 128


def ragged_block_q(explicit: PagedBlockSizes | None, tokens: int, slots: int, group: int) -> int:
    """The query block of a ``ragged_paged_attention`` call with block sizes ``explicit``:
    their ``block_q`` when set; else 1 (every token its own item or row) when they ask
    for ``k_splits > 1`` or the call has no more query tokens than sequence slots
    (``tokens <= slots``: a decode or verification batch, the only static fact about
    the batch's query lengths; which kernel then runs: :func:`multi_page_decode`); else
    the power of two nearest below ``TARGET_QUERY_ROWS / group`` (at least 1, at most the
    tokens rounded up to a power of two): a query tile of about 128 rows of ``block_q`` tokens x ``group``
    query heads, so each page is read once per 128 / group tokens."""
    if explicit is not None and explicit.block_q is not None:
        return explicit.block_q
    if tokens <= slots or (explicit is not None and explicit.k_splits > 1):
        return 1
    per = max(1, TARGET_QUERY_ROWS // max(group, 1))
    return max(1, min(1 << (per.bit_length() - 1), pl.next_power_of_2(tokens)))


# Key and value tile bytes up to which decode runs on the query-blocked kernel's tiles.
MULTI_PAGE_TILE_BYTES = 64 * 1024


def multi_page_decode(explicit: PagedBlockSizes | None, loop_walk: bool, tile_bytes: int,
                      float32_gpu: bool = False) -> bool:
    """Whether a decode call (``paged_attention``, or ``ragged_paged_attention`` with a
    query block of 1) runs the query-blocked kernel (:mod:`ops.serving.prefill_kernels`: key tiles gathered from
    several pages, one online-softmax update per tile) rather than the per-page split-KV
    decode kernel (:mod:`ops.serving.kernels`: one update per page): on the loop walk
    (the interpreter and both Triton lowerings) when its key and value tiles take at
    most :data:`MULTI_PAGE_TILE_BYTES` (``tile_bytes``) and the products are not of
    float32 tiles on a GPU (``float32_gpu``: no tensor cores, both kernels spill, the
    per-page one less: 13084 against 23795 instructions per 128 keys at head dim 64),
    unless ``explicit`` sets ``block_q`` (an explicit 1 asks the ragged op for the
    per-page kernel). Both keep split-KV.

    At sm_90, H 128, GQA 8:1 (query tiles of 64 rows), bf16, decode batches of 1, 8
    and 64 x 8k tokens, SASS instructions per thread per 128 keys of the loop: with
    16-token pages 1970 in the per-page kernel (eight one-page updates, 15.4 per key)
    against 603 in the query-blocked kernel (4.7 per key; 1083 on the one masked tile at
    the range's end); 32-token pages 1421 against 604; 64, 1163 against 604; 128-token
    pages 1067 against 603; ``paged_attention``'s separate key and value pages, 16 tokens,
    1947 against 539. The per-page kernel stays where the tiles would not fit:
    pages of 256 tokens (a 256-key tile: 273 KiB of shared memory, over sm_90's 227),
    head dim 256 (289 KiB and spills) and float32 queries at head dim 128 (256 KiB);
    and on Mosaic TPU, whose grid walk places pages by BlockSpecs (no gathers)."""
    if explicit is not None and explicit.block_q is not None:
        return False
    return loop_walk and tile_bytes <= MULTI_PAGE_TILE_BYTES and not float32_gpu
