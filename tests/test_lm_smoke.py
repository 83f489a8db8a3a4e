"""``python -m benchmarks.lm`` on a tiny configuration: stock Flax and
our layers (Dense, LayerNorm, MultiHeadAttention: our kernels, via the
interpreter) train to the same curve.

Six steps are too few to learn, so the learning check is off; the curve
comparison and the shared-initialisation assertion still run.
"""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = 2e-2


def test_tiny_lm_curves_match(tmp_path):
    out = tmp_path / "lm.json"
    cmd = [sys.executable, "-m", "benchmarks.lm", "--steps", "6", "--width", "64",
           "--layers", "1", "--seq-len", "32", "--batch-size", "4",
           "--implementation", "interpret", "--no-learning-check",
           "--tolerance", str(TOLERANCE), "--data-bytes", "300000", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "max |diff|" in proc.stdout and "median step" in proc.stdout

    result = json.loads(out.read_text())
    assert result["passed"] and not result["failures"]
    stock = np.array(result["stock"]["losses"])
    ops_losses = np.array(result["ops"]["losses"])
    assert stock.shape == ops_losses.shape == (6,)
    assert np.all(np.isfinite(stock)) and np.all(np.isfinite(ops_losses))
    # Same initialisation and batches: step 0 differs by rounding only.
    assert abs(stock[0] - ops_losses[0]) < 1e-4
    assert np.max(np.abs(stock - ops_losses)) <= TOLERANCE
    for run in ("stock", "ops"):
        assert result[run]["median_step_ms"] > 0
        assert np.isfinite(result[run]["val_loss"])


def test_compare_flags_divergence_and_no_learning():
    """The exit-1 paths: curves apart by more than the tolerance; a loss that never drops."""
    from benchmarks import lm

    args = lm.parse_args(["--tolerance", "0.02", "--max-final-loss", "3.0"])
    good = {"losses": [5.5] + [2.5] * 20}
    assert lm.compare(good, good, args) == []

    shifted = {"losses": [5.5] + [2.5] * 10 + [2.6] + [2.5] * 9}
    (msg,) = lm.compare(good, shifted, args)
    assert "diverge" in msg and "step 11" in msg

    flat = {"losses": [5.5] * 21}
    failures = lm.compare(flat, flat, args)
    assert len(failures) == 2 and all("did not learn" in m for m in failures)
    assert lm.compare(flat, flat, lm.parse_args(["--no-learning-check"])) == []

    nan = {"losses": [5.5] + [float("nan")] * 20}
    assert any("diverge" in m for m in lm.compare(good, nan, args))
