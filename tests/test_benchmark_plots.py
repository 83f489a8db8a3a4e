"""The benchmark figures: one PNG per op family, each at most 1600 x 1200 px, distinct
panel titles, labelled axes, device and commit in the title; GB/s against each case's
own copy ceiling for memory-bound rows, TFLOP/s against the matmul ceiling for
compute-bound ones, and errors against float64 (log scale) when nothing was timed."""
from __future__ import annotations

import matplotlib.image

from benchmarks import plots

META = {"device_kind": "NVIDIA H100 80GB HBM3", "platform": "gpu", "date": "2026-11-23T14:00:00",
        "git_commit": "abc1234", "ceilings": {"copy_gbps": 3000.0, "matmul_tflops": 700.0}}


def _row(op, variant, shape, impl, ceiling, rate, **extra):
    return {"op": op, "variant": variant, "shape": list(shape), "dtype": "bfloat16", "pass": "fwd",
            "implementation": impl, "ceiling": ceiling, "error": None, "median_ms": 1.0,
            "tflops": rate if ceiling == "matmul" else rate / 1e3,
            "gbps": rate if ceiling == "copy" else None,
            "ceiling_rate": 700.0 if ceiling == "matmul" else 3000.0, "max_rel_error": 1e-3,
            **extra}


def _rows():
    rows = []
    for s in (2048, 8192):
        for impl, rate in (("xla", 300.0), ("triton", 420.0)):
            rows.append(_row("fused_matmul", "plain", (s, s, s), impl, "matmul", rate))
            rows.append(_row("layer_norm", "-", (4096, s), impl, "copy", 7 * rate,
                             cache_resident=s == 2048))
            rows.append(_row("rms_norm", "-", (4096, s), impl, "copy", 6 * rate))
            rows.append(_row("dot_product_attention", "causal", (1, s, s, 16, 16, 128), impl,
                             "matmul", rate / 2))
            rows.append(_row("cross_entropy", "-", (4096, 128256), impl, "copy", 5 * rate))
            rows.append(_row("linear_cross_entropy", "-", (4096, 4096, 128256), impl, "matmul",
                             rate))
    rows.append(_row("softmax", "-", (8, 8), "triton", "copy", 1.0, error="RuntimeError: boom"))
    return rows


def _size(path):
    height, width = matplotlib.image.imread(path).shape[:2]
    return width, height


def test_one_readable_file_per_family(tmp_path):
    drawn = plots.write_plots(tmp_path, META, _rows())
    names = [d["path"].name for d in drawn]
    assert names == ["results-matmul.png", "results-norms.png", "results-attention.png",
                     "results-cross-entropy.png"]  # the failed softmax row has no time: no file
    for d in drawn:
        width, height = _size(d["path"])
        assert (width, height) == d["size_px"]
        assert width <= plots.MAX_WIDTH_PX and height <= plots.MAX_HEIGHT_PX
        assert "NVIDIA H100 80GB HBM3" in d["title"] and "abc1234" in d["title"]
    by_name = {d["path"].name: d for d in drawn}
    norms = by_name["results-norms.png"]["panels"]
    assert len(norms) == 1 and norms[0]["xlabel"].startswith("GB/s")
    assert norms[0]["title"].startswith("layer_norm, rms_norm: memory-bound")
    assert len(norms[0]["cases"]) == 4  # layer_norm and rms_norm share the panel
    assert sum("(in cache)" in c for c in norms[0]["cases"]) == 1
    assert by_name["results-matmul.png"]["panels"][0]["xlabel"].startswith("TFLOP/s")
    # A family with both kinds of bound: one panel each, with distinct titles.
    titles = [p["title"] for p in by_name["results-cross-entropy.png"]["panels"]]
    assert len(titles) == 2 == len(set(titles))
    assert titles[0].startswith("cross_entropy:") and titles[1].startswith("linear_cross_entropy:")


def test_many_cases_stay_within_a_screen(tmp_path):
    rows = [_row("dot_product_attention", f"causal{i}", (1, 4096, 4096, 16, 16, 128), impl,
                 "matmul", 100.0 + i)
            for i in range(30) for impl in ("xla", "cudnn", "triton", "pallas_triton")]
    (drawn,) = plots.write_plots(tmp_path, META, rows)
    width, height = _size(drawn["path"])
    assert width <= plots.MAX_WIDTH_PX and height <= plots.MAX_HEIGHT_PX


def test_untimed_rows_plot_errors_on_a_log_scale(tmp_path):
    rows = [{k: v for k, v in r.items() if k not in ("median_ms", "tflops", "gbps")}
            for r in _rows()]
    drawn = plots.write_plots(tmp_path, {**META, "ceilings": None}, rows)
    assert all(p["xlabel"].startswith("max |out - ref|") for d in drawn for p in d["panels"])
    assert all("error against float64" in p["title"] for d in drawn for p in d["panels"])


def test_empty_run_still_writes_a_figure(tmp_path):
    (drawn,) = plots.write_plots(tmp_path, META, [])
    assert drawn["panels"] == [] and drawn["path"].stat().st_size > 0
