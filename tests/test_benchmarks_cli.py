"""``python -m benchmarks --quick``: runs end to end and writes well-formed results.

Only the files and the accuracy are checked; timings are reported, never asserted.
"""
import json
import math
import subprocess
import sys
from pathlib import Path

from benchmarks.harness import OPTIONAL_ROW_KEYS, ROW_KEYS

REPO_ROOT = Path(__file__).resolve().parents[1]
OPS = {"fused_matmul", "layer_norm", "rms_norm", "softmax", "log_softmax", "logsumexp", "sum",
       "max", "cross_entropy", "linear_cross_entropy", "dot_product_attention"}


def test_quick_run_writes_results(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--quick", "--out", str(tmp_path)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert str(tmp_path) in proc.stdout  # the run names its output folder
    for name in ("results.json", "results.md", "results.png"):
        assert (tmp_path / name).stat().st_size > 0, name

    results = json.loads((tmp_path / "results.json").read_text())
    meta, rows = results["meta"], results["rows"]
    assert {"device_kind", "platform", "date", "jax_version", "git_commit", "ceilings"} <= set(meta)
    assert meta["ceilings"]["copy_gbps"] > 0 and meta["ceilings"]["matmul_tflops"] > 0
    assert rows
    for row in rows:
        assert set(ROW_KEYS) <= set(row) <= set(ROW_KEYS) | set(OPTIONAL_ROW_KEYS), row
        assert row["error"] is None, row
        assert row["median_ms"] > 0 and (row["tflops"] > 0 or row["gbps"] > 0)
        assert math.isfinite(row["max_rel_error"]) and row["max_rel_error"] < 2e-2, row
        if row["implementation"] == "xla":
            assert row["speedup_vs_xla"] == 1.0

    # Every case has the baseline and one kernel implementation, for both passes.
    by_case = {}
    for row in rows:
        by_case.setdefault(row["case"], set()).add(row["implementation"])
    assert all(len(impls) == 2 and "xla" in impls for impls in by_case.values()), by_case
    assert {row["pass"] for row in rows} == {"fwd", "fwd+bwd"}
    assert {"plain", "bias+gelu_exact"} <= {row["variant"] for row in rows}
    ops_run = {row["op"] for row in rows}
    assert ops_run <= OPS and {"fused_matmul", "layer_norm", "dot_product_attention"} <= ops_run
    # Attention reports the compiled peak memory of every implementation.
    assert all(row["peak_bytes"] > 0 for row in rows if row["op"] == "dot_product_attention")
    assert "| speed-up vs XLA |" in (tmp_path / "results.md").read_text()


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
