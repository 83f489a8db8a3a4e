"""The op layer (ops/_op.py) for every registered op: typed configs, their heuristics and
candidates, the tuning key, and the tuner and the cache iterating the registry
(docs/design.md §5). Nothing is traced: configs are plain values."""
from __future__ import annotations

import dataclasses

import pytest

import ops  # noqa: F401 - registers every op
import ops.tuning as tuning
from ops import _op
from ops.tuning import cache, search

OPS = tuple(op.name for op in _op.registered())
KIND = "op-registry test device"


def _shape(op: _op.Op) -> tuple[int, ...]:
    """A problem of ``op``: its tuner's quick (else first) problem, else 100 per dim (a
    size no power-of-two tile divides)."""
    if op.tuning is not None and (op.tuning.quick or op.tuning.shapes):
        return tuple((op.tuning.quick or op.tuning.shapes)[0])
    return (100,) * len(op.dims)


def _problem(op: _op.Op, dtype="bfloat16", shape=None) -> _op.Problem:
    shape = _shape(op) if shape is None else shape
    variant = op.tuning.variant(shape) if op.tuning is not None and op.tuning.variant else None
    return op.problem(shape, dtype, variant)


def _cases():
    return [(name, backend) for name in OPS for backend, cls in _op.get(name).configs.items()
            if cls is not None]


def _check_config(config, cls, where):
    assert type(config) is cls, where
    hash(config)  # a custom_vjp nondiff argument and a dict key
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(config, dataclasses.fields(config)[0].name, 1)
    for name in cls.tunable_fields():
        value = getattr(config, name)
        assert value is None or (isinstance(value, int) and not isinstance(value, bool)
                                 and value > 0), (where, name, value)


def test_the_registry_holds_the_public_ops():
    assert {"fused_matmul", "dot_product_attention", "layer_norm", "rms_norm", "softmax",
            "log_softmax", "logsumexp", "sum", "mean", "max", "cross_entropy",
            "linear_cross_entropy"} <= set(OPS)
    for name in OPS:
        op = _op.get(name)
        assert op.name == name and op.configs and callable(op.reference)
        assert cache.config_fields(name) == op.tunable_fields()
        assert set(op.kernel_backends) <= set(ops.IMPLEMENTATIONS) - {"xla"}
    with pytest.raises(KeyError, match="no op 'conv' is registered"):
        _op.get("conv")


@pytest.mark.parametrize("name,backend", _cases())
def test_heuristic_and_candidates(name, backend):
    """The heuristic is a valid config whose cache form gives it back; the candidates are
    non-empty, distinct and valid, and each makes a cache entry that Op.select turns into
    that candidate."""
    op = _op.get(name)
    cls = op.config_type(backend)
    problem = _problem(op)
    device = _op.Device(backend, KIND)
    heuristic = cls.heuristic(problem, device)
    _check_config(heuristic, cls, (name, backend, "heuristic"))
    assert cls.from_tuned(heuristic.tuned(), problem, device) == heuristic
    if backend == "triton":  # Triton's CPU interpreter: other tiles, still a valid config
        _check_config(cls.heuristic(problem, dataclasses.replace(device, interpreter=True)), cls,
                      (name, "interpreter"))
    candidates = cls.candidates(problem, device)
    assert candidates, (name, backend)
    assert len(set(candidates)) == len(candidates), (name, backend, "repeated candidates")
    for c in candidates:
        _check_config(c, cls, (name, backend, c))
    first = candidates[0]
    entry = tuning.make_entry(name, backend, KIND, problem.dtype, problem.shape, first.tuned(),
                              variant=problem.variant_dict())
    with tuning.device_kind(KIND), tuning.override([entry]):
        here = _op.Device.current(backend)  # Triton's CPU interpreter for triton on this host
        assert here.kind == KIND
        assert op.select(problem, backend) == cls.from_tuned(first.tuned(), problem, here)
        assert op.select(problem, backend, explicit=heuristic) is heuristic
    if "mosaic_gpu" not in op.implementations:  # an op whose Mosaic GPU kernels are not built
        with pytest.raises(NotImplementedError, match="mosaic_gpu"):
            op.config_type("mosaic_gpu")


@pytest.mark.parametrize("name", OPS)
def test_tuning_key_holds_what_changes_the_kernel(name):
    """dtype, the shape bucket and every variant field change the key; dims in one
    bucket share it."""
    op = _op.get(name)
    shape = _shape(op)
    key = _problem(op, shape=shape).key("triton", KIND)
    assert _problem(op, "float32", shape).key("triton", KIND) != key
    assert _problem(op, shape=(2 * shape[0],) + shape[1:]).key("triton", KIND) != key
    same_bucket = tuple(max(1, (1 << (d - 1).bit_length()) - 1 if d > 2 else d) for d in shape)
    assert (op.problem(same_bucket, "bfloat16", _problem(op, shape=shape).variant_dict())
            .key("triton", KIND) == key)
    assert key != _problem(op, shape=shape).key("pallas_triton", KIND)
    if op.variant is None:
        assert _problem(op).variant == ()
        return
    plain = op.problem(shape, "bfloat16").key("triton", KIND)
    for field, default in op.variant.defaults().items():
        other = (not default if isinstance(default, bool) else default + 1 if isinstance(default, int)
                 else "x")
        assert op.problem(shape, "bfloat16", {field: other}).key("triton", KIND) != plain, field
    with pytest.raises(tuning.TuningCacheError, match="unknown variant field"):
        op.problem(shape, "bfloat16", {"no_such_field": True})


def test_attention_key_separates_causal_calls():
    op = _op.get("dot_product_attention")
    full = op.problem((4096, 4096, 128), "bfloat16")
    causal = op.problem((4096, 4096, 128), "bfloat16", {"causal": True})
    assert full.key("triton", KIND) != causal.key("triton", KIND)
    assert (op.problem((3000, 4096, 128), "bfloat16", {"causal": True}).key("triton", KIND)
            == causal.key("triton", KIND))


def test_the_tuner_enumerates_the_registry():
    tuned = [op for op in _op.registered() if op.tuning is not None]
    assert {op.name for op in search.tuned_ops()} == {op.name for op in tuned}
    orders = [op.tuning.order for op in search.tuned_ops()]
    assert orders == sorted(orders)
    problems = search.main_problems() + search.quick_problems()
    assert {p.op for p in problems} == {op.name for op in tuned if op.tuning.shapes or op.tuning.quick}
    assert len(search.main_problems()) == sum(len(op.tuning.shapes) for op in tuned)


def test_registering_an_op_adds_it_to_the_tuner_and_the_cache(monkeypatch):
    monkeypatch.setattr(_op, "_REGISTRY", dict(_op._REGISTRY))
    monkeypatch.setattr(cache, "_CONFIG_FIELDS", dict(cache._CONFIG_FIELDS))
    monkeypatch.setattr(cache, "_VARIANT_FIELDS", dict(cache._VARIANT_FIELDS))

    @dataclasses.dataclass(frozen=True)
    class ToyConfig(_op.KernelConfig):
        block: int = _op.tunable()
        num_warps: int | None = _op.tunable(None)
        walk: str = "grid"

        @classmethod
        def heuristic(cls, problem, device):
            return cls(_op.fit(64, problem.shape[0]))

        @classmethod
        def candidates(cls, problem, device):
            return tuple(dict.fromkeys(cls(_op.fit(b, problem.shape[0]), w)
                                       for b in (32, 64, 128) for w in (4, 8)))

    toy = _op.register(_op.Op(
        name="toy", dims=("rows",), configs={"triton": ToyConfig}, reference=lambda x: x,
        tuning=_op.Tuning(example=lambda problem, impl: (lambda x: x, []), shapes=((1000,),),
                          quick=((40,),), order=15)))
    assert _op.get("toy") is toy and "toy" in cache.ops()
    assert cache.config_fields("toy") == ("block", "num_warps")
    (problem,) = [p for p in search.main_problems() if p.op == "toy"]
    assert search.candidates(problem)[0] == {"block": 32, "num_warps": 4}
    assert [p.shape for p in search.quick_problems() if p.op == "toy"] == [(40,)]
    entry = problem.entry(ToyConfig(16, 2), KIND)
    assert entry["config"] == {"block": 16, "num_warps": 2} and "variant" not in entry
    with pytest.raises(tuning.TuningCacheError, match="unknown config field 'walk'"):
        tuning.make_entry("toy", "triton", KIND, "float32", (8,), {"walk": 1})
    with pytest.raises(ValueError, match="registered already"):
        _op.register(dataclasses.replace(toy))
    with pytest.raises(ValueError, match="configs names 'cuda'"):
        _op.register(_op.Op("toy2", ("rows",), {"cuda": ToyConfig}, reference=lambda x: x))

    @dataclasses.dataclass
    class Mutable(_op.KernelConfig):
        block: int = 1

    with pytest.raises(ValueError, match="frozen dataclass"):
        _op.register(_op.Op("toy3", ("rows",), {"triton": Mutable}, reference=lambda x: x))
    with pytest.raises(ValueError, match="shape: toy takes 1 dims"):
        toy.problem((1, 2), "float32")
    assert toy.problem((5,), "float32").rows == 5  # dims by name
    with pytest.raises(AttributeError):
        toy.problem((5,), "float32").features
