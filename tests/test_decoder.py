"""``python -m benchmarks.decoder`` at small size: Llama 3, Mistral, Qwen3 and Gemma 2 built from
our layers match transformers (logits, the loss with ignored labels, every parameter's gradient).

CI runs Gemma 2 (the family with the most options: GeGLU, 1 + scale norms, post-norms, both
soft caps, a sliding and a global layer, query_pre_attn_scalar, scaled embeddings, tied head)
through our kernels on ``triton`` (our generated Triton code in Triton's CPU interpreter:
about 15 s, half of ``interpret``'s, whose XLA compile of the interpreted kernels dominates),
32 tokens in float32. With ``--slow``: every family on ``interpret`` and ``triton`` in float32
and bfloat16, the tied Llama 3, and the training run against the XLA references.
"""
import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("torch")

from benchmarks import decoder  # noqa: E402 - after the skips


def _run(tmp_path, *args):
    code = decoder.main([*args, "--out-dir", str(tmp_path)])
    result = json.loads((tmp_path / "decoder.json").read_text())
    assert (tmp_path / "decoder.md").read_text().startswith("# Decoder families")
    assert code == 0 and result["passed"], result["failures"]
    return result


def test_gemma2_on_triton_matches_transformers(tmp_path):
    result = _run(tmp_path, "--models", "gemma2", "--implementations", "triton",
                  "--dtypes", "float32", "--tokens", "32", "--seq-len", "32",
                  "--train-steps", "0", "--generate-tokens", "0", "--data-bytes", "200000")
    (row,) = result["rows"]
    assert row["implementation"] == "triton" and row["tokens"] == 32
    assert row["logits_rel_err"] <= decoder.LOGITS_TOL
    assert row["grad_rel_err"] <= decoder.GRAD_TOL and row["grads_checked"] == 24
    assert 0 < row["labelled"] < 31  # some labels ignored, some not
    assert row["max_abs_logit"] > 20  # the final soft cap (30) is in its nonlinear range
    config = result["configs"]["gemma2"]
    assert config["layer_types"] == ["sliding_attention", "full_attention"]
    assert config["tie_embeddings"] and config["post_norms"] and config["norm_offset"] == 1.0
    _mapping_rejects_unbuilt_options()  # here: one import of transformers per worker


def _mapping_rejects_unbuilt_options():
    import transformers
    hf = transformers.LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16,
                                  num_hidden_layers=1, num_attention_heads=2, head_dim=4,
                                  mlp_bias=True)
    with pytest.raises(ValueError, match="mlp_bias"):
        decoder.config_from_hf("llama3", hf)
    with pytest.raises(ValueError, match="family"):
        decoder.config_from_hf("gpt2", transformers.LlamaConfig())


@pytest.mark.slow
@pytest.mark.parametrize("models", ["llama3,llama3-tied", "mistral", "qwen3", "gemma2"])
def test_families_on_kernels_match_transformers(tmp_path, models):
    result = _run(tmp_path, "--models", models, "--implementations", "interpret,triton",
                  "--dtypes", "float32,bfloat16", "--tokens", "64", "--train-steps", "0")
    assert {(r["implementation"], r["dtype"]) for r in result["rows"]} == {
        (i, d) for i in ("interpret", "triton") for d in ("float32", "bfloat16")}


@pytest.mark.slow
def test_training_with_kernels_follows_xla(tmp_path):
    result = _run(tmp_path, "--models", "llama3", "--implementations", "xla", "--dtypes",
                  "float32", "--tokens", "32", "--train-models", "gemma2", "--train-steps", "30",
                  "--min-improvement", "0.5")
    (trained,) = result["training"]
    assert trained["max_abs_diff"] <= 2e-2 and len(trained["ours"]) == 30
