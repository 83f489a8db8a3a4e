"""``python -m benchmarks.attention_memory``: how much memory attention's training step needs.

Compiles (never runs) the gradient of ``sum(attention(q, k, v))`` with
respect to q, k and v for ``ops.dot_product_attention`` (default
implementation "interpret", on the CPU host) and for the XLA baseline
``jax.nn.dot_product_attention(implementation="xla")``, and prints XLA's
``memory_analysis()`` of both: temporary, argument and output bytes, and the
baseline-over-ours ratios (:func:`benchmarks.attention.memory_report`).
Default problem: B = 1, T = S = 2048, N = K = 4, H = 64, float32, not causal.

Writes the report as JSON to ``benchmarks/results/latest/attention_memory.json``
(or ``--out``), the folder :file:`benchmarks/gpu_session.sh` also writes to.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import jax

from benchmarks import attention
from benchmarks.__main__ import RESULTS_ROOT, git_commit

DEFAULT_OUT = RESULTS_ROOT / "latest" / "attention_memory.json"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.attention_memory",
                                     description="Compile attention's training step, ours and "
                                     "XLA's, and report the memory each needs (nothing runs).")
    b, t, n, h = attention.MEMORY_SHAPE
    parser.add_argument("--seq-len", type=int, default=t,
                        help=f"Queries and keys, T = S (default {t}).")
    parser.add_argument("--batch", type=int, default=b, help=f"Batch size B (default {b}).")
    parser.add_argument("--heads", type=int, default=n,
                        help=f"Query and key/value heads, N = K (default {n}).")
    parser.add_argument("--head-dim", type=int, default=h, help=f"Head dim H (default {h}).")
    parser.add_argument("--dtype", default=attention.MEMORY_DTYPE,
                        help=f"Dtype of q, k and v (default {attention.MEMORY_DTYPE}).")
    parser.add_argument("--causal", action="store_true", help="Causal attention (default: full).")
    parser.add_argument("--implementation", default="interpret",
                        help="Our implementation to compile (default interpret).")
    parser.add_argument("--platform", default="cpu",
                        help="Device platform to compile for (default cpu).")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="JSON file to write (default benchmarks/results/latest/"
                             "attention_memory.json, ignored by git).")
    return parser.parse_args(argv)


def format_report(report: dict) -> str:
    """A plain-text table: one row per implementation, one column per byte count."""
    c = report["config"]
    title = (f"attention fwd+bwd memory, B={c['batch']} T=S={c['q_len']} N=K={c['heads']} "
             f"H={c['head_dim']} {c['dtype']}{' causal' if c['causal'] else ''}, compiled for "
             f"{c['device_kind']} ({c['platform']})")
    fields = ("temp_bytes", "argument_bytes", "output_bytes", "peak_bytes")
    header = f"{'implementation':<16}" + "".join(f"{f:>26}" for f in fields)
    lines = [title, header]
    for name, row in report["implementations"].items():
        cells = (f"{row[f]:,d} ({row[f] / 2**20:.2f} MiB)" for f in fields)
        lines.append(f"{name:<16}" + "".join(f"{cell:>26}" for cell in cells))
    ratios = report["ratios"]
    lines.append("baseline / ours: " + ", ".join(
        f"{f} {ratios[f]:.1f}x" if ratios[f] is not None else f"{f} -" for f in ratios))
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    report = attention.memory_report(args.seq_len, batch=args.batch, heads=args.heads,
                                     head_dim=args.head_dim, dtype=args.dtype,
                                     causal=args.causal, implementation=args.implementation,
                                     platform=args.platform)
    report["meta"] = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "jax_version": jax.__version__, "git_commit": git_commit(),
        "python": sys.version.split()[0], "compile_seconds": time.perf_counter() - start,
    }
    print(format_report(report))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"Report written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
