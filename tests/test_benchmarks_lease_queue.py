"""benchmarks.lease_queue: the queued A/B experiments and their side-by-side runner."""
import copy
import json

import jax
import pytest

from benchmarks import lease_queue

QUEUE = lease_queue.load_queue()


def test_every_arm_names_a_gpu_case_and_an_implementation_it_has():
    assert [e["name"] for e in QUEUE][:2] == ["tma-matmul-fwd", "tma-matmul-training"]
    for experiment in QUEUE:
        for arm in experiment["arms"]:
            case = lease_queue.resolve_case(arm["case"], "gpu", quick=False)
            assert case.name == arm["case"] and arm["implementation"] in case.implementations
            quick = lease_queue.resolve_case(arm["case"], "cpu", quick=True)
            assert (quick.op, quick.pass_name) == (case.op, case.pass_name)


def test_a_malformed_queue_is_refused_naming_the_experiment(tmp_path):
    for broken, message in ((lambda e: e["prediction"].pop("why"), "figure and why"),
                            (lambda e: e["arms"][0].update(tmma=True), "unknown settings"),
                            (lambda e: e.update(metric="faster"), "metric must be")):
        experiment = copy.deepcopy(QUEUE[0])
        broken(experiment)
        path = tmp_path / "queue.json"
        path.write_text(json.dumps({"experiments": [experiment]}))
        with pytest.raises(ValueError, match=f"tma-matmul-fwd.*{message}"):
            lease_queue.load_queue(path)


def test_arms_run_side_by_side_and_are_judged_against_the_prediction():
    experiment = copy.deepcopy(QUEUE[0])  # TMA off / on, on the CPU's quick matmul case
    experiment["prediction"]["range"] = [[1.0, 1.0], [0.0, 100.0]]
    rows = []
    verdict = lease_queue.run_experiment(experiment, platform="cpu", quick=True,
                                         key=jax.random.key(0), iters=3, max_seconds=0.05,
                                         emit=rows.append)
    arms = [r for r in rows if r["kind"] == "arm"]
    assert [r["arm"] for r in arms] == ["tma off", "tma on"] and rows[-1]["kind"] == "verdict"
    for row in arms:
        assert row["error"] is None and row["max_rel_error"] < 1e-5
        assert len(row["round_ms"]) == lease_queue.ROUNDS and row["median_ms"] > 0
    assert verdict["values"][0] == 1.0 and verdict["outcomes"] == ["as predicted"] * 2
    assert "tma on" in lease_queue.verdict_text(verdict)


def test_a_cpu_run_checks_without_timing_and_writes_its_files(tmp_path):
    assert lease_queue.main(["--only", "matmul-tile-128x256", "--out", str(tmp_path)]) == 0
    rows = [json.loads(line) for line in (tmp_path / "queue.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in rows] == ["arm", "arm", "verdict"]
    assert rows[-1]["outcomes"] == ["not timed", "not timed"]
    assert all(r["max_rel_error"] < 1e-5 for r in rows[:2])
    assert "| matmul-tile-128x256 |" in (tmp_path / "queue.md").read_text()


def test_each_arm_traces_its_own_settings():
    """A config arm's tiles and a TMA arm's descriptors reach the generated kernel."""
    import pallas_core as pl

    def source(experiment, i):
        arm = next(e for e in QUEUE if e["name"] == experiment)["arms"][i]
        case = lease_queue.resolve_case(arm["case"], "gpu", quick=True)
        args = jax.eval_shape(case.make_inputs, jax.random.key(0))
        with lease_queue.arm_settings(arm, case):
            return "\n".join(pl.triton.source(case.implementations[arm["implementation"]], *args))

    assert "tl.arange(0, 256)" not in source("matmul-tile-128x256", 0)
    assert "tl.arange(0, 256)" in source("matmul-tile-128x256", 1)
    assert "make_tensor_descriptor" not in source("tma-matmul-fwd", 0)
    assert "make_tensor_descriptor" in source("tma-matmul-fwd", 1)
