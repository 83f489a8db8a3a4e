"""Tensor descriptors (TMA on sm_90+) for block loads and stores: when, and their source.

With ``CompilerParams(tma=True)`` our Triton lowering reads and writes a Ref
view through ``tl.make_tensor_descriptor`` whenever the hardware's
tensor-memory accelerator can move it as one box (CUDA programming guide,
"Tensor Memory Access"; ``cuTensorMapEncodeTiled``'s limits):

* an operand in global memory (not scratch), of a dtype of 1, 2, 4 or 8
  bytes, at most 5 dims, every stride but the last a multiple of 16 bytes
  (the base pointer is 16-byte aligned: XLA's buffers are);
* a view of Ranges of stride 1 and power-of-two sizes of at most 256
  (Triton tensors have power-of-two dims, TMA boxes at most 256 per dim) and
  fixed indices (box size 1); the last array dim a Range of at least 16 bytes
  starting at its block's origin or a static multiple of 16 bytes past it (a
  piece of the block, ``ref.at[:, pl.ds(64, 64)]``), so the box start is
  16-byte aligned;
* no gather, no user mask, no cache hints (a descriptor access takes none);
* a buffer the kernel only reads or only writes (the writer's
  ``_check_descriptors``: TMA stores complete asynchronously and pointer
  stores are not ordered with TMA reads, so a revisited output block or an
  aliased operand keeps pointers).

A box whose size-1 dims are fixed indices (a squeezed block dim: the batch
and head of an attention block ``[1, T, 1, D]``) is described without them
when those indices do not change inside the loops around the access
(:class:`LoopScopes`): the descriptor is made at the access, over the kept
dims, from the operand's address plus the fixed indices' offset (a multiple
of 16 bytes: every stride but the last is), so the kernel loads and stores a
2-D tile instead of reshaping a 4-D one through registers; Triton hoists it
out of the loop. Otherwise the descriptor covers every dim and is made once,
ahead of the kernel's loops.

Blocks that run past the array's edge qualify: the descriptor knows the
array's shape and the hardware zero-fills reads and drops writes outside it,
which is what our edge masks do (docs/design.md §4). Every other view keeps pointer
loads and stores. Before sm_90 Triton rewrites descriptors into pointer
accesses, so the same source compiles for every target.

Where ``CompilerParams(tma=...)`` is left unset (every op of this library
leaves it so), the library default decides: :func:`tma_enabled`, off unless
the environment variable ``PALLAS_CORE_TRITON_TMA`` is ``1`` (``true``,
``on``) or a :func:`enable_tma` block is in force when the kernel is traced.
Kernels with descriptors launch on a GPU through the global scratch of
:mod:`pallas_core.triton.global_scratch`.
"""
from __future__ import annotations

import contextlib
import contextvars
import os
import re

import numpy as np

_MAX_BOX = 256
_MAX_RANK = 5
_ALIGN = 16  # bytes
MAKE = "tl.make_tensor_descriptor("  # how a kernel's source makes one


def tma_box(array_shape, dtype, dims, origin_last: str, plain: bool) -> tuple[int, ...] | None:
    """The descriptor box of a view, or None where pointers must stay.

    Args:
      array_shape: the operand's shape.
      dtype: its element type.
      dims: the view's dims, one per array dim: an object with ``start``,
        ``size``, ``stride`` and ``axis`` (a kept range), a str (a fixed
        index) or anything else (a gather).
      origin_last: the start expression of the block's last dim, before any
        ``.at`` view.
      plain: whether the access has no user mask and no hints.
    """
    itemsize = np.dtype(dtype).itemsize
    rank = len(array_shape)
    if not plain or not 1 <= rank <= _MAX_RANK or np.dtype(dtype) == np.bool_ or itemsize not in (1, 2, 4, 8):
        return None
    stride = 1
    for d in reversed(range(rank - 1)):
        stride *= array_shape[d + 1]
        if stride * itemsize % _ALIGN:
            return None
    box = []
    for dim in dims:
        if isinstance(dim, str):
            box.append(1)
        elif hasattr(dim, "size") and hasattr(dim, "stride"):
            size = dim.size
            if dim.stride != 1 or dim.axis is not None or size & (size - 1) or size > _MAX_BOX:
                return None
            box.append(size)
        else:
            return None
    last = dims[-1]
    if isinstance(last, str) or not _aligned_start(last.start, origin_last, itemsize) \
            or box[-1] * itemsize < _ALIGN:
        return None
    return tuple(box)


def _aligned_start(start: str, origin: str, itemsize: int) -> bool:
    """Whether a view's last-dim ``start`` is its block's ``origin``, or the origin plus a
    static offset of a multiple of 16 bytes (a column piece of the block: a matmul's
    epilogue subtile stored half by half), so the box start stays 16-byte aligned."""
    if start == origin:
        return True
    piece = re.fullmatch(r"\((.*) \+ (\d+)\)", start)
    return bool(piece) and piece.group(1) == origin and int(piece.group(2)) * itemsize % _ALIGN == 0


def make_source(name: str, ptr: str, dim_names, strides, box) -> str:
    """``name = tl.make_tensor_descriptor(...)`` over the whole operand at ``ptr``."""
    return (f"{name} = {MAKE}{ptr}, shape=[{', '.join(dim_names)}], "
            f"strides=[{', '.join(strides)}], block_shape=[{', '.join(map(str, box))}])")


class LoopScopes:
    """Which names of a kernel's source change inside the loops open at the current line.

    The writer shows it every line it emits (:meth:`see`, with its indent);
    :meth:`invariant` then says whether expressions can be evaluated once
    outside every loop open now: each name they use is assigned outside those
    loops (names never assigned, such as constexprs, are constants).
    """

    _ASSIGNED = re.compile(r"^(\w+(?:, \w+)*) = ")
    _NAME = re.compile(r"[A-Za-z_]\w*")

    def __init__(self):
        self._open: list[tuple[int, int | None]] = []  # (indent, loop id or None) of open blocks
        self._defined: dict[str, frozenset[int]] = {}  # name -> the loops open where it is assigned
        self._loops = 0

    def _close(self, indent: int) -> frozenset[int]:
        while self._open and self._open[-1][0] >= indent:
            self._open.pop()
        return frozenset(loop for _, loop in self._open if loop is not None)

    def see(self, indent: int, line: str) -> None:
        """Records ``line``, emitted at ``indent``."""
        loops = self._close(indent)
        if assigned := self._ASSIGNED.match(line):
            for name in assigned.group(1).split(", "):
                self._defined[name] = loops
        head = line.split(" ", 1)[0].rstrip(":")
        if head in ("for", "while"):
            self._loops += 1
            self._open.append((indent, self._loops))
            if head == "for":
                self._defined[line.split()[1]] = loops | {self._loops}
        elif head in ("if", "elif", "else"):
            self._open.append((indent, None))

    def invariant(self, indent: int, exprs) -> bool:
        """Whether ``exprs``, written at ``indent``, use no name assigned inside an open loop."""
        loops = self._close(indent)
        return not any(self._defined.get(name, frozenset()) & loops
                       for expr in exprs for name in self._NAME.findall(expr))


ENV_VAR = "PALLAS_CORE_TRITON_TMA"
_ON, _OFF = ("1", "true", "on", "yes"), ("", "0", "false", "off", "no")
_OVERRIDE: contextvars.ContextVar[bool | None] = contextvars.ContextVar("pallas_core_tma", default=None)


def tma_enabled() -> bool:
    """The library default of ``CompilerParams.tma``: whether a kernel traced now
    whose params leave ``tma`` unset moves its blocks through tensor descriptors.

    The innermost :func:`enable_tma` block in force decides; outside any, the
    environment variable ``PALLAS_CORE_TRITON_TMA`` (``1``/``true``/``on`` or
    ``0``/``false``/``off``; unset: off). It is read when a kernel is traced:
    functions JAX has already traced (``jax.jit``'s cache) keep their kernels.

    Raises:
      ValueError: the environment variable holds anything else.
    """
    override = _OVERRIDE.get()
    if override is not None:
        return override
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if value in _ON or value in _OFF:
        return value in _ON
    raise ValueError(f"{ENV_VAR}: expected one of {', '.join(_ON + _OFF[1:])} (or unset), got "
                     f"{os.environ[ENV_VAR]!r}.")


@contextlib.contextmanager
def enable_tma(enabled: bool = True):
    """Sets :func:`tma_enabled` to ``enabled`` for the kernels traced inside the block.

    Raises:
      TypeError: ``enabled`` is not a bool.
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"enable_tma: enabled must be True or False, got {enabled!r}.")
    token = _OVERRIDE.set(enabled)
    try:
        yield
    finally:
        _OVERRIDE.reset(token)
