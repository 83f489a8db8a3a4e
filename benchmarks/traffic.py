"""How often a kernel touches each element of global memory, counted in Triton's interpreter.

The static gate (:mod:`benchmarks.static`) needs, for a memory-bound kernel,
the number of passes it makes over its input: the figure its design states
(a row normalised in one chunk is read once; a row longer than a chunk is
read twice, once for its statistics and once for the output). That is a
property of the generated program's loads, not of timing, so it is counted
where every load is visible: our ``triton`` backend runs the generated kernel
in Triton's CPU interpreter, and :func:`count_traffic` wraps the
interpreter's masked load and store (the ones every ``tl.load`` /
``tl.store`` reaches) to count, per kernel, the elements accessed (lanes the
mask keeps, as a GPU would access them) and the distinct addresses among
them.

``reads_per_element = elements loaded / distinct elements loaded``: 1 for a
kernel that reads each input element once, 2 for two passes. One program's
worth of rows is enough (the count per element is the same for every
program), which keeps model-size rows (128256 classes) cheap to count.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses

import numpy as np


@dataclasses.dataclass
class KernelTraffic:
    """Global-memory accesses of one kernel (summed over its launches).

    Attributes:
      loads, stores: elements accessed (masked-off lanes not counted).
      load_addresses, store_addresses: arrays of the distinct addresses seen.
    """

    loads: int = 0
    stores: int = 0
    load_addresses: list = dataclasses.field(default_factory=list)
    store_addresses: list = dataclasses.field(default_factory=list)

    @staticmethod
    def _distinct(chunks) -> int:
        return int(np.unique(np.concatenate(chunks)).size) if chunks else 0

    @property
    def reads_per_element(self) -> float | None:
        distinct = self._distinct(self.load_addresses)
        return self.loads / distinct if distinct else None

    @property
    def writes_per_element(self) -> float | None:
        distinct = self._distinct(self.store_addresses)
        return self.stores / distinct if distinct else None


@contextlib.contextmanager
def count_traffic():
    """Within the block, every interpreted triton kernel's loads and stores are counted.

    Yields a dict ``kernel name -> KernelTraffic``, filled as kernels run
    (run them, e.g. ``jax.block_until_ready``, inside the block). Applies to
    kernels launched by :mod:`pallas_core.triton.runtime` on a host without a GPU.
    """
    from triton.runtime import interpreter

    from pallas_core.triton import runtime

    builder = interpreter.InterpreterBuilder
    traffic: dict[str, KernelTraffic] = collections.defaultdict(KernelTraffic)
    current: list[str] = []
    original_load, original_store = builder.create_masked_load, builder.create_masked_store
    original_launch = runtime.launch_interpreted

    def record(kind, ptrs, mask):
        if not current:
            return
        keep = np.broadcast_to(np.asarray(mask.data, bool), np.shape(ptrs.data))
        addresses = np.asarray(ptrs.data)[keep].astype(np.uint64).ravel()
        entry = traffic[current[-1]]
        if kind == "load":
            entry.loads += addresses.size
            entry.load_addresses.append(np.unique(addresses))
        else:
            entry.stores += addresses.size
            entry.store_addresses.append(np.unique(addresses))

    def load(self, ptrs, mask, other, *args):
        record("load", ptrs, mask)
        return original_load(self, ptrs, mask, other, *args)

    def store(self, ptrs, value, mask, *args):
        record("store", ptrs, mask)
        return original_store(self, ptrs, value, mask, *args)

    def launch(kernel, **kwargs):
        current.append(getattr(getattr(kernel, "fn", kernel), "__name__", "kernel"))
        try:
            return original_launch(kernel, **kwargs)
        finally:
            current.pop()

    builder.create_masked_load, builder.create_masked_store = load, store
    runtime.launch_interpreted = launch
    try:
        yield traffic
    finally:
        builder.create_masked_load, builder.create_masked_store = original_load, original_store
        runtime.launch_interpreted = original_launch
