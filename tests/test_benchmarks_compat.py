"""benchmarks.compat, the first step of a GPU session: every unsupported primitive, per kernel."""
import json

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive

import pallas_core as pl
from benchmarks import compat

# A primitive no lowering knows (as log2 was to our code generator under JAX 0.11).
UNKNOWN = Primitive("primitive_no_lowering_knows")
UNKNOWN.def_impl(lambda x: x)
UNKNOWN.def_abstract_eval(lambda x: x)


def _kernel(x_ref, o_ref):
    y = UNKNOWN.bind(x_ref[...])
    o_ref[...] = jnp.exp(UNKNOWN.bind(y * 2)) + 1


def _twice(backend):
    spec = pl.BlockSpec((8, 128), lambda i: (i, 0))

    def call(x, name):
        return pl.pallas_call(_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(2,),
                              in_specs=[spec], out_specs=spec, backend=backend, name=name)(x)
    return lambda x: call(call(x, "first_kernel") * 2, "second_kernel")


X = jax.ShapeDtypeStruct((16, 128), jnp.float32)


def test_our_code_generator_lists_every_unsupported_primitive_of_every_kernel():
    found = compat.check_source(_twice("triton"), [X])
    assert found["error"] is None and found["kernels"] == ["first_kernel", "second_kernel"]
    listed = {(u["kernel"], u["primitive"], u["where"].rsplit(":", 1)[-1]) for u in found["unsupported"]}
    line = _kernel.__code__.co_firstlineno
    assert listed == {(k, UNKNOWN.name, str(line + n)) for k in ("first_kernel", "second_kernel")
                      for n in (1, 2)}


def test_jax_triton_lowering_failure_lists_its_unsupported_primitives():
    found = compat.check_cuda_lowering(_twice("pallas_triton"), [X])
    assert UNKNOWN.name in found["error"]
    assert {(u["kernel"], u["primitive"]) for u in found["unsupported"]} == {
        ("first_kernel", UNKNOWN.name), ("second_kernel", UNKNOWN.name)}
    line = compat.verdict_line({"item": "x", "implementation": "pallas_triton", "ok": False,
                                "seconds": 0.1, **found})
    assert line.startswith("FAIL x [pallas_triton]") and "second_kernel" in line


def test_a_subset_runs_and_writes_its_report(tmp_path, capsys):
    assert compat.main(["--filter", "rms_norm", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "compat.json").read_text())
    assert report["ok"] and report["versions"]["jax"] == jax.__version__
    implementations = {v["implementation"] for v in report["verdicts"]}
    assert {"triton", "pallas_triton"} <= implementations
    assert all(v["ok"] and "rms_norm" in v["item"] for v in report["verdicts"])
    kernels = {k for v in report["verdicts"] for k in v.get("kernels", [])}
    assert {"rms_norm_fwd", "rms_norm_bwd"} <= kernels  # the training step's kernels too
    text = (tmp_path / "compat.txt").read_text()
    assert "check(s) passed" in text and "versions:" in text
    assert "ok   op rms_norm" in capsys.readouterr().out  # printed as each check ends
