"""``python -m benchmarks.generate`` at small size: greedy generation through the decoder with a
dense and a paged key/value cache equals transformers' ``generate(do_sample=False)`` token for
token (float32, prompts of different lengths, transformers left-padded in one batch).

CI runs the caches' kernels with the model's other layers on XLA (their kernels are checked
against transformers by test_decoder): the dense cache on ``triton`` (Triton's CPU
interpreter) through the command line, the paged cache on ``interpret`` with a fixed token
budget (one compiled step), both with split-KV attention forced (2 splits) and checked to
run. With ``--slow``: the default run (every implementation for all layers, both caches, 32
new tokens) and 32 tokens on ``triton``.
"""
import json

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("torch")

from benchmarks import decoder, generate  # noqa: E402 - after the skips
from benchmarks.lm import load_corpus  # noqa: E402
from ops.attention import decode  # noqa: E402
from ops.serving import prefill_kernels  # noqa: E402

LENGTHS = (4, 13, 9)
NEW = 4


def _main(tmp_path, *args):
    code = generate.main([*args, "--out-dir", str(tmp_path)])
    result = json.loads((tmp_path / "generate.json").read_text())
    assert (tmp_path / "generate.md").read_text().startswith("# Greedy generation")
    assert code == 0 and result["passed"], result["failures"]
    return result


def _count_calls(monkeypatch, module, name):
    calls = []
    original = getattr(module, name)

    def wrapped(cfg, *args, **kwargs):
        # attention's Config keeps its tiles in .blocks; the paged kernels' configs hold k_splits
        calls.append(cfg.k_splits if hasattr(cfg, "k_splits") else cfg.blocks.k_splits)
        return original(cfg, *args, **kwargs)

    monkeypatch.setattr(module, name, wrapped)
    return calls


def test_dense_cache_on_triton_matches_transformers(tmp_path, monkeypatch):
    splits = _count_calls(monkeypatch, decode, "forward")  # split-KV decode's first kernel
    result = _main(tmp_path, "--implementations", "triton", "--layers-implementation", "xla",
                   "--caches", "dense", "--prompt-lengths", ",".join(map(str, LENGTHS)),
                   "--new-tokens-for", f"triton={NEW}", "--prompts-for", f"triton={len(LENGTHS)}")
    (row,) = result["rows"]
    assert (row["implementation"], row["cache"], row["prompts"], row["new_tokens"]) == (
        "triton", "dense", len(LENGTHS), NEW)
    assert row["tokens_equal"] and row["logits_rel_err"] <= generate.LOGITS_TOL
    assert splits and set(splits) == {2}  # the decode steps ran split-KV, 2 splits


def test_paged_cache_on_interpret_matches_transformers(monkeypatch):
    import transformers  # noqa: F401 - the model below needs it

    # 16-token pages: every step (prefill and decode, one token per item) runs the
    # query-blocked kernel over multi-page key tiles, split-KV kept.
    splits = _count_calls(monkeypatch, prefill_kernels, "prefill")
    prompts = generate.text_prompts(load_corpus(100_000)[0], LENGTHS, seed=1)
    hf = decoder.hf_model("llama3", decoder.tiny_hf_config("llama3"), seed=1)
    ref_tokens, ref_logits = generate.hf_generate(hf, prompts, NEW)
    cfg = decoder.config_from_hf("llama3", hf.config)
    model = decoder.build_decoder(cfg, decoder.MAPPERS["llama3"](decoder.hf_state(hf), cfg),
                                  implementation="xla")
    tokens, logits = generate.generate(model, prompts, NEW, cache="paged", seed=3,
                                       implementation="interpret", k_splits=2,
                                       token_budget=sum(LENGTHS) + 2)
    checked = generate.compare(tokens, logits, ref_tokens, ref_logits)
    assert checked["tokens_equal"], checked["first_difference"]
    assert checked["logits_rel_err"] <= generate.LOGITS_TOL
    assert splits and set(splits) == {2}
    with pytest.raises(ValueError, match="token_budget"):
        generate.generate(model, prompts, NEW, cache="paged", token_budget=sum(LENGTHS) - 1)


def test_compare_reports_the_first_difference():
    rng = np.random.default_rng(0)
    ref_logits = rng.normal(size=(5, 2, 16)).astype(np.float32)
    ref_tokens = ref_logits.argmax(-1).T
    logits = ref_logits.copy()
    logits[3, 1, (ref_tokens[1, 3] + 1) % 16] = 100.0  # prompt 1 picks another token at step 3
    tokens = logits.argmax(-1).T
    out = generate.compare(tokens, logits, ref_tokens, ref_logits)
    assert not out["tokens_equal"] and out["same_fraction"] == 0.9
    d = out["first_difference"]
    assert (d["prompt"], d["step"], d["theirs"]) == (1, 3, ref_tokens[1, 3])
    assert d["ours_top2"][0] == d["ours"] and d["ours_margin"] > 90
    assert out["logits_rel_err"] == 0.0  # compared only before the difference
    row = {"implementation": "interpret", "cache": "paged", **out}
    assert "prompt 1 step 3" in generate._failure(row)
    same = generate.compare(ref_tokens, ref_logits * 1.01, ref_tokens, ref_logits)
    assert same["tokens_equal"] and same["first_difference"] is None
    assert "logits error" in generate._failure({"implementation": "x", "cache": "dense", **same})


@pytest.mark.parametrize("argv, message", [
    (["--caches", "sparse"], "--caches"),
    (["--implementations", "cuda"], "unknown implementation"),
    (["--prompt-lengths", "4,x"], "--prompt-lengths"),
    (["--prompt-lengths", "0"], "--prompt-lengths"),
    (["--new-tokens-for", "triton=0"], "--new-tokens-for"),
    (["--token-budget", "3", "--prompt-lengths", "4"], "--token-budget"),
])
def test_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit):
        generate.parse_args(argv)
    assert message in capsys.readouterr().err


def test_generate_rejects_bad_arguments():
    model = object()  # checked before the model is used
    for kwargs, message in (({"cache": "sparse"}, "cache="), ({"new_tokens": 0}, "new_tokens"),
                            ({"prompts": []}, "prompts")):
        args = {"prompts": [np.ones(3, np.int32)], "new_tokens": 2, **kwargs}
        with pytest.raises(ValueError, match=message):
            generate.generate(model, args.pop("prompts"), args.pop("new_tokens"), **args)


@pytest.mark.slow
def test_default_run_matches_transformers(tmp_path):
    result = _main(tmp_path)
    assert {(r["implementation"], r["cache"]) for r in result["rows"]} == {
        (i, c) for i in ("xla", "interpret", "triton") for c in generate.CACHES}
    assert all(r["new_tokens"] == 32 for r in result["rows"] if r["implementation"] != "triton")


@pytest.mark.slow
def test_triton_32_tokens_matches_transformers(tmp_path):
    result = _main(tmp_path, "--implementations", "triton", "--new-tokens-for", "triton=32")
    assert all(r["new_tokens"] == 32 and r["tokens_equal"] for r in result["rows"])
