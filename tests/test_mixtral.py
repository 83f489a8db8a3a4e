"""Mixtral built from our layers (``layers.MoE`` in the decoder of ``benchmarks.decoder``) against
transformers' ``MixtralForCausalLM`` at a tiny config with seeded random weights: logits, the loss
with ignored labels plus the router's load-balancing term, that term alone, and every parameter's
gradient against torch autograd.

CI runs our generated Triton code in Triton's CPU interpreter on 16 tokens in float32; with
``--slow``, ``interpret`` and ``triton`` on 64 tokens in float32 and bfloat16.
"""
import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("torch")

from benchmarks import decoder  # noqa: E402 - after the skips


def _run(tmp_path, *args):
    code = decoder.main(["--models", "mixtral", "--train-steps", "0", "--data-bytes", "200000",
                         *args, "--out-dir", str(tmp_path)])
    result = json.loads((tmp_path / "decoder.json").read_text())
    assert code == 0 and result["passed"], result["failures"]
    return result


def test_mixtral_on_triton_matches_transformers(tmp_path):
    result = _run(tmp_path, "--implementations", "triton", "--dtypes", "float32",
                  "--tokens-for", "triton=16", "--seq-len", "16")
    (row,) = result["rows"]
    assert row["implementation"] == "triton" and row["tokens"] == 16
    assert row["logits_rel_err"] <= decoder.LOGITS_TOL
    assert row["loss_rel_err"] <= decoder.LOSS_RTOL
    assert row["aux_rel_err"] <= decoder.LOSS_RTOL and row["ref_aux_loss"] > 2.0  # k = 2: balanced
    # 2 layers x (2 norms, q, k, v, o, router, gate_up, down) + embedding, final norm, head.
    assert row["grad_rel_err"] <= decoder.GRAD_TOL and row["grads_checked"] == 21
    config = result["configs"]["mixtral"]
    assert (config["num_experts"], config["experts_per_token"]) == (4, 2)


@pytest.mark.slow
def test_mixtral_on_kernels_both_dtypes(tmp_path):
    result = _run(tmp_path, "--implementations", "interpret,triton", "--dtypes",
                  "float32,bfloat16", "--tokens", "64", "--tokens-for", "triton=64")
    assert len(result["rows"]) == 4
