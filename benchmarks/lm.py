"""End-to-end check: a small byte-level language model trained with stock Flax
layers and with ``layers.Dense`` must follow the same loss curve.

Run as ``python -m benchmarks.lm`` (on CPU add ``--implementation interpret``
to exercise our Pallas kernels through the interpreter; the default, None,
lets ``ops`` pick the platform's best implementation, which is plain XLA on
CPU).

What it does:

1. Data. Reads the Python standard library's own ``.py`` files (found through
   ``sysconfig.get_paths()["stdlib"]``) in sorted order, up to
   ``--data-bytes``; every ``VAL_EVERY``-th file goes to a validation split,
   so validation text is never seen in training. Bytes 0..255 are the
   vocabulary. Training batches are random windows of ``--seq-len + 1``
   bytes drawn with a seeded numpy RNG, generated once and fed to both runs.
2. Model. A decoder-only transformer: byte and learned position embeddings,
   ``--layers`` pre-norm blocks (``nnx.LayerNorm`` -> causal
   ``nnx.MultiHeadAttention`` and ``nnx.LayerNorm`` -> MLP, each with a
   residual), a final LayerNorm and a linear head. The MLP is
   ``Linear(width, 4 * width) -> gelu (tanh form) -> Linear(4 * width, width)``.
   The two runs differ only in which layers compute:

   * stock: ``nnx.LayerNorm``; MLP ``nnx.Linear -> jax.nn.gelu -> nnx.Linear``;
     loss ``optax.softmax_cross_entropy_with_integer_labels``;
   * ops:   ``layers.LayerNorm`` (``ops.layer_norm``); attention
     ``layers.MultiHeadAttention`` (``ops.dot_product_attention``, flash
     attention, with ``is_causal=True`` so masked blocks are skipped); MLP
     ``layers.Dense(activation="gelu") -> layers.Dense``, with the gelu fused
     into the first matmul's epilogue; loss ``ops.cross_entropy``.

3. Training. ``layers.Dense`` and ``layers.MultiHeadAttention`` are drop-ins for
   ``nnx.Linear`` and ``nnx.MultiHeadAttention`` (same parameter names and shapes), so the ops model is built abstractly and loaded with the
   stock model's state: both runs start from the very same parameters (this
   is asserted), see the same batches and use the same AdamW optimizer.

Tolerance (what "the same loss curve" means): the two runs differ only in
float32 rounding (a tiled kernel sums in another order than XLA's dot), which
training slowly amplifies. We require

    max over every step |loss_stock - loss_ops| <= --tolerance  (default 2e-2)

which is far below the gap a real bug makes (a wrong activation, bias or
gradient moves the curve by tenths within a few dozen steps). We also require
that learning happened: the mean training loss over the last ``FINAL_WINDOW``
steps of both runs must be below ``--max-final-loss`` (default 3.0). An
untrained model scores about ln(256) = 5.55 nats, and byte frequencies alone
(the corpus's unigram entropy, about 3.15 nats) cannot get below 3.0, so
passing means the model uses context; the default run ends near 2.2.
``--no-learning-check`` skips that check, for runs too short to learn. On
failure the program prints why and exits with status 1.

Defaults (width 128, 2 layers, 4 heads, 16 x 128-byte batches, 300 steps)
are sized so that ``--implementation interpret`` finishes in about 3
minutes on a 2-core CPU.

It also prints the median step time of each run (measured after the first,
compiling, step; every step is timed to ``block_until_ready``) and a final
validation loss for both; ``--json OUT`` writes the curves and step times.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import sysconfig
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import layers
import ops

VOCAB = 256  # byte-level: every byte value is a token
VAL_EVERY = 10  # every 10th file (in sorted order) is held out for validation
FINAL_WINDOW = 10  # steps averaged for the learning check (one step's loss is noisy)
VAL_BATCHES = 8


@dataclasses.dataclass(frozen=True)
class Config:
    width: int
    layers: int
    heads: int
    seq_len: int


# --------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------

def stdlib_files() -> list[str]:
    """The standard library's top-level ``.py`` files, sorted for determinism."""
    root = sysconfig.get_paths()["stdlib"]
    names = sorted(n for n in os.listdir(root) if n.endswith(".py"))
    return [os.path.join(root, n) for n in names]


def load_corpus(max_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) uint8 byte streams from the stdlib, split by file.

    Files are read in sorted order until ``max_bytes`` are collected, so the
    corpus is the same on every run of the same Python installation.
    """
    train, val, total = [], [], 0
    for i, path in enumerate(stdlib_files()):
        with open(path, "rb") as f:
            data = f.read()
        (val if i % VAL_EVERY == VAL_EVERY - 1 else train).append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if not train or not val:
        raise RuntimeError(f"too little stdlib source found under "
                           f"{sysconfig.get_paths()['stdlib']!r} for a train/val split")
    return _as_bytes(train), _as_bytes(val)


def _as_bytes(parts: list[bytes]) -> np.ndarray:
    return np.frombuffer(b"\n".join(parts), dtype=np.uint8)


def sample_batches(data: np.ndarray, count: int, batch_size: int, seq_len: int,
                   rng: np.random.Generator) -> np.ndarray:
    """``[count, batch_size, seq_len + 1]`` int32 random windows of ``data``.

    Drawn once up front so that both runs see exactly the same batches.
    """
    if len(data) <= seq_len + 1:
        raise ValueError(f"{len(data)} bytes of text cannot hold a window of {seq_len + 1}; "
                         "raise --data-bytes or lower --seq-len")
    starts = rng.integers(0, len(data) - seq_len - 1, size=(count, batch_size))
    windows = starts[..., None] + np.arange(seq_len + 1)
    return data[windows].astype(np.int32)


# --------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------

class MLP(nnx.Module):
    """``width -> 4 * width -> gelu -> width``; stock Flax or our fused layers."""

    def __init__(self, width: int, *, fused: bool, implementation: str | None,
                 rngs: nnx.Rngs):
        hidden = 4 * width
        if fused:
            # The gelu runs in the first matmul's epilogue, on the accumulator.
            self.up = layers.Dense(width, hidden, activation="gelu",
                                   implementation=implementation, rngs=rngs)
            self.down = layers.Dense(hidden, width, implementation=implementation, rngs=rngs)
            self.activation = None
        else:
            self.up = nnx.Linear(width, hidden, rngs=rngs)
            self.down = nnx.Linear(hidden, width, rngs=rngs)
            self.activation = jax.nn.gelu  # tanh form, the same as Dense's "gelu"

    def __call__(self, x):
        h = self.up(x)
        if self.activation is not None:
            h = self.activation(h)
        return self.down(h)


def _layer_norm(width: int, *, fused: bool, implementation: str | None, rngs: nnx.Rngs):
    """Pre-norm: stock ``nnx.LayerNorm`` or its drop-in ``layers.LayerNorm``."""
    if fused:
        return layers.LayerNorm(width, implementation=implementation, rngs=rngs)
    return nnx.LayerNorm(width, rngs=rngs)


class Block(nnx.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: Config, *, fused: bool, implementation: str | None,
                 rngs: nnx.Rngs):
        self.ln_attn = _layer_norm(cfg.width, fused=fused, implementation=implementation, rngs=rngs)
        # keep_rngs=False: no dropout, so the state is parameters only.
        if fused:  # flash attention; causality as is_causal, so masked blocks are skipped
            self.attn = layers.MultiHeadAttention(cfg.heads, cfg.width, decode=False, keep_rngs=False,
                                                  implementation=implementation, rngs=rngs)
        else:
            self.attn = nnx.MultiHeadAttention(cfg.heads, cfg.width, decode=False,
                                               keep_rngs=False, rngs=rngs)
        self.fused = fused
        self.ln_mlp = _layer_norm(cfg.width, fused=fused, implementation=implementation, rngs=rngs)
        self.mlp = MLP(cfg.width, fused=fused, implementation=implementation, rngs=rngs)

    def __call__(self, x, mask):
        h = self.ln_attn(x)
        x = x + (self.attn(h, is_causal=True) if self.fused else self.attn(h, mask=mask))
        return x + self.mlp(self.ln_mlp(x))


class ByteLM(nnx.Module):
    """Decoder-only transformer over bytes: ``[B, T]`` int tokens -> ``[B, T, 256]`` logits."""

    def __init__(self, cfg: Config, *, fused: bool, implementation: str | None,
                 rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, cfg.width, rngs=rngs)
        self.pos_embed = nnx.Embed(cfg.seq_len, cfg.width, rngs=rngs)
        self.blocks = nnx.List([Block(cfg, fused=fused, implementation=implementation, rngs=rngs)
                                for _ in range(cfg.layers)])
        self.ln_out = _layer_norm(cfg.width, fused=fused, implementation=implementation, rngs=rngs)
        self.head = nnx.Linear(cfg.width, VOCAB, rngs=rngs)
        self.fused, self.implementation = fused, implementation  # static: which loss to use

    def __call__(self, tokens):
        x = self.embed(tokens) + self.pos_embed(jnp.arange(tokens.shape[-1]))
        mask = nnx.make_causal_mask(tokens)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln_out(x))


def build_models(cfg: Config, seed: int, implementation: str | None) -> tuple[ByteLM, ByteLM]:
    """(stock, ops) models holding the same parameters.

    The ops model is created abstractly (no initialisation work) and then
    filled with the stock model's state: this works only because
    ``layers.Dense`` keeps nnx.Linear's parameter names and shapes, which is
    the drop-in promise under test.
    """
    stock = ByteLM(cfg, fused=False, implementation=None, rngs=nnx.Rngs(seed))
    ops_model = nnx.eval_shape(
        lambda: ByteLM(cfg, fused=True, implementation=implementation, rngs=nnx.Rngs(seed)))
    nnx.update(ops_model, nnx.state(stock))
    check_same_params(stock, ops_model)
    return stock, ops_model


def check_same_params(a: nnx.Module, b: nnx.Module) -> None:
    """Asserts equal parameter trees: same paths, shapes, dtypes and values."""
    pa, pb = nnx.state(a, nnx.Param), nnx.state(b, nnx.Param)
    la = jax.tree.leaves_with_path(pa)
    lb = jax.tree.leaves_with_path(pb)
    paths_a, paths_b = [p for p, _ in la], [p for p, _ in lb]
    assert paths_a == paths_b, f"parameter paths differ:\n{paths_a}\nvs\n{paths_b}"
    for (path, x), (_, y) in zip(la, lb):
        name = jax.tree_util.keystr(path)
        assert x.shape == y.shape and x.dtype == y.dtype, (
            f"{name}: {x.dtype}{x.shape} vs {y.dtype}{y.shape}")
        assert np.array_equal(np.asarray(x), np.asarray(y)), f"{name}: values differ"


# --------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------

def loss_fn(model: ByteLM, batch):
    """Mean next-byte cross-entropy (nats) of a ``[B, T + 1]`` batch."""
    logits = model(batch[:, :-1])
    if model.fused:
        return ops.cross_entropy(logits, batch[:, 1:], implementation=model.implementation).mean()
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def make_steps(graphdef, tx):
    """Jitted (train_step, eval_loss) over split state, so one graph serves many calls."""

    # No buffer donation: both runs start from the same parameter arrays, so
    # the first run must not consume them.
    @jax.jit
    def train_step(params, opt_state, batch):
        def f(p):
            return loss_fn(nnx.merge(graphdef, p), batch)
        loss, grads = jax.value_and_grad(f)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    @jax.jit
    def eval_loss(params, batch):
        return loss_fn(nnx.merge(graphdef, params), batch)

    return train_step, eval_loss


def train(model: ByteLM, tx, batches: np.ndarray, val_batches: np.ndarray, mesh=None) -> dict:
    """Trains ``model`` on ``batches``; returns its loss curve, step times and val loss.

    Every step is timed to ``block_until_ready``: step 0 includes compilation
    and is reported separately, the rest give the median. With ``mesh`` the
    parameters are placed by :func:`tensor_parallel_specs` and every batch is
    split over the ``data`` axis; jit and our ops' partitioning rules do the rest.
    """
    graphdef, params = nnx.split(model)
    place = lambda batch: jnp.asarray(batch)
    if mesh is not None:
        params = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s),
                                                     tensor_parallel_specs(params)))
        place = lambda batch: jax.device_put(batch, NamedSharding(mesh, P("data")))
    train_step, eval_loss = make_steps(graphdef, tx)
    opt_state = tx.init(params)
    losses, times = [], []
    for batch in batches:
        t0 = time.perf_counter()
        params, opt_state, loss = train_step(params, opt_state, place(batch))
        loss = float(jax.block_until_ready(loss))
        times.append(time.perf_counter() - t0)
        losses.append(loss)
    val = float(np.mean([eval_loss(params, place(b)) for b in val_batches]))
    steady = times[1:] or times
    return {"losses": losses, "step_times_ms": [1e3 * t for t in times],
            "first_step_ms": 1e3 * times[0], "median_step_ms": 1e3 * statistics.median(steady),
            "val_loss": val}


def tensor_parallel_specs(params):
    """Megatron-style PartitionSpecs over a ``("data", "model")`` mesh, per parameter.

    MLP: ``up`` column-parallel (kernel ``[D, 4D]`` split by columns, gelu
    epilogue local), ``down`` row-parallel (its contraction split: partial
    products + one all-reduce inside ops.fused_matmul). Attention: query/key/
    value kernels ``[D, heads, head_dim]`` split by heads (flash attention runs
    each device's heads), the output projection by its heads dim (one
    all-reduce). Embeddings, norms and the head are replicated; the batch is
    split over "data".
    """
    def spec(path, leaf):
        name = jax.tree_util.keystr(path)
        if ".mlp" in name and ".up" in name:
            return P(None, "model") if "kernel" in name else P("model")
        if ".mlp" in name and ".down" in name and "kernel" in name:
            return P("model", None)
        if ".attn" in name and any(f".{p}" in name for p in ("query", "key", "value")):
            return P(None, "model", None) if "kernel" in name else P("model", None)
        if ".attn" in name and ".out" in name and "kernel" in name:
            return P("model", None, None)
        return P()
    return jax.tree_util.tree_map_with_path(spec, params)


def parse_mesh(text: str) -> dict[str, int]:
    """``"data=4,model=2"`` -> ``{"data": 4, "model": 2}`` (a missing axis is 1)."""
    shape = {"data": 1, "model": 1}
    for part in text.split(","):
        name, _, size = part.partition("=")
        if name.strip() not in shape or not size.strip().isdigit() or int(size) < 1:
            raise argparse.ArgumentTypeError(
                f"--mesh takes data=N,model=M (positive ints), got {text!r}")
        shape[name.strip()] = int(size)
    return shape


# --------------------------------------------------------------------------
# Comparison and reporting
# --------------------------------------------------------------------------

def compare(stock: dict, ops_run: dict, args) -> list[str]:
    """Failure messages (empty when both checks pass)."""
    failures = []
    diffs = np.abs(np.array(stock["losses"]) - np.array(ops_run["losses"]))
    worst = int(np.argmax(diffs))
    if not np.all(np.isfinite(diffs)) or diffs[worst] > args.tolerance:
        failures.append(
            f"loss curves diverge: max |stock - ops| = {diffs[worst]:.3e} at step {worst} "
            f"(stock {stock['losses'][worst]:.5f}, ops {ops_run['losses'][worst]:.5f}) "
            f"exceeds --tolerance {args.tolerance:g}")
    if not args.no_learning_check:
        for name, run in (("stock", stock), ("ops", ops_run)):
            final = float(np.mean(run["losses"][-FINAL_WINDOW:]))
            if not final < args.max_final_loss:
                failures.append(
                    f"{name} run did not learn: mean loss of the last {FINAL_WINDOW} steps "
                    f"{final:.4f} is not below --max-final-loss {args.max_final_loss:g} "
                    f"(untrained: ln(256) = {math.log(VOCAB):.2f})")
    return failures


def print_report(stock: dict, ops_run: dict, log_every: int) -> None:
    print(f"{'step':>6} {'stock':>10} {'ops':>10} {'|diff|':>10}")
    n = len(stock["losses"])
    for step in range(n):
        if step % log_every == 0 or step == n - 1:
            a, b = stock["losses"][step], ops_run["losses"][step]
            print(f"{step:>6} {a:>10.5f} {b:>10.5f} {abs(a - b):>10.2e}")
    diffs = np.abs(np.array(stock["losses"]) - np.array(ops_run["losses"]))
    print(f"max |diff| over all {n} steps: {diffs.max():.3e}")
    for name, run in (("stock", stock), ("ops", ops_run)):
        print(f"{name:>5}: median step {run['median_step_ms']:8.2f} ms "
              f"(first step incl. compile {run['first_step_ms']:.0f} ms), "
              f"final val loss {run['val_loss']:.5f}")


class _ShowDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: X)`` to an option's help, except for unset (None) and flag defaults."""

    def _get_help_string(self, action):
        if action.default is None or isinstance(action.default, bool):
            return action.help
        return super()._get_help_string(action)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.lm",
        description="End-to-end check: a small byte-level language model trained with stock Flax "
                    "layers and with our layers must follow the same loss curve. Exits 1 if the "
                    "curves diverge by more than --tolerance or either run fails to learn.",
        formatter_class=_ShowDefaults)
    p.add_argument("--implementation", default=None, choices=ops.IMPLEMENTATIONS,
                   help="The ops implementation our layers use (default: the platform's, which "
                        "is 'xla' on a CPU; 'interpret' runs our kernels on a CPU).")
    p.add_argument("--steps", type=int, default=300, help="Training steps of each run.")
    p.add_argument("--batch-size", type=int, default=16, help="Sequences per training batch.")
    p.add_argument("--seq-len", type=int, default=128, help="Bytes per training sequence.")
    p.add_argument("--width", type=int, default=128, help="Model width (d_model).")
    p.add_argument("--layers", type=int, default=2, help="Transformer blocks.")
    p.add_argument("--heads", type=int, default=4,
                   help="Attention heads per block (must divide --width).")
    p.add_argument("--lr", type=float, default=3e-3, help="Peak AdamW learning rate.")
    p.add_argument("--seed", type=int, default=0,
                   help="Seed of the parameters and of the batch sampler.")
    p.add_argument("--data-bytes", type=int, default=3_000_000,
                   help="Bytes of standard-library source to read (training plus validation).")
    p.add_argument("--tolerance", type=float, default=2e-2,
                   help="Largest allowed |loss_stock - loss_ops| over every step.")
    p.add_argument("--max-final-loss", type=float, default=3.0,
                   help=f"The mean loss of the last {FINAL_WINDOW} steps must be below this.")
    p.add_argument("--no-learning-check", action="store_true",
                   help="Skip the --max-final-loss check (for very short runs).")
    p.add_argument("--mesh", type=parse_mesh, default=None, metavar="data=N,model=M",
                   help="Also train the ops model data- and tensor-parallel over an N x M "
                        "device mesh and compare its curve with the single-device ops run "
                        "(on a CPU: XLA_FLAGS=--xla_force_host_platform_device_count=N*M).")
    p.add_argument("--log-every", type=int, default=20,
                   help="Print both losses every this many steps.")
    p.add_argument("--json", metavar="OUT", default=None,
                   help="Write the config, both curves and the step times to this JSON file.")
    args = p.parse_args(argv)
    if args.width % args.heads:
        p.error(f"--width ({args.width}) must be a multiple of --heads ({args.heads})")
    if args.steps < 1:
        p.error("--steps must be >= 1")
    if args.mesh:
        if args.heads % args.mesh["model"]:
            p.error(f"--heads ({args.heads}) must be a multiple of the model axis "
                    f"({args.mesh['model']})")
        if args.batch_size % args.mesh["data"]:
            p.error(f"--batch-size ({args.batch_size}) must be a multiple of the data axis "
                    f"({args.mesh['data']})")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg = Config(width=args.width, layers=args.layers, heads=args.heads, seq_len=args.seq_len)
    train_data, val_data = load_corpus(args.data_bytes)
    rng = np.random.default_rng(args.seed)
    batches = sample_batches(train_data, args.steps, args.batch_size, args.seq_len, rng)
    val_batches = sample_batches(val_data, VAL_BATCHES, args.batch_size, args.seq_len, rng)
    print(f"data: {len(train_data):,} train / {len(val_data):,} val bytes of stdlib source; "
          f"model: {cfg}; {args.steps} steps of {args.batch_size}x{args.seq_len}; "
          f"implementation={args.implementation!r}; backend={jax.default_backend()}")

    stock_model, ops_model = build_models(cfg, args.seed, args.implementation)
    # Plain AdamW with a short linear warm-up (a cold start at full rate is
    # needlessly noisy); identical for both runs.
    schedule = optax.linear_schedule(0.0, args.lr, transition_steps=min(20, args.steps))
    tx = optax.adamw(schedule, weight_decay=0.01)
    stock = train(stock_model, tx, batches, val_batches)
    ops_run = train(ops_model, tx, batches, val_batches)

    print_report(stock, ops_run, args.log_every)
    failures = compare(stock, ops_run, args)
    mesh_run = None
    if args.mesh:
        size = args.mesh["data"] * args.mesh["model"]
        if jax.device_count() < size:
            print(f"FAIL: --mesh needs {size} devices, {jax.device_count()} visible (on a CPU set "
                  f"XLA_FLAGS=--xla_force_host_platform_device_count={size})", file=sys.stderr)
            return 1
        mesh = jax.make_mesh((args.mesh["data"], args.mesh["model"]), ("data", "model"),
                             axis_types=(AxisType.Auto, AxisType.Auto))
        mesh_run = train(ops_model, tx, batches, val_batches, mesh=mesh)
        diffs = np.abs(np.array(mesh_run["losses"]) - np.array(ops_run["losses"]))
        mesh_run["max_diff_vs_one_device"] = float(np.max(diffs))
        print(f"mesh {args.mesh}: max |loss(mesh) - loss(one device)| over {len(diffs)} steps: "
              f"{diffs.max():.3e}; median step {mesh_run['median_step_ms']:.2f} ms, "
              f"final val loss {mesh_run['val_loss']:.5f}")
        if not np.all(np.isfinite(diffs)) or diffs.max() > args.tolerance:
            failures.append(f"mesh run diverges from the one-device ops run: max |diff| "
                            f"{diffs.max():.3e} > --tolerance {args.tolerance:g}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "backend": jax.default_backend(),
                       "stock": stock, "ops": ops_run, "mesh": mesh_run, "passed": not failures,
                       "failures": failures}, f, indent=1)
    if failures:
        for msg in failures:
            print(f"FAIL: {msg}", file=sys.stderr)
        return 1
    print(f"OK: curves agree within {args.tolerance:g}"
          + ("" if args.no_learning_check else f" and both runs learned (< {args.max_final_loss:g})"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
