"""Index-map analysis whose cost does not grow with the grid, and the interpreter's order."""
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ops
import pallas_core as pl
from pallas_core import grid_analysis
from pallas_core.params import ARBITRARY, PARALLEL
from pallas_core.specs import resolve_block_mapping


def mapping(index_map, grid_rank, shape=(64, 64), block=(8, 8)):
    return resolve_block_mapping(pl.BlockSpec(block, index_map), "out_specs[0]", shape,
                                 jnp.float32, grid_rank)


def analyse(m, grid):
    """(in-bounds error or None, revisited axes, revisited-after-leaving or None)."""
    table = grid_analysis.block_index_table(m, grid)
    try:
        grid_analysis.check_in_bounds(m, table, grid)
        bounds = None
    except ValueError as e:
        bounds = str(e)
    return (bounds is not None, grid_analysis.revisited_axes(table, grid),
            grid_analysis.revisited_after_leaving(table) is not None, table)


MAPS = {  # name: (index_map, grid)
    "rows": (lambda i, j: (i, 0), (8, 5)),
    "transpose": (lambda i, j: (j, i), (8, 8)),
    "reduction_last": (lambda i, k: (i, 0), (4, 6)),
    "reduction_first": (lambda k, i: (i, 0), (6, 4)),
    "offset_scaled": (lambda i, j: (2 * i + 1 - 0 * j, 7 - j), (3, 8)),
    "out_of_bounds_high": (lambda i, j: (i + 1, j), (8, 8)),
    "out_of_bounds_low": (lambda i, j: (i - j, 0), (8, 8)),
    "diagonal_sum": (lambda i, j: (i + j, 0), (4, 4)),
    "three_axes": (lambda b, i, k: (i, b), (3, 8, 5)),
}


@pytest.mark.parametrize("name", sorted(MAPS))
def test_affine_analysis_agrees_with_exhaustive(name, monkeypatch):
    index_map, grid = MAPS[name]
    m = mapping(index_map, len(grid))
    exact = analyse(m, grid)
    assert not exact[3].affine
    monkeypatch.setattr(grid_analysis, "MAX_ANALYSED_POINTS", 1)  # as if the grid were huge
    symbolic = analyse(m, grid)
    assert symbolic[3].affine
    assert symbolic[:3] == exact[:3]


def test_non_affine_maps_are_sampled_soundly(monkeypatch):
    monkeypatch.setattr(grid_analysis, "MAX_ANALYSED_POINTS", 1)
    monkeypatch.setattr(grid_analysis, "SAMPLE_PER_AXIS", 2)
    grid = (16, 16)
    # Revisits along the minor axis in pairs, found from the sampled neighbours.
    table = grid_analysis.block_index_table(mapping(lambda i, j: (i, j // 2), 2), grid)
    assert not table.affine and not table.exhaustive
    assert grid_analysis.revisited_axes(table, grid) == {1}
    assert grid_analysis.revisited_after_leaving(table) is None
    # Out of bounds only at the far end of the grid: the last indices are sampled.
    far = mapping(lambda i, j: (jnp.minimum(i, 15) // 2 + (i == 15) * 8, 0), 2)
    with pytest.raises(ValueError, match=r"grid point \(15, 0\)"):
        grid_analysis.check_in_bounds(far, grid_analysis.block_index_table(far, grid), grid)


def test_revisit_after_leaving_names_points_on_huge_grids():
    grid = (1 << 12, 1 << 12)  # 16M points: symbolic
    m = mapping(lambda k, i: (i, 0), 2, shape=(1 << 15, 8))
    table = grid_analysis.block_index_table(m, grid)
    assert table.affine
    assert grid_analysis.revisited_after_leaving(table) == ((0, 0), (1, 0))


def order_points(order):
    """Every (ids, core_start) of an ExecutionOrder, run eagerly on its counters."""
    out = []
    for g in range(order.num_groups):
        for w in range(order.group_size):
            ids = tuple(int(i) for i in order.ids(jnp.int32(g), jnp.int32(w)))
            out.append((ids, bool(order.core_start(jnp.int32(g), jnp.int32(w)))))
    return out


@pytest.mark.parametrize("shuffle_seed,table_limit", [(None, None), (3, None), (5, 1)])
def test_execution_order_is_a_megacore_permutation(shuffle_seed, table_limit, monkeypatch):
    if table_limit is not None:  # the affine permutation used for many groups
        monkeypatch.setattr(grid_analysis, "MAX_SHUFFLE_TABLE", table_limit)
    grid, semantics = (5, 3, 2), (PARALLEL, ARBITRARY, PARALLEL)
    order = grid_analysis.execution_order(grid, semantics, 2, shuffle_seed)
    points = order_points(order)
    ids = [p for p, _ in points]
    assert sorted(ids) == list(itertools.product(*map(range, grid)))
    # Core 0 runs axis-0 indices 0..2, core 1 runs 3..4; each starts fresh once.
    assert [i for i, (_, start) in enumerate(points) if start] == [0, 3 * 2 * 3]
    assert {p[0] for p in ids[:18]} == {0, 1, 2}
    for start in range(0, len(ids), 3):  # a group: the arbitrary axis in order
        group = ids[start:start + 3]
        assert [p[1] for p in group] == [0, 1, 2] and len({(p[0], p[2]) for p in group}) == 1
    if shuffle_seed is None:
        assert ids == sorted(ids, key=lambda p: (p[0], p[2], p[1]))
    else:
        assert ids != sorted(ids, key=lambda p: (p[0], p[2], p[1]))


@pytest.mark.parametrize("case", ["fused_matmul", "linear_cross_entropy", "attention"])
def test_tracing_cost_does_not_grow_with_the_grid(case):
    bf16 = jnp.bfloat16
    s = jax.ShapeDtypeStruct
    if case == "fused_matmul":  # a grid of 2**31 points
        fn = lambda x, w: ops.fused_matmul(x, w, implementation="interpret")
        args = (s((1 << 20, 1 << 16), bf16), s((1 << 16, 1 << 16), bf16))
    elif case == "linear_cross_entropy":
        fn = lambda x, w, y: ops.linear_cross_entropy(x, w, y, implementation="interpret")
        args = (s((32768, 4096), bf16), s((4096, 128256), bf16), s((32768,), jnp.int32))
    else:
        fn = lambda q: ops.dot_product_attention(q, q, q, is_causal=True,
                                                 implementation="interpret")
        args = (s((4, 32768, 8, 128), bf16),)
    start = time.perf_counter()
    out = jax.eval_shape(fn, *args)
    assert time.perf_counter() - start < 5.0
    assert out.shape[0] == args[0].shape[0]
