"""``ops.update_kv_pages``: new tokens' keys and values written into their cache pages in place."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import pallas_core as pl
from ops import _op
from ops._checks import check_same_dtype
from ops._partitioning import block_index, run
from ops.attention.tile_math import div, rem
from ops.serving import checks

_OP = "update_kv_pages"


def update_kv_pages(kv_pages, new_k, new_v, slot_mapping, *, implementation=None):
    """Writes ``T`` new tokens' keys and values into their slots of a paged cache.

    Slot ``s`` is token ``s % page_size`` of page ``s // page_size`` (vLLM's slot
    mapping). Each token's ``[heads, H]`` keys and values are written into the
    cache, an aliased output (``input_output_aliases``): nothing else of the
    cache is read or written, and under ``jax.jit`` with the cache donated
    (``donate_argnums``) no copy of it is made. How a token reaches its slot
    depends on the backend: one program per token through a BlockSpec whose
    index map reads the slot (scalar prefetch: ``interpret``, ``triton``, and
    ``mosaic_tpu`` for the combined layout); one program per head storing the
    tokens' rows at their slots, 16 tokens per step (``pallas_triton``, which
    has no scalar prefetch); or one DMA per token from HBM into the cache
    (``mosaic_tpu`` for the ``[K, P, page_size, H]`` layout, where one token's
    ``K`` rows lie ``page_size * H`` apart, a block below the TPU's (8, 128)
    tiling).

    On a device mesh the cache's heads and pages stay where they live; each device
    writes the tokens of its own heads into its own pages (docs/design.md §5.6).

    Args:
      kv_pages: the cache, either one array ``[total_pages, page_size, 2 * K, H]``
        (JAX's TPU ragged layout: keys at even, values at odd combined heads), or a
        pair ``(k_pages, v_pages)`` of ``[K, total_pages, page_size, H]`` (JAX's GPU
        paged layout).
      new_k, new_v: ``[T, K, H]``, the cache's dtype (quantize int8 caches first).
      slot_mapping: int32 ``[T]``; a negative slot (or one past the cache) skips
        the token (padding). Two tokens with one slot: either may win.
      implementation: None (the default: "xla" on a CPU; on a GPU the fastest
        measured implementation that can run the call, which
        ``ops.resolve_implementation`` names with its measurement; "mosaic_tpu"
        on a TPU; docs/design.md §5.2), "xla" (a scatter), "interpret", "triton",
        "pallas_triton" (a power-of-two
        head dim; NotImplementedError otherwise),
        "mosaic_tpu", or a sequence tried in order. "mosaic_gpu" raises
        NotImplementedError.

    Returns:
      The updated cache, in ``kv_pages``' structure.

    Raises:
      TypeError: non-arrays, dtypes differing from the cache's, slot_mapping not int32.
      ValueError: ranks and shapes, a pair of caches of different shapes, an unknown
        implementation.
    """
    combined = not isinstance(kv_pages, (tuple, list))
    pages = (kv_pages,) if combined else tuple(kv_pages)
    _check(pages, new_k, new_v, slot_mapping, combined)
    out = OP.run(implementation, pages=pages, new_k=new_k, new_v=new_v, slots=slot_mapping,
                 combined=combined)
    return out[0] if combined else type(kv_pages)(out)


def _check(pages, new_k, new_v, slots, combined: bool):
    if combined:
        layout = "[total_pages, page_size, 2 * K, H]"
        checks.check_rank(pages[0], "kv_pages", 4, layout, _OP)
        if pages[0].shape[2] % 2:
            raise ValueError(f"{_OP}: kv_pages must hold 2 * K combined heads {layout}; "
                             f"got {pages[0].shape[2]}.")
        K, H = pages[0].shape[2] // 2, pages[0].shape[3]
    else:
        layout = "[K, total_pages, page_size, H]"
        if len(pages) != 2:
            raise ValueError(f"{_OP}: kv_pages must be one array or a pair (k_pages, v_pages); "
                             f"got a sequence of {len(pages)}.")
        for name, x in zip(("kv_pages[0]", "kv_pages[1]"), pages):
            checks.check_rank(x, name, 4, layout, _OP)
        if tuple(pages[0].shape) != tuple(pages[1].shape):
            raise ValueError(f"{_OP}: k_pages and v_pages must have the same shape; got "
                             f"{tuple(pages[0].shape)} and {tuple(pages[1].shape)}.")
        check_same_dtype(pages[1], pages[0], "kv_pages[1]", "kv_pages[0]", _OP)
        K, H = pages[0].shape[0], pages[0].shape[3]
    checks.check_int32(slots, "slot_mapping", (None,), "[T]", _OP)
    T = slots.shape[0]
    for name, x in (("new_k", new_k), ("new_v", new_v)):
        checks.check_rank(x, name, 3, "[T, K, H]", _OP)
        if tuple(x.shape) != (T, K, H):
            raise ValueError(f"{_OP}: {name} must have shape {(T, K, H)} [T, K, H] (T from "
                             f"slot_mapping, K and H from the cache); got {tuple(x.shape)}.")
        check_same_dtype(x, pages[0], name, "the cache", _OP)


def _geometry(pages, combined: bool):
    """``(total_pages, page_size)``."""
    return pages[0].shape[:2] if combined else pages[0].shape[1:3]


def _run(pages, new_k, new_v, slots, combined: bool, impl: str):
    T = slots.shape[0]
    if T == 0 or pages[0].size == 0:
        return pages
    if impl == "xla":
        P, ps = _geometry(pages, combined)
        valid = (slots >= 0) & (slots < P * ps)
        page = jnp.where(valid, slots // ps, P)  # P: out of bounds, dropped
        off = jnp.where(valid, slots % ps, 0)
        if combined:
            new = _interleaved(new_k, new_v)
            return (pages[0].at[page, off].set(new, mode="drop"),)
        return tuple(x.at[:, page, off].set(jnp.swapaxes(n, 0, 1), mode="drop")
                     for x, n in zip(pages, (new_k, new_v)))
    return _partitioned(pages, new_k, new_v, slots, combined, impl)


# Multi-device (ops._partitioning): the cache's heads ("k") and pages ("p") stay where
# they live, and so does every written block. Each device writes the tokens of its own
# heads into its own pages: a slot names a global page, so the slots are localised (minus
# the device's first page times page_size; slots of other devices' pages become padding
# and are skipped). The new tokens ("t"), the page size ("s") and the head dim ("h") are
# gathered: every device needs every token's slot and its heads' whole rows.

def _partitioned(pages, new_k, new_v, slots, combined: bool, impl: str):
    n = len(pages)
    page_dims = ("p s (k two) h",) if combined else ("k p s h",) * 2

    def local(*arrays, reduced):
        local_pages, (k, v, local_slots) = arrays[:n], arrays[n:]
        P, ps = _geometry(local_pages, combined)
        local_slots = local_slots - block_index(reduced, "p") * (P * ps)
        return _kernel_write(local_pages, k, v, local_slots, combined, impl)

    return run(_OP, local, (*pages, new_k, new_v, slots), (*page_dims, "t k h", "t k h", "t"),
               page_dims, gather=("t", "s", "h"), reduce=("p",), out_like=tuple(range(n)))


def _kernel_write(pages, new_k, new_v, slots, combined: bool, impl: str):
    """The kernel's write of one device's block of the cache (slots local to it)."""
    P, ps = _geometry(pages, combined)
    valid = (slots >= 0) & (slots < P * ps)
    slots, new_k, new_v = _padding_rewritten(pages, new_k, new_v, slots, valid, combined)
    if combined:
        return _write(impl, combined, ps, pages, (_interleaved(new_k, new_v),), slots)
    return _write(impl, combined, ps, pages, (new_k, new_v), slots)


def _interleaved(k, v):
    """``[T, K, H]`` keys and values as ``[T, 2K, H]``: key ``h`` at ``2h``, value at ``2h + 1``."""
    T, K, H = k.shape
    return jnp.stack([k, v], axis=2).reshape(T, 2 * K, H)


def _padding_rewritten(pages, new_k, new_v, slots, valid, combined: bool):
    """Skipped tokens rewritten as copies of a real write (the first valid token's slot and
    data), or, with none valid, as slot 0 rewritten with its own contents: every program
    then writes a block, and two programs writing one slot write the same bytes."""
    any_valid = jnp.any(valid)
    first = jnp.argmax(valid)
    if combined:
        old_k, old_v = pages[0][0, 0, 0::2], pages[0][0, 0, 1::2]
    else:
        old_k, old_v = pages[0][:, 0, 0], pages[1][:, 0, 0]
    fill_slot = jnp.where(any_valid, slots[first], 0)
    slots = jnp.where(valid, slots, fill_slot)
    out = []
    for new, old in ((new_k, old_k), (new_v, old_v)):
        fill = jnp.where(any_valid, new[first], old)
        out.append(jnp.where(valid[:, None, None], new, fill[None]))
    return slots, out[0], out[1]


def _write_kernel(slots_ref, *refs, n: int):
    del slots_ref  # read by the index maps
    news, outs = refs[:n], refs[2 * n:]
    for new, out in zip(news, outs):
        out[...] = new[...]


def _write(impl: str, combined: bool, ps: int, pages, news, slots):
    traits = pl.backend_traits(impl)
    if not traits.scalar_prefetch:
        return _write_by_stores(impl, combined, ps, pages, news, slots)
    if not combined and traits.tile != (1, 1):
        return _write_by_dma(impl, ps, pages, news, slots)
    n = len(pages)
    blk_new = news[0].shape[1:]
    new_spec = pl.BlockSpec((None,) + blk_new, lambda t, s: (t, 0, 0))
    if combined:
        out_spec = pl.BlockSpec((None, None) + blk_new,
                                lambda t, s: (div(s[t], ps), rem(s[t], ps), 0, 0))
    else:
        K, H = blk_new
        out_spec = pl.BlockSpec((K, None, None, H), lambda t, s: (0, div(s[t], ps), rem(s[t], ps), 0))
    # The aliased cache comes in blocked as the output (the kernel never reads it; a
    # TPU copies in one [heads, H] block per token, nothing more).
    grid_spec = pl.tpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1, grid=(slots.shape[0],), in_specs=[new_spec] * n + [out_spec] * n,
        out_specs=[out_spec] * n)
    params = (pl.triton.CompilerParams(num_warps=1, dimension_semantics=("parallel",))
              if traits.triton else pl.CompilerParams(("parallel",)))
    return tuple(pl.pallas_call(
        functools.partial(_write_kernel, n=n),
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in pages], grid_spec=grid_spec,
        input_output_aliases={1 + n + i: i for i in range(n)}, compiler_params=params,
        backend=impl, name="update_kv_pages",
    )(slots, *news, *pages))


def _aliased_call(kernel, impl: str, pages, operands, params, **grid):
    """``pallas_call`` of ``kernel`` returning the caches, which come last in ``operands``
    and are aliased to the results (``grid``: ``grid_spec``, or ``grid`` and the specs)."""
    n, first = len(pages), len(operands) - len(pages)
    return tuple(pl.pallas_call(
        kernel, out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in pages],
        input_output_aliases={first + i: i for i in range(n)}, compiler_params=params,
        backend=impl, name="update_kv_pages", **grid,
    )(*operands))


# Tokens one program stores per step of its loop (one scatter of [chunk, H]).
STORE_CHUNK = 16


def _store_kernel(slots_ref, *refs, n: int, ps: int, chunk: int):
    """Program ``h`` stores head ``h`` of every token at its slot, ``chunk`` tokens per
    step (one ``[chunk, H]`` scatter into the head's ``[P, page_size, H]`` block)."""
    news, outs = refs[:n], refs[2 * n:]
    h = pl.program_id(0)

    def store(c, carry):
        rows = pl.ds(pl.multiple_of(c * chunk, chunk), chunk)
        slot = slots_ref[rows]
        page, off = div(slot, ps), rem(slot, ps)
        for new, out in zip(news, outs):
            out[page, off] = new[rows, h]
        return carry

    jax.lax.fori_loop(0, slots_ref.shape[0] // chunk, store, 0)


def _write_by_stores(impl: str, combined: bool, ps: int, pages, news, slots):
    """The write for backends without scalar prefetch (JAX's Triton lowering): one program
    per head (of the ``2K`` combined heads, or of ``K`` for both caches) owning that head's
    ``[P, page_size, H]`` block of the aliased caches, storing its rows of ``STORE_CHUNK``
    tokens per step at their slots (loaded as a vector from the whole slot table). The
    tokens are padded to a multiple of the chunk with copies of the last one (the same
    bytes written twice); nothing else of the caches is read or written."""
    T, heads, H = news[0].shape
    if pl.backend_traits(impl).power_of_two_blocks and H & (H - 1):
        raise NotImplementedError(
            f"{_OP}: implementation={impl!r} needs a power-of-two head dim; got {H}.")
    chunk = STORE_CHUNK
    pad = -T % chunk
    if pad:
        slots = jnp.concatenate([slots, jnp.broadcast_to(slots[-1:], (pad,))])
        news = tuple(jnp.concatenate([x, jnp.broadcast_to(x[-1:], (pad,) + x.shape[1:])])
                     for x in news)
    n, whole = len(pages), pl.BlockSpec(memory_space=pl.ANY)
    P = _geometry(pages, combined)[0]
    if combined:
        out_spec = pl.BlockSpec((P, ps, None, H), lambda h: (0, 0, h, 0))
    else:
        out_spec = pl.BlockSpec((None, P, ps, H), lambda h: (h, 0, 0, 0))
    return _aliased_call(
        functools.partial(_store_kernel, n=n, ps=ps, chunk=chunk), impl, pages,
        (slots, *news, *pages), pl.triton.CompilerParams(num_warps=4), grid=(heads,),
        in_specs=[whole] * (1 + 2 * n), out_specs=[out_spec] * n)


def _dma_kernel(slots_ref, *refs, n: int, ps: int):
    """One token's ``[K, 1, 1, H]`` copied by DMA to its slot of each ``[K, P, ps, H]`` cache."""
    news, outs, sems = refs[:n], refs[2 * n:3 * n], refs[3 * n]
    t = pl.program_id(0)
    slot = slots_ref[t]
    page, off = div(slot, ps), rem(slot, ps)
    copies = [pl.tpu.make_async_copy(new.at[t], out.at[:, pl.ds(page, 1), pl.ds(off, 1)],
                                     sems.at[i]) for i, (new, out) in enumerate(zip(news, outs))]
    for copy in copies:
        copy.start()
    for copy in copies:
        copy.wait()


def _write_by_dma(impl: str, ps: int, pages, news, slots):
    """The split layout on a TPU: one token of a ``[K, P, page_size, H]`` cache is ``K`` rows
    ``page_size * H`` apart, a ``[K, 1, H]`` block below the (8, 128) tiling, so each program
    copies its token's keys and values from HBM straight into the aliased caches by DMA
    (``[T, K, 1, 1, H]`` views of the new tokens; nothing else of the caches is touched)."""
    n, whole = len(pages), pl.BlockSpec(memory_space=pl.ANY)
    T, K, H = news[0].shape
    grid_spec = pl.tpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1, grid=(T,), in_specs=[whole] * (2 * n), out_specs=[whole] * n,
        scratch_shapes=[pl.tpu.SemaphoreType.DMA((n,))])
    return _aliased_call(
        functools.partial(_dma_kernel, n=n, ps=ps), impl, pages,
        (slots, *(x.reshape(T, K, 1, 1, H) for x in news), *pages),
        pl.CompilerParams(("arbitrary",)), grid_spec=grid_spec)


# --------------------------------------------------------------------------
# Registration with the op layer (no config: the write has no tiles to choose)
# --------------------------------------------------------------------------

def _entry(impl, pages, new_k, new_v, slots, combined):
    return _run(pages, new_k, new_v, slots, combined, impl)


def _problem_of(pages, new_k, combined, **_):
    """The call's problem ``(tokens, kv_heads, head_dim, page_size)``."""
    T, K, H = new_k.shape
    return (T, K, H, _geometry(pages, combined)[1]), new_k.dtype, None


def _reference(kv_pages, new_k, new_v, slot_mapping):
    """The XLA scatter (the ``"xla"`` implementation)."""
    return update_kv_pages(kv_pages, new_k, new_v, slot_mapping, implementation="xla")


def _power_of_two_head_dim(call) -> str | None:
    H = call.args["new_k"].shape[-1]
    return None if not H & (H - 1) else f"needs a power-of-two head dim; got {H}"


OP = _op.register(_op.Op(
    name=_OP, dims=("tokens", "kv_heads", "head_dim", "page_size"),
    configs=dict.fromkeys(("interpret", "triton", "pallas_triton", "mosaic_tpu")),
    reference=_reference, entry=_entry, problem_of=_problem_of, function=update_kv_pages,
    supported={"pallas_triton": _power_of_two_head_dim},
    missing_reason=" (mosaic_gpu: no kernel for it yet; use 'triton' or 'pallas_triton')"))
