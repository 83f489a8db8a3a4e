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

Accesses are attributed to the kernel's operands by address (each operand is
one buffer the runtime hands the interpreter). ``reads_per_element`` is,
for the kernel's largest input (the activations, not a ``[features]`` scale
or a per-row statistic), elements loaded over distinct elements loaded: 1
for a kernel that reads its input once, 2 for two passes. One program's worth
of rows is enough (the count per element is the same for every program),
which keeps model-size rows (128256 classes) cheap to count.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses

import numpy as np

from benchmarks.harness import require_triton

# Everything here runs in Triton's interpreter; so does the static gate, which imports this.
require_triton("benchmarks.traffic (and python -m benchmarks.static)")


@dataclasses.dataclass
class OperandTraffic:
    """Accesses to one operand buffer: elements loaded / stored (masked-off lanes not
    counted) and the distinct addresses among them."""

    loads: int = 0
    stores: int = 0
    load_addresses: list = dataclasses.field(default_factory=list)
    store_addresses: list = dataclasses.field(default_factory=list)

    @staticmethod
    def distinct(chunks) -> int:
        return int(np.unique(np.concatenate(chunks)).size) if chunks else 0


@dataclasses.dataclass
class KernelTraffic:
    """Global-memory accesses of one kernel (summed over its launches), per operand
    index (inputs first, then outputs, in the kernel's parameter order)."""

    operands: dict = dataclasses.field(
        default_factory=lambda: collections.defaultdict(OperandTraffic))

    def _per_element(self, kind: str) -> float | None:
        touched = {i: OperandTraffic.distinct(getattr(o, f"{kind}_addresses"))
                   for i, o in self.operands.items()}
        largest = max(touched.values(), default=0)
        if not largest:
            return None
        return max(getattr(self.operands[i], f"{kind}s") / n for i, n in touched.items()
                   if n == largest)

    @property
    def reads_per_element(self) -> float | None:
        """Loads per distinct element loaded, of the largest operand(s) read."""
        return self._per_element("load")

    @property
    def writes_per_element(self) -> float | None:
        """Stores per distinct element stored, of the largest operand(s) written."""
        return self._per_element("store")


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
    buffers: list[tuple[int, int]] = []  # (start, end) address of each operand of the launch
    original_load, original_store = builder.create_masked_load, builder.create_masked_store
    original_launch, original_to_torch = runtime.launch_interpreted, runtime._to_torch

    def owners(lanes):
        """The operand index each address falls in (-1: none of the launch's buffers)."""
        starts = np.array([b[0] for b in buffers], np.uint64)
        ends = np.array([b[1] for b in buffers], np.uint64)
        order = np.argsort(starts)
        pos = np.clip(np.searchsorted(starts[order], lanes, side="right") - 1, 0, None)
        inside = (lanes >= starts[order][pos]) & (lanes < ends[order][pos])
        return np.where(inside, order[pos], -1)

    def record(kind, ptrs, mask):
        if not current or not buffers:
            return
        keep = np.broadcast_to(np.asarray(mask.data, bool), np.shape(ptrs.data))
        lanes = np.asarray(ptrs.data)[keep].astype(np.uint64).ravel()
        owner = owners(lanes)
        kernel = traffic[current[-1]]
        for i in np.unique(owner[owner >= 0]):
            mine = lanes[owner == i]
            entry = kernel.operands[int(i)]
            if kind == "load":
                entry.loads += mine.size
                entry.load_addresses.append(np.unique(mine))
            else:
                entry.stores += mine.size
                entry.store_addresses.append(np.unique(mine))

    def load(self, ptrs, mask, other, *args):
        record("load", ptrs, mask)
        return original_load(self, ptrs, mask, other, *args)

    def store(self, ptrs, value, mask, *args):
        record("store", ptrs, mask)
        return original_store(self, ptrs, value, mask, *args)

    def to_torch(array):
        tensor = original_to_torch(array)
        if current:
            start = tensor.data_ptr()
            buffers.append((start, start + tensor.numel() * tensor.element_size()))
        return tensor

    def launch(kernel, **kwargs):
        current.append(getattr(getattr(kernel, "fn", kernel), "__name__", "kernel"))
        buffers.clear()
        try:
            return original_launch(kernel, **kwargs)
        finally:
            current.pop()

    builder.create_masked_load, builder.create_masked_store = load, store
    runtime.launch_interpreted, runtime._to_torch = launch, to_torch
    try:
        yield traffic
    finally:
        builder.create_masked_load, builder.create_masked_store = original_load, original_store
        runtime.launch_interpreted, runtime._to_torch = original_launch, original_to_torch
