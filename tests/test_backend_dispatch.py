"""ops/ and layers/ ask a backend's traits, not its name (docs/design.md §5, §10).

A comparison with a backend's name (``backend == "mosaic_tpu"``,
``impl in ("pallas_triton", ...)``) or a membership test in a name table
(``pl.TRITON_BACKENDS``) ties an op to today's backends: a new backend would
need an edit in every op. The ops read ``pl.backend_traits(backend)`` /
``device.traits`` instead. This test parses the sources (nothing is imported,
so it is cheap) and fails on such a comparison outside :data:`ALLOWED`.
"""
from __future__ import annotations

import ast
import pathlib

import pallas_core as pl

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("ops", "layers")
NAME_TABLES = ("TRITON_BACKENDS", "JAX_PALLAS_BACKENDS")

# (file, the line's text stripped) -> why that comparison is the one place that says so.
ALLOWED: dict[tuple[str, str], str] = {}

# Files whose owners have not converted them yet: at most this many lines with a
# comparison. Lower the count (or drop the entry) when converting; it may not grow.
PENDING: dict[str, int] = {
    "ops/decoder/glu.py": 5,
    "ops/matmul/fused_matmul.py": 2,
    "ops/matmul/tiled.py": 6,
}


def _is_backend_name(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value in pl.BACKENDS


def _names_a_backend(node: ast.AST) -> bool:
    """A backend name, or a tuple / list / set holding one."""
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_is_backend_name(e) for e in node.elts)
    return _is_backend_name(node)


def name_comparisons(source: str) -> list[int]:
    """Lines of ``source`` that compare with a backend's name or use a name table."""
    lines = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(map(_names_a_backend, [node.left, *node.comparators])):
            lines.add(node.lineno)
        elif (isinstance(node, ast.Name) and node.id in NAME_TABLES
              or isinstance(node, ast.Attribute) and node.attr in NAME_TABLES):
            lines.add(node.lineno)
    return sorted(lines)


def test_the_scan_finds_name_comparisons():
    source = ('if backend == "mosaic_tpu": pass\n'
              'x = 1 if "triton" != impl else 2\n'
              'y = impl in ("interpret", "xla")\n'
              'z = cfg.backend in pl.TRITON_BACKENDS\n'
              'ok = impl == "xla" or backend in KERNEL_BACKENDS\n'
              'configs = {b: 1 for b in ("interpret", "triton")}\n')
    assert name_comparisons(source) == [1, 2, 3, 4]


def test_ops_and_layers_ask_traits_not_names():
    found, over = [], []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            text = path.read_text()
            lines = text.splitlines()
            hits = [n for n in name_comparisons(text) if (rel, lines[n - 1].strip()) not in ALLOWED]
            if rel in PENDING:
                if len(hits) > PENDING[rel]:
                    over.append(f"{rel}: {len(hits)} comparisons, at most {PENDING[rel]}")
            else:
                found += [f"{rel}:{n}: {lines[n - 1].strip()}" for n in hits]
    assert not found and not over, (
        "compare pl.backend_traits(backend) / device.traits (pallas_core/traits.py), not backend "
        "names; a comparison that genuinely selects a backend goes in ALLOWED with its reason:\n"
        + "\n".join(found + over))
