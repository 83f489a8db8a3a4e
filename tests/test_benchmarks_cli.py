"""``python -m benchmarks``: runs end to end and writes well-formed results.

Only the files, the accuracy and the report's shape are checked; timings are
reported, never asserted.
"""
import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import matplotlib.image
from rich.console import Console

from benchmarks import harness, norms, roofline, tables
from benchmarks.harness import ACCURACY_ROW_KEYS, OPTIONAL_ROW_KEYS, ROW_KEYS

REPO_ROOT = Path(__file__).resolve().parents[1]
OPS = {"fused_matmul", "layer_norm", "rms_norm", "softmax", "log_softmax", "logsumexp", "sum",
       "max", "cross_entropy", "linear_cross_entropy", "dot_product_attention",
       "apply_rotary_embedding", "gated_linear_unit", "paged_attention", "ragged_dot"}


def test_quick_run_on_a_cpu_checks_accuracy_and_compiles_for_sm90(tmp_path):
    # A cache of its own: the static section compiles here rather than reading a cached result.
    env = {**os.environ, "PALLAS_KERNELS_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--quick", "--out", str(tmp_path)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    # A host without a GPU says so first, and that nothing is timed.
    assert out.splitlines()[0].startswith("No GPU on this host") and "Nothing is timed" in out
    assert str(tmp_path) in out  # the run names its output folder
    assert list((tmp_path / "cache" / "static").glob("sm_90-*.json"))  # compiled, then cached
    assert max(len(line) for line in out.splitlines()) <= tables.WIDTH
    assert "B=batch T=queries S=keys" in out  # shape letters explained
    for name in ("results.json", "results.md"):
        assert (tmp_path / name).stat().st_size > 0, name
    pngs = sorted(tmp_path.glob("results-*.png"))
    assert {p.name for p in pngs} >= {"results-matmul.png", "results-attention.png"}
    for png in pngs:
        height, width = matplotlib.image.imread(png).shape[:2]
        assert width <= 1600 and height <= 1200, png

    results = json.loads((tmp_path / "results.json").read_text())
    meta, rows, static = results["meta"], results["rows"], results["static"]
    assert {"device_kind", "platform", "date", "jax_version", "git_commit"} <= set(meta)
    assert meta["timed"] is False and meta["ceilings"] is None
    for row in rows:
        assert set(row) == set(ACCURACY_ROW_KEYS), row
        assert row["error"] is None, row
        assert math.isfinite(row["max_rel_error"]) and row["max_rel_error"] < 2e-2, row
    by_case = {}
    for row in rows:
        by_case.setdefault(row["case"], set()).add(row["implementation"])
    expected = {"xla", *harness.kernel_implementations("cpu")}
    second_baselines = {"dense_loop"}  # benchmarks.moe: a per-expert loop beside jax.lax's
    assert all(impls - second_baselines == expected for impls in by_case.values()), by_case
    assert {row["pass"] for row in rows} == {"fwd", "fwd+bwd"}
    ops_run = {row["op"] for row in rows}
    assert ops_run <= OPS and {"fused_matmul", "layer_norm", "dot_product_attention"} <= ops_run
    # The GLU in both weight forms: stacked, and the (gate, up) pair models pass.
    assert {"swiglu", "swiglu/pair"} <= {r["variant"] for r in rows if r["op"] == "gated_linear_unit"}

    # The static section: an sm_90 compile at the GPU benchmark's size, bounded on an H100.
    assert static["target"] == "sm_90" and static["gpu"]["hbm_gbps"] == 3350.0
    (case,) = static["cases"]
    assert case["op"] == "rms_norm" and case["shape"] == [16384, 4096]
    assert {k["kernel"] for k in case["kernels"]} == {"rms_norm_fwd", "rms_norm_bwd"}
    assert all(k["registers"] > 0 and k["reads_per_element"] == 1 for k in case["kernels"])
    bound = case["bound"]
    assert bound["bound_by"] == "memory" and math.isclose(
        bound["bound_us"], bound["bytes"] / 3350e9 * 1e6)
    text = (tmp_path / "results.md").read_text()
    assert "a bound, not a measurement" in text and "| interpret err |" in text


def _render(table_set):
    console = Console(width=tables.WIDTH, file=io.StringIO(), record=True)
    for table, legend in tables.rich_tables(table_set):
        console.print(table)
        console.print(legend)
    return console.export_text()


def test_timed_run_rows_and_ceilings(tmp_path):
    """The timing path (a GPU's default; --time-interpreters on a CPU): every row
    carries the timed keys, and the ceilings are measured."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--quick", "--time-interpreters",
                           "--no-static", "--filter", "rms_norm", "--out", str(tmp_path)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    meta, rows = results["meta"], results["rows"]
    assert meta["timed"] is True
    assert meta["ceilings"]["copy_gbps"] > 0 and meta["ceilings"]["matmul_tflops"] > 0
    assert rows and {row["op"] for row in rows} == {"rms_norm"}
    for row in rows:
        assert set(ROW_KEYS) <= set(row) <= set(ROW_KEYS) | set(OPTIONAL_ROW_KEYS), row
        assert row["error"] is None and row["median_ms"] > 0, row


def test_timing_table_fits_120_columns_and_never_cuts_a_case():
    rows = []
    for impl in ("xla", "cudnn", "triton", "pallas_triton"):
        rows.append({"op": "dot_product_attention", "case": "c", "variant": "causal+gqa8+window",
                     "shape": [4, 16384, 16384, 128, 16, 128], "dtype": "bfloat16",
                     "pass": "fwd+bwd", "implementation": impl, "ceiling": "matmul",
                     "median_ms": 12345.678, "tflops": 456.789, "speedup_vs_xla": 12.345,
                     "fraction_of_ceiling": 0.987654, "max_rel_error": 1.2345e-3,
                     "peak_bytes": 123456789012, "error": None})
    text = _render(tables.timing_tables(rows))
    assert max(len(line) for line in text.splitlines()) <= tables.WIDTH
    assert "causal+gqa8+window" in text and "4x16384x16384x128x16x128" in text
    assert "pallas_triton" in text and "B=batch T=queries" in text


def test_static_tables_fit_120_columns():
    kernel = {"kernel": "linear_cross_entropy_dz_with_a_long_name", "registers": 255,
              "spill_bytes": 0, "shared_memory_bytes": 232448, "wgmma": 40, "tma": 12,
              "cp_async": 72, "loop_instructions": [1120, 865, 451], "reads_per_element": 2.0,
              "violations": []}
    bound = roofline.roofline_bound(norms.make_case("rms_norm", (16, 256), "bfloat16", "fwd",
                                                    ("interpret",)), [kernel])
    static = {"target": "sm_90", "gpu": roofline.H100_SXM, "cases": [
        {"case": "c", "op": "dot_product_attention", "shape": [4, 16384, 16384, 128, 16, 128],
         "dtype": "bfloat16", "pass": "fwd+bwd", "kernels": [kernel] * 2, "bound": bound}]}
    text = _render(tables.static_tables(static))
    assert max(len(line) for line in text.splitlines()) <= tables.WIDTH
    assert "linear_cross_entropy_dz_with_a_long_name" in text and "1120+865+451" in text
    assert "a bound, not a measurement" in text


def test_cache_resident_cases_claim_no_fraction_of_the_copy_ceiling():
    case = norms.make_case("rms_norm", (16, 256), "float32", "fwd", ("interpret",))
    seconds = 1e-3
    resident = harness.rate_against_ceiling(case, seconds, {"last_level_cache_bytes": 2**30})
    assert resident["cache_resident"] is True and resident["fraction_of_ceiling"] is None
    assert resident["ceiling_rate"] > 0  # a copy of the case's own bytes was measured
    assert tables.ceiling_text(resident) == "in cache"
    # Bytes beyond the cache: the fraction is against the copy of the case's own size.
    spilled = harness.rate_against_ceiling(case, seconds, {"last_level_cache_bytes": 1024})
    assert spilled["cache_resident"] is False
    assert spilled["fraction_of_ceiling"] == spilled["gbps"] / spilled["ceiling_rate"]


def test_roofline_bound_adds_a_read_per_extra_pass():
    case = norms.make_case("rms_norm", (16, 256), "bfloat16", "fwd", ("interpret",))
    one = roofline.roofline_bound(case, [{"reads_per_element": 1.0}])
    two = roofline.roofline_bound(case, [{"reads_per_element": 2.0}])
    assert one["bytes"] == case.bytes_accessed and one["bound_by"] == "memory"
    assert two["bytes"] == case.bytes_accessed + 16 * 256 * 2  # x read once more
    assert two["bound_us"] == two["bytes"] / (roofline.H100_SXM["hbm_gbps"] * 1e9) * 1e6


def test_every_command_line_option_has_help_text():
    import argparse

    from benchmarks import __main__ as main_cli
    from benchmarks import (attention_memory, compat, encoder, jax_pallas_tests, lease_queue, lm,
                            provenance, smoke, static, tune)
    parsers = []
    original = argparse.ArgumentParser.parse_args

    def capture(self, args=None, namespace=None):
        parsers.append(self)
        raise SystemExit(0)

    argparse.ArgumentParser.parse_args = capture
    try:
        for module in (main_cli, attention_memory, encoder, jax_pallas_tests, lm, static, tune,
                       compat, smoke, lease_queue, provenance):
            try:
                (getattr(module, "parse_args", None) or module.main)([])
            except SystemExit:
                pass
    finally:
        argparse.ArgumentParser.parse_args = original
    assert len(parsers) == 11
    for parser in parsers:
        assert parser.description and parser.description.rstrip().endswith("."), parser.prog
        for action in parser._actions:
            if action.dest != "help":
                assert action.help and action.help.rstrip(")").rstrip().endswith((".", ")")), (
                    parser.prog, action.dest, action.help)


def test_attention_memory_report(tmp_path):
    """``python -m benchmarks.attention_memory`` (compile only) at a small size: the
    flash kernels' training step needs less temporary memory than jax.nn's XLA path."""
    from benchmarks import attention_memory

    out = tmp_path / "attention_memory.json"
    assert attention_memory.main(["--seq-len", "512", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["config"]["q_len"] == 512 and report["config"]["platform"] == "cpu"
    xla, ours = report["implementations"]["xla"], report["implementations"]["interpret"]
    for row in (xla, ours):
        assert row["argument_bytes"] == 3 * 512 * 4 * 64 * 4  # q, k, v in float32
        assert row["output_bytes"] >= row["argument_bytes"]  # dq, dk, dv
    # XLA holds [N, T, S] float32 logits (4 MiB here) and more; ours never does.
    assert xla["temp_bytes"] > 4 * 512 * 512 * 4 > ours["temp_bytes"]
    assert report["ratios"]["temp_bytes"] == xla["temp_bytes"] / ours["temp_bytes"] > 1
