"""Block dims other than a plain int, and how a block is buffered (JAX 0.10.2's names).

A ``BlockSpec``'s ``block_shape`` holds one entry per array dim:

* an int ``b`` (or ``Blocked(b)``): the index map returns a *block* index ``i``;
  the block starts at element ``i * b``;
* ``None`` or ``squeezed`` (``Squeezed()``): a block of size 1 whose dim the
  kernel's Ref drops; the index map returns the element index;
* ``Element(b, padding=(low, high))``: the index map returns an *element*
  index into the array virtually padded by ``low`` / ``high`` elements (the
  padding reads as unspecified values: NaN / the integer minimum on the
  interpreter);
* ``BoundedSlice(b)``: the index map returns ``pl.ds(start, size)`` with
  ``size <= b``, both possibly traced; the kernel's Ref has ``b`` elements
  along the dim, of which the first ``size`` are the array's
  ``[start, start + size)`` and the rest unspecified, and only those ``size``
  are written back for an output.

``Buffered(buffer_count)`` is a BlockSpec's ``pipeline_mode``: how many
buffers a pipelining backend (Mosaic TPU) keeps for the operand. It does not
change what a kernel computes, so the interpreter and our Triton lowering
accept and ignore it. JAX 0.11's ``prefetched_count`` (buffers filled before a
pipeline starts, handed to JAX's ``emit_pipeline``) is accepted at its default, 0.
"""
from __future__ import annotations

import dataclasses
import enum

import numpy as np


def _positive_int(value, what: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise TypeError(f"{what}: expected a positive int, got {value!r}.")
    return int(value)


@dataclasses.dataclass(frozen=True)
class Squeezed:
    """A block dim of size 1 that the kernel's Ref drops (same as ``None``)."""


squeezed = Squeezed()


@dataclasses.dataclass(frozen=True)
class Element:
    """A block dim of ``block_size`` elements whose index map gives element offsets.

    Args:
      block_size: positive int, the block's extent along the dim.
      padding: ``(low, high)`` non-negative ints: the array is read as if padded
        by that many unspecified elements before / after, so an index map may
        return ``-low`` .. ``dim + high - 1``.

    Raises:
      TypeError / ValueError: a block size that is not a positive int, or a
        padding that is not a pair of non-negative ints.
    """

    block_size: int
    padding: tuple[int, int] = (0, 0)

    def __post_init__(self):
        object.__setattr__(self, "block_size", _positive_int(self.block_size, "Element(block_size)"))
        try:
            low, high = (int(p) for p in self.padding)
        except (TypeError, ValueError):
            raise ValueError(f"Element(padding={self.padding!r}): expected a (low, high) pair "
                             "of non-negative ints.") from None
        if low < 0 or high < 0:
            raise ValueError(f"Element(padding={self.padding!r}): padding must be non-negative.")
        object.__setattr__(self, "padding", (low, high))


@dataclasses.dataclass(frozen=True)
class BoundedSlice:
    """A block dim of at most ``block_size`` elements; the index map returns ``pl.ds(start, size)``.

    Raises:
      TypeError: a block size that is not a positive int.
    """

    block_size: int

    def __post_init__(self):
        object.__setattr__(self, "block_size",
                           _positive_int(self.block_size, "BoundedSlice(block_size)"))


class RevisitMode(enum.Enum):
    """How a pipelining backend treats an output block visited again later."""

    IMMEDIATE = "immediate"
    ANY = "any"


@dataclasses.dataclass(frozen=True)
class Buffered:
    """A BlockSpec's ``pipeline_mode``: the number of pipeline buffers for its operand.

    Args:
      buffer_count: positive int (2 is double buffering, every backend's default).
      use_lookahead: let the pipeline fetch the next different block as soon as
        a buffer is free (Mosaic TPU).
      revisit: a :class:`RevisitMode` or None, for outputs (Mosaic TPU).
      prefetched_count: JAX 0.11's number of buffers already filled when the
        pipeline starts; only 0 (pallas_call fetches every block itself).

    Raises:
      TypeError: a buffer count that is not a positive int, a prefetched count
        that is not a non-negative int, or a bad revisit.
      NotImplementedError: a prefetched count above 0: JAX gives it meaning only
        in ``pltpu.emit_pipeline`` (buffers passed in with its allocations), which
        pallas_core does not provide.
    """

    buffer_count: int
    use_lookahead: bool = False
    revisit: RevisitMode | None = None
    prefetched_count: int = 0

    def __post_init__(self):
        object.__setattr__(self, "buffer_count",
                           _positive_int(self.buffer_count, "Buffered(buffer_count)"))
        if self.revisit is not None and not isinstance(self.revisit, RevisitMode):
            raise TypeError(f"Buffered(revisit={self.revisit!r}): expected a RevisitMode or None.")
        count = self.prefetched_count
        if isinstance(count, (bool, np.bool_)) or not isinstance(count, (int, np.integer)) or count < 0:
            raise TypeError(f"Buffered(prefetched_count={count!r}): expected a non-negative int.")
        if count:
            raise NotImplementedError(
                f"Buffered(prefetched_count={count}): pre-filled pipeline buffers are JAX's "
                "pltpu.emit_pipeline's (passed in with its allocations), which pallas_core does "
                "not provide; a pallas_call fetches every block itself (use 0, the default).")
        object.__setattr__(self, "prefetched_count", int(count))
