"""Which grid tile each launched Triton program computes, and how many programs launch.

Our Triton lowering launches the grid's parallel axes flattened into launch
axis 0 and decodes each program's grid indices from its flat id:

* row-major by default: the last parallel axis fastest;
* grouped (``group_size > 1``, Triton's matmul tutorial "L2 cache
  optimizations"): the last two parallel axes ``(a, b)`` are cut into bands of
  ``group_size`` values of ``a``; inside a band ``a`` runs fastest, then
  ``b``. Programs that run at the same time then read ``group_size`` row
  blocks and a few column blocks instead of one row block and every column
  block, so their operands stay in L2. Leading parallel axes (batch) stay
  outermost;
* persistent (``persistent=P``): ``min(P, tiles)`` programs launch and each
  loops over tiles ``program_id, program_id + P, ...``; the decode above maps
  each tile to grid indices.

Parallel axes may run in any order (docs/design.md §4), so none of this changes
results.
"""
from __future__ import annotations

import math


def launch_size(parallel_sizes, persistent: int | None) -> int:
    """Programs launched for parallel axes of ``parallel_sizes``: one per tile, or ``persistent``."""
    tiles = math.prod(parallel_sizes)
    return min(tiles, persistent) if persistent else tiles


def decode(parallel: list[int], group_size: int, flat: str) -> tuple[list[str], dict[int, str]]:
    """Source lines that decode the flat tile id ``flat`` into grid indices.

    Args:
      parallel: the parallel grid axes, outermost first; axis ``a`` has the
        constexpr size ``G<a>`` and gets the index ``i<a>``.
      group_size: 1 for row-major order; otherwise the band height over the
        second-to-last parallel axis (constexpr ``GROUP``).
      flat: the expression of the flat id.

    Returns ``(lines, names)``: ``names[a]`` is the variable of axis ``a``.
    """
    lines = [f"pid = {flat}"]
    names = {a: f"i{a}" for a in parallel}
    rest = list(parallel)
    if group_size > 1 and len(parallel) >= 2:
        a, b = parallel[-2:]
        rest = parallel[:-2]
        plane = f"(G{a} * G{b})"
        lines.append(f"tile = pid % {plane}" if rest else "tile = pid")
        if rest:
            lines.append(f"pid = pid // {plane}")
        lines += [f"band = tile // (GROUP * G{b})",
                  "band_start = band * GROUP",
                  f"band_rows = tl.minimum(G{a} - band_start, GROUP)",
                  f"in_band = tile % (GROUP * G{b})",
                  f"i{a} = band_start + in_band % band_rows",
                  f"i{b} = in_band // band_rows"]
    for pos, a in enumerate(reversed(rest)):
        if pos == len(rest) - 1:
            lines.append(f"i{a} = pid")
        else:
            lines += [f"i{a} = pid % G{a}", f"pid = pid // G{a}"]
    return lines, names
