"""The benchmark figure (issue 13 section 4): one panel per op family and bound,
at most 1600 px wide, labelled axes, device and commit in the title; GB/s
against the copy ceiling for memory-bound rows, TFLOP/s against the matmul
ceiling for compute-bound ones."""
from __future__ import annotations

import matplotlib.image

from benchmarks import plots

META = {"device_kind": "NVIDIA H100 80GB HBM3", "platform": "gpu", "date": "2026-11-23T14:00:00",
        "git_commit": "abc1234", "ceilings": {"copy_gbps": 3000.0, "matmul_tflops": 700.0}}


def _row(op, variant, shape, impl, ceiling, rate, **extra):
    return {"op": op, "variant": variant, "shape": list(shape), "dtype": "bfloat16", "pass": "fwd",
            "implementation": impl, "ceiling": ceiling, "error": None,
            "tflops": rate if ceiling == "matmul" else rate / 1e3,
            "gbps": rate if ceiling == "copy" else None, **extra}


def _rows():
    rows = []
    for s in (2048, 8192):
        for impl, rate in (("xla", 300.0), ("triton", 420.0)):
            rows.append(_row("fused_matmul", "plain", (s, s, s), impl, "matmul", rate))
            rows.append(_row("layer_norm", "-", (4096, s), impl, "copy", 7 * rate))
            rows.append(_row("rms_norm", "-", (4096, s), impl, "copy", 6 * rate))
            rows.append(_row("dot_product_attention", "causal", (1, s, s, 16, 16, 128), impl,
                             "matmul", rate / 2))
            rows.append(_row("cross_entropy", "-", (4096, 128256), impl, "copy", 5 * rate))
    rows.append(_row("softmax", "-", (8, 8), "triton", "copy", 1.0, error="RuntimeError: boom"))
    return rows


def test_one_readable_panel_per_family(tmp_path):
    path = tmp_path / "results.png"
    drawn = plots.write_plot(path, META, _rows())
    height, width = matplotlib.image.imread(path).shape[:2]
    assert width <= plots.MAX_WIDTH_PX and (width, height) == drawn["size_px"]
    assert "NVIDIA H100 80GB HBM3" in drawn["title"] and "abc1234" in drawn["title"]
    titles = [p["title"] for p in drawn["panels"]]
    assert [t.split(":")[0] for t in titles] == ["matmul", "norms", "attention", "cross-entropy"]
    by_family = {p["title"].split(":")[0]: p for p in drawn["panels"]}
    assert by_family["norms"]["xlabel"].startswith("GB/s") and "copy ceiling" in by_family["norms"]["title"]
    assert by_family["matmul"]["xlabel"].startswith("TFLOP/s")
    assert "matmul ceiling" in by_family["attention"]["title"]
    assert len(by_family["norms"]["cases"]) == 4  # layer_norm and rms_norm share the panel
    # The failed row has no time: it is in no panel.
    assert not any("softmax" in c for p in drawn["panels"] for c in p["cases"])


def test_empty_run_still_writes_a_figure(tmp_path):
    drawn = plots.write_plot(tmp_path / "empty.png", META, [])
    assert drawn["panels"] == [] and (tmp_path / "empty.png").stat().st_size > 0
