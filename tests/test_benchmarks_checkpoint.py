"""A benchmark run cut short by its budget or by SIGTERM keeps what it measured, and
``--resume`` finishes it (benchmarks.checkpoint, benchmarks.suite.run_order)."""
import json
import os
import signal
import time

import pytest

from benchmarks import checkpoint, suite
from benchmarks.__main__ import main


def test_run_order_puts_the_headline_first_then_takes_each_op_in_turn():
    cases = suite.collect_cases("gpu")
    order = suite.run_order(cases)
    assert sorted(c.name for c in order) == sorted(c.name for c in cases)  # a permutation
    for prefix in suite.HEADLINE_CASES:  # no prefix outlives a renamed case
        assert any(c.name.startswith(prefix) for c in cases), prefix
    ranks = [suite.headline_rank(c.name) for c in order]
    n_headline = sum(r is not None for r in ranks)
    assert ranks[:n_headline] == sorted(ranks[:n_headline]) and None not in ranks[:n_headline]
    assert order[0].name == "dot_product_attention/causal/2x8192x8192x16x16x128/bfloat16/fwd"
    # After the headline every op with cases left comes up once before any comes up twice.
    rest = order[n_headline:]
    ops_left = {c.op for c in rest}
    assert {c.op for c in rest[:len(ops_left)]} == ops_left


def test_budget_then_resume_measures_every_case_once(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    # A budget spent before the first case: nothing runs, and the report says what is left.
    assert main(["--quick", "--no-static", "--filter", "rms_norm", "--budget-s", "1e-9",
                 "--out", str(first)]) == 1
    meta = json.loads((first / "results.json").read_text())["meta"]
    assert meta["complete"] is False and "budget" in meta["stopped"]
    assert len(meta["not_run"]) == 2 and "Incomplete: 2 case(s)" in (first / "results.md").read_text()

    assert main(["--quick", "--no-static", "--filter", "rms_norm", "--resume",
                 str(first / "results.json"), "--out", str(second)]) == 0
    data = json.loads((second / "results.json").read_text())
    assert data["meta"]["complete"] is True and data["meta"]["not_run"] == []
    assert data["meta"]["resumed_from"]["cases"] == 0
    cases = [r["case"] for r in data["rows"] if r["implementation"] == "xla"]
    assert sorted(cases) == sorted(meta["not_run"])

    # A finished run resumed again runs nothing more and keeps its rows.
    third = tmp_path / "third"
    assert main(["--quick", "--no-static", "--filter", "rms_norm", "--resume",
                 str(second / "results.json"), "--out", str(third)]) == 0
    assert json.loads((third / "results.json").read_text())["rows"] == data["rows"]


def test_resume_refuses_another_device_or_kind_of_run(tmp_path):
    path = tmp_path / "results.json"
    checkpoint.write_checkpoint(path, {"device_kind": "NVIDIA H100", "platform": "gpu",
                                       "timed": True}, [], ["a"])
    with pytest.raises(ValueError, match="--resume .*NVIDIA H100"):
        checkpoint.load_resume(path, device_kind="cpu", platform="cpu", timed=False)
    rows, summary = checkpoint.load_resume(path, device_kind="NVIDIA H100", platform="gpu",
                                           timed=True)
    assert rows == [] and summary["cases"] == 0
    path.write_text("{}")
    with pytest.raises(ValueError, match="not a results.json"):
        checkpoint.load_resume(path, device_kind="cpu", platform="cpu", timed=False)


def test_sigterm_becomes_stopped_and_the_handler_is_restored():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(checkpoint.Stopped), checkpoint.stop_on_sigterm():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # interrupted: the handler raises in this thread
    assert signal.getsignal(signal.SIGTERM) is before


def test_budget_must_be_positive():
    with pytest.raises(ValueError, match="budget_s"):
        checkpoint.Budget(0)
    assert not checkpoint.Budget(None).spent()


@pytest.mark.parametrize("module", ["benchmarks.__main__", "benchmarks.smoke", "benchmarks.compat",
                                    "benchmarks.lease_queue"])
def test_every_budgeted_cli_refuses_a_budget_that_is_not_positive(module, capsys):
    import importlib
    parse_args = importlib.import_module(module).parse_args
    assert parse_args(["--budget-s", "2.5"]).budget_s == 2.5
    for bad in ("0", "-1", "soon"):
        with pytest.raises(SystemExit):
            parse_args(["--budget-s", bad])
        assert "positive number of seconds" in capsys.readouterr().err
