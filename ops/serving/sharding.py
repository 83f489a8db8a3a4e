"""The paged attention ops on a device mesh (:mod:`ops._partitioning`, docs/design.md §5.6).

Tensor-parallel serving shards the query heads and the cache's key/value heads
over one mesh axis; each device then attends with its own heads to its own
slice of the cache, and nothing moves. The rule of both ops:

* heads are kept, split by key/value head (``N = K * G``: the query is seen as
  ``[rows, K, G, H]``, so a GQA group stays with its key/value head; where
  ``K`` does not divide the axis, a split of the query heads alone keeps the
  whole cache on every device and splits the groups);
* ``ops.paged_attention``'s batch is kept with its ``block_tables`` rows and
  ``lengths`` (a data-parallel split of the sequences, against a cache every
  device holds);
* the pages (``total_pages``), the page size and the head dim are gathered: a
  page table holds global page numbers, and a sequence's pages may lie on any
  device. Keeping pages sharded would need a device to attend to the pages it
  holds and the partial results to be merged across devices by their
  logsumexps (a context-parallel decode), which the kernels do not expose;
* ``ops.ragged_paged_attention``'s query tokens and all its metadata are
  gathered: which sequence a token belongs to, and the prefill kernel's query
  blocks, follow from the global ``cu_q_lens``.

The XLA implementation is left to XLA's own partitioner.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from ops._partitioning import reshape, run


_PAGED = {"k": "k p s h", "v": "k p s h", "tables": "b pp", "lengths": "b", "k_scales": "k p s",
          "v_scales": "k p s"}
_RAGGED = {"kv": "p s (k two) h", "kv_lens": "sq", "tables": "sq pp", "cu": "sq1",
           "num_seqs": "one"}


def paged_attention(run_on: Callable, args: dict, impl: str):
    """``ops.paged_attention``'s ``run_on(args, impl)`` on a mesh: batch and heads kept."""
    if impl == "xla":
        return run_on(args, impl)
    return run_by_heads("paged_attention", lambda a: run_on(a, impl), args, _PAGED,
                        kv_heads=args["k"].shape[0], rows="b", gather=("p", "s", "h", "pp"))


def ragged_paged_attention(run_on: Callable, args: dict, impl: str):
    """``ops.ragged_paged_attention``'s ``run_on(args, impl)`` on a mesh: heads kept."""
    if impl == "xla":
        return run_on(args, impl)
    return run_by_heads("ragged_paged_attention", lambda a: run_on(a, impl), args, _RAGGED,
                        kv_heads=args["kv"].shape[2] // 2, rows="t",
                        gather=("t", "p", "s", "h", "sq", "pp", "sq1"))


def run_by_heads(op: str, fn: Callable, args: dict, dims: Mapping[str, str], *, kv_heads: int,
                 rows: str, gather: Sequence[str]):
    """``fn(args)`` partitioned over the mesh ``args``' arrays live on.

    Args:
      op: the public op's name (for messages).
      fn: the op's computation on one device's blocks: takes ``args`` with each array
        replaced by its block, returns ``[rows, N, H]`` like ``args["q"]``.
      args: the checked arguments: ``"q"`` ``[rows, N, H]``, ``"sinks"`` ``[N]`` or
        None, the arrays named in ``dims`` and static values, passed through.
      dims: each further array's factor signature (``"k"`` is the key/value heads;
        ``"two"``, minor in ``"(k two)"``, a combined cache's key/value pair).
      kv_heads: ``K``, the cache's key/value heads.
      rows: the factor name of the query's rows (kept unless in ``gather``).
      gather: the factors the kernels need whole.

    Returns:
      ``fn``'s result as a global array, ``[rows, N, H]``.
    """
    q, sinks = args["q"], args["sinks"]
    R, N, H = q.shape
    K = kv_heads
    if q.size == 0 or K == 0:
        return fn(args)
    G = N // K
    names = ("q", "sinks", *dims)
    arrays = (reshape(q, (R, K, G, H)), None if sinks is None else reshape(sinks, (K, G)),
              *(args[name] for name in dims))
    query = f"{rows} k g h"

    def local(*blocks, reduced):
        del reduced  # nothing is reduced: every kept factor stays in the output
        block = dict(args, **dict(zip(names, blocks)))
        r, k, g, h = block["q"].shape
        block["q"] = block["q"].reshape(r, k * g, h)
        if block["sinks"] is not None:
            block["sinks"] = block["sinks"].reshape(k * g)
        return (fn(block).reshape(r, k, g, h),)

    (out,) = run(op, local, arrays, (query, "k g", *dims.values()), (query,), gather=gather)
    return reshape(out, (R, N, H))
