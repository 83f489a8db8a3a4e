"""benchmarks.smoke and benchmarks.live_failures: a GPU session's checks keep every failure's message."""
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp

from benchmarks import harness, smoke

REPO_ROOT = Path(__file__).resolve().parents[1]


def _case(**implementations):
    return harness.Case(
        op="toy", variant="plain", shape=(8, 16), dtype="float32", pass_name="fwd", flops=1.0,
        make_inputs=lambda key: (jax.random.normal(key, (8, 16)),),
        implementations={"xla": lambda x: jnp.tanh(x), **implementations},
        reference=lambda x: jnp.tanh(harness.upcast(x)))


def _raises(x):
    raise ValueError("a message that is long enough to be cut by a one-line summary " * 4)


def test_each_verdict_carries_the_whole_message_and_our_frames():
    case = _case(right=lambda x: jnp.tanh(x), wrong=lambda x: jnp.tanh(x) * 1.5, broken=_raises)
    steps = harness.StepTimes()
    prepared = harness.prepare_case(case, jax.random.key(0), steps)
    rows = {name: smoke.verdict(case, name, call, prepared, steps)
            for name, call in harness.baseline_first(prepared.compiled)}
    assert rows["xla"]["ok"] and rows["right"]["ok"] and rows["right"]["max_rel_error"] < 1e-6
    assert not rows["wrong"]["ok"] and "above the float32 limit" in rows["wrong"]["error"]
    broken = rows["broken"]
    assert not broken["ok"] and broken["error"].split("\n")[0].count("a message that is long enough") == 4
    assert "test_benchmarks_smoke.py" in broken["error"] and "_raises" in broken["error"]
    assert smoke.line(broken).startswith("FAIL toy/plain/8x16/float32/fwd [broken]: ValueError")


def test_one_case_per_op_and_variant_with_its_backward():
    cases = smoke.smoke_cases("gpu")
    assert len({(c.op, c.variant) for c in cases}) == len(cases)
    assert {c.op for c in cases} >= {"fused_matmul", "dot_product_attention", "layer_norm",
                                      "gated_linear_unit", "paged_attention", "ragged_dot"}
    attention = [c for c in cases if c.op == "dot_product_attention" and c.variant == "causal"]
    assert [c.pass_name for c in attention] == ["fwd+bwd"]


def test_a_run_writes_each_verdict_as_it_comes(tmp_path):
    assert smoke.main(["--filter", "rms_norm/scale/", "--out", str(tmp_path)]) == 0
    rows = [json.loads(line) for line in (tmp_path / "smoke.jsonl").read_text().splitlines()]
    assert {r["implementation"] for r in rows} == {"xla", *harness.kernel_implementations("cpu")}
    assert all(r["ok"] and r["case"].startswith("rms_norm/scale/") for r in rows)
    assert "implementation(s) passed" in (tmp_path / "smoke.txt").read_text()


def test_pytest_failures_are_written_before_a_cut(tmp_path):
    (tmp_path / "test_cut.py").write_text(textwrap.dedent("""
        import os, signal
        def test_fails():
            assert 1 == 2, "the message a cut must not lose"
        def test_cut():
            os.kill(os.getpid(), signal.SIGINT)  # what timeout -s INT sends
    """))
    log = tmp_path / "failures.txt"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "benchmarks.live_failures",
                           "--live-failures", str(log), "-o", "addopts=", "-p", "no:cacheprovider",
                           "-p", "no:randomly", "--rootdir", str(tmp_path), "-q",
                           str(tmp_path / "test_cut.py")],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert "KeyboardInterrupt" in proc.stdout, proc.stdout[-2000:]
    assert "the message a cut must not lose" in log.read_text()
    assert "FAILED test_cut.py::test_fails" in proc.stdout
