"""Measured rankings of an op's implementations: which runs a call fastest on a device.

The default implementation on a GPU (``implementation=None``,
:mod:`ops._default`) is the fastest implementation that can run the call,
read from a ranking measured on the device: ours (``triton``,
``pallas_triton``, ``mosaic_gpu`` where registered) and the user's own
alternatives (``xla``; ``cudnn`` for attention) timed on the same shapes in
one process. A rankings file is JSON, shipped beside the tuning cache
(``ops/tuning/rankings.json``)::

    {"version": 1,
     "sources": {"h200-2026-11-27": {"path": "benchmarks/results/.../results.json",
                                     "device_kind": "NVIDIA H200", "commit": "7302f43", ...}},
     "entries": [
       {"op": "dot_product_attention", "device_kind": "NVIDIA H200", "dtype": "bfloat16",
        "bucket": [8192, 8192, 128], "variant": {"causal": true}, "pass": "fwd",
        "ranking": [{"implementation": "cudnn", "median_ms": 1.17},
                    {"implementation": "pallas_triton", "median_ms": 2.23},
                    {"implementation": "xla", "median_ms": 12.1}],
        "failed": [{"implementation": "triton", "error": "NotImplementedError: ..."}],
        "source": "h200-2026-11-27",
        "cases": ["dot_product_attention/causal/2x8192x8192x16x16x128/bfloat16/fwd"]}]}

An entry is keyed like a tuning cache entry (:mod:`ops.tuning.cache`: op,
device kind, dtype, shape bucket, the op's variant; the implementation is
what it ranks) and by its **pass**: ``"fwd"`` (the op alone), ``"fwd+bwd"``
(the op and its gradient: a training step) or ``"bwd"`` (the backward alone,
for a custom_vjp whose forward and backward may come from different
implementations). ``ranking`` lists the implementations that ran, fastest
first, with their median times; ``failed`` those that did not, with why;
``source`` names the run in ``sources`` (the measurement's file, device,
commit, date); ``cases`` the benchmark or tuner cases merged into the entry
(cases with one key are summed per implementation).

Lookups (:func:`lookup`) take the entry of the call's key on its device
kind; else the nearest measured one: entries of the same device kind, else
of its family (:func:`device_family`: the H100 and the H200 are one family,
``sm_90``, unless measured apart), whose buckets are within
:data:`NEAR_FACTOR` of the call's in every dim, nearest by (pass differs,
variant fields that differ, dtype differs, bucket distance in doublings).
None: nothing near was measured; the caller takes its stated safe order.

``python -m benchmarks.tune`` records rankings on each GPU lease (every
registered implementation timed on the tuner's problems) and ``--merge``
installs them; ``--from-results`` turns a benchmark run's ``results.json``
into entries. :func:`override` installs a table for a block (tests).
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import json
import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ops._implementation import IMPLEMENTATIONS
from ops.tuning import cache

RANKINGS_VERSION = 1
PACKAGED_RANKINGS = Path(__file__).resolve().parent / "rankings.json"
PASSES = ("fwd", "fwd+bwd", "bwd")
# A measured bucket serves calls at most this many times smaller or larger in every dim.
NEAR_FACTOR = 16

# Device families by the device kind's name: GPUs of one architecture share a ranking
# unless one of them was measured apart (its own entries come first).
_FAMILIES = (("sm_90", re.compile(r"\bG?H(100|200|800|20)\b")),
             ("sm_100", re.compile(r"\bG?B(100|200|300)\b")),
             ("sm_80", re.compile(r"\bA(100|800|30)\b")))


class RankingsError(ValueError):
    """A rankings file that cannot be used: unreadable, malformed or of another version."""


def device_family(device_kind: str) -> str | None:
    """The family of ``device_kind`` (``jax.Device.device_kind``): its CUDA architecture
    for the GPUs :data:`_FAMILIES` knows ("sm_90" for every H100, H200, H800, GH200),
    else None (a device kind that shares with no other)."""
    for family, pattern in _FAMILIES:
        if pattern.search(device_kind):
            return family
    return None


@dataclasses.dataclass(frozen=True)
class Ranking:
    """One measured entry (see the module docstring for the fields)."""

    op: str
    device_kind: str
    dtype: str
    bucket: tuple[int, ...]
    variant: tuple[tuple[str, Any], ...]
    pass_: str
    ranking: tuple[tuple[str, float], ...]
    failed: tuple[tuple[str, str], ...] = ()
    source: str = ""
    cases: tuple[str, ...] = ()

    @property
    def key(self) -> tuple:
        return (self.op, self.device_kind, self.dtype, self.bucket, self.variant, self.pass_)

    @property
    def names(self) -> tuple[str, ...]:
        """The implementations that ran, fastest first."""
        return tuple(name for name, _ in self.ranking)

    def time_of(self, name: str) -> float | None:
        return dict(self.ranking).get(name)

    def as_json(self) -> dict:
        entry = {"op": self.op, "device_kind": self.device_kind, "dtype": self.dtype,
                 "bucket": list(self.bucket), "pass": self.pass_,
                 "ranking": [{"implementation": n, "median_ms": t} for n, t in self.ranking]}
        variant = {k: v for k, v in self.variant if cache.variant_fields(self.op).get(k, v) != v}
        if variant:
            entry["variant"] = variant
        if self.failed:
            entry["failed"] = [{"implementation": n, "error": e} for n, e in self.failed]
        if self.source:
            entry["source"] = self.source
        if self.cases:
            entry["cases"] = list(self.cases)
        return entry


@dataclasses.dataclass(frozen=True)
class Match:
    """What :func:`lookup` found: the entry and how far it is from the call.

    Attributes:
      entry: the measured entry.
      exact: the call's own key was measured.
      differences: what differs from the call, in words (empty when exact).
    """

    entry: Ranking
    exact: bool
    differences: tuple[str, ...] = ()


def make_entry(op: str, device_kind: str, dtype, shape: Sequence[int], pass_: str,
               times: Mapping[str, float], failed: Mapping[str, str] | None = None,
               variant: Mapping | None = None, source: str = "",
               cases: Sequence[str] = ()) -> Ranking:
    """A validated entry for a problem of ``shape`` (bucketed) from ``times``
    (implementation -> median ms) and ``failed`` (implementation -> error).

    Raises:
      RankingsError: a bad pass, an unknown implementation, a time that is not > 0,
        a variant field ``op`` does not have.
    """
    return _entry_from_json({
        "op": op, "device_kind": device_kind, "dtype": np.dtype(dtype).name,
        "bucket": list(cache.shape_bucket(shape)), "variant": dict(variant or {}), "pass": pass_,
        "ranking": [{"implementation": n, "median_ms": float(t)}
                    for n, t in sorted(times.items(), key=lambda item: item[1])],
        "failed": [{"implementation": n, "error": str(e)} for n, e in (failed or {}).items()],
        "source": source, "cases": list(cases)}, "new entry")


def _entry_from_json(entry, where: str) -> Ranking:
    if not isinstance(entry, Mapping):
        raise RankingsError(f"{where}: expected an object, got {type(entry).__name__}.")
    missing = [k for k in ("op", "device_kind", "dtype", "bucket", "pass", "ranking")
               if k not in entry]
    if missing:
        raise RankingsError(f"{where}: missing key(s) {missing}.")
    for name in ("op", "device_kind", "dtype"):
        if not isinstance(entry[name], str) or not entry[name]:
            raise RankingsError(f"{where}: {name} must be a non-empty string, got {entry[name]!r}.")
    try:
        dtype = np.dtype(entry["dtype"]).name
    except TypeError as e:
        raise RankingsError(f"{where}: unknown dtype {entry['dtype']!r}.") from e
    bucket = entry["bucket"]
    if (not isinstance(bucket, list) or not bucket
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in bucket)
            or list(cache.shape_bucket(bucket)) != bucket):
        raise RankingsError(f"{where}: bucket must be a list of powers of two, got {bucket!r}.")
    if entry["pass"] not in PASSES:
        raise RankingsError(f"{where}: pass must be one of {PASSES}, got {entry['pass']!r}.")
    try:
        variant = tuple(sorted(cache.full_variant(entry["op"], entry.get("variant"), where).items()))
    except cache.TuningCacheError as e:
        raise RankingsError(str(e)) from None

    def implementations(key, value_key, check):
        rows = entry.get(key, [])
        if not isinstance(rows, list):
            raise RankingsError(f"{where}: {key} must be a list.")
        out = []
        for i, row in enumerate(rows):
            if (not isinstance(row, Mapping) or row.get("implementation") not in IMPLEMENTATIONS
                    or not check(row.get(value_key))):
                raise RankingsError(f"{where}: {key}[{i}] must be {{'implementation': one of "
                                    f"{IMPLEMENTATIONS}, '{value_key}': ...}}, got {row!r}.")
            out.append((row["implementation"], row[value_key]))
        return tuple(out)

    ranking = implementations("ranking", "median_ms", lambda t: isinstance(t, (int, float))
                              and not isinstance(t, bool) and math.isfinite(t) and t > 0)
    if [t for _, t in ranking] != sorted(t for _, t in ranking):
        raise RankingsError(f"{where}: ranking must be ordered fastest first.")
    failed = implementations("failed", "error", lambda e: isinstance(e, str))
    names = [n for n, _ in ranking + failed]
    if len(set(names)) != len(names):
        raise RankingsError(f"{where}: an implementation is listed twice: {names}.")
    cases = entry.get("cases", [])
    if not isinstance(cases, list) or not all(isinstance(c, str) for c in cases):
        raise RankingsError(f"{where}: cases must be a list of strings.")
    return Ranking(op=entry["op"], device_kind=entry["device_kind"], dtype=dtype,
                   bucket=tuple(bucket), variant=variant, pass_=entry["pass"],
                   ranking=tuple((n, float(t)) for n, t in ranking), failed=failed,
                   source=str(entry.get("source", "")), cases=tuple(cases))


@dataclasses.dataclass(frozen=True)
class Table:
    """A parsed rankings file: its entries by key and its sources."""

    entries: Mapping[tuple, Ranking]
    sources: Mapping[str, Mapping]


def parse(document, source: str = "<rankings>") -> Table:
    """The entries of a decoded rankings document.

    Raises:
      RankingsError: not a ``{"version", "entries"}`` object, another version, a bad
        entry, two entries with one key, or an entry whose source is not in ``sources``.
    """
    if not isinstance(document, Mapping) or "version" not in document or "entries" not in document:
        raise RankingsError(f"{source}: a rankings file must be a JSON object with 'version' and "
                            "'entries'.")
    if document["version"] != RANKINGS_VERSION:
        raise RankingsError(f"{source}: rankings version {document['version']!r}, but this "
                            f"library reads version {RANKINGS_VERSION}; rerun "
                            "`python -m benchmarks.tune` to regenerate it.")
    sources = document.get("sources", {})
    if not isinstance(sources, Mapping) or not isinstance(document["entries"], list):
        raise RankingsError(f"{source}: 'sources' must be an object and 'entries' a list.")
    table: dict[tuple, Ranking] = {}
    for i, raw in enumerate(document["entries"]):
        entry = _entry_from_json(raw, f"{source}: entries[{i}]")
        if entry.key in table:
            raise RankingsError(f"{source}: entries[{i}] repeats the key {entry.key}.")
        if entry.source and entry.source not in sources:
            raise RankingsError(f"{source}: entries[{i}] names source {entry.source!r}, which "
                                "'sources' does not describe.")
        table[entry.key] = entry
    return Table(table, dict(sources))


@functools.lru_cache(maxsize=8)
def _load(path: str, mtime_ns: int, size: int) -> Table:
    try:
        document = json.loads(Path(path).read_text())
    except OSError as e:
        raise RankingsError(f"{path}: cannot read the rankings ({e}).") from e
    except json.JSONDecodeError as e:
        raise RankingsError(f"{path}: not valid JSON ({e}).") from e
    return parse(document, path)


def load(path) -> Table:
    """The rankings file at ``path`` (parsed once per file version).

    Raises:
      RankingsError: a missing, unreadable or malformed file.
    """
    path = os.fspath(path)
    try:
        stat = os.stat(path)
    except OSError as e:
        raise RankingsError(f"{path}: cannot read the rankings ({e}).") from e
    return _load(path, stat.st_mtime_ns, stat.st_size)


_OVERRIDE: contextvars.ContextVar[Table | None] = contextvars.ContextVar("rankings_override",
                                                                        default=None)


@contextlib.contextmanager
def override(entries: Iterable[Ranking | Mapping], sources: Mapping[str, Mapping] | None = None):
    """Within the block, lookups read ``entries`` (and nothing else): a stub table for
    tests, or rankings measured in this process."""
    table: dict[tuple, Ranking] = {}
    for i, e in enumerate(entries):
        entry = e if isinstance(e, Ranking) else _entry_from_json(e, f"override[{i}]")
        table[entry.key] = entry
    token = _OVERRIDE.set(Table(table, dict(sources or {})))
    try:
        yield
    finally:
        _OVERRIDE.reset(token)


def current() -> Table:
    """The table lookups read: :func:`override`'s, else the packaged file."""
    table = _OVERRIDE.get()
    if table is not None:
        return table
    return load(PACKAGED_RANKINGS) if PACKAGED_RANKINGS.exists() else Table({}, {})


def _bucket_distance(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Doublings between two buckets, summed over dims; None when a dim is more than
    :data:`NEAR_FACTOR` apart (or the ranks differ)."""
    if len(a) != len(b):
        return None
    total, limit = 0, int(math.log2(NEAR_FACTOR))
    for x, y in zip(a, b):
        d = abs(int(math.log2(max(x, 1))) - int(math.log2(max(y, 1))))
        if d > limit:
            return None
        total += d
    return total


def lookup(op: str, device_kind: str, dtype, shape: Sequence[int], variant: Mapping | None,
           pass_: str) -> Match | None:
    """The ranking measured for a call, or the nearest one (see the module docstring).

    Args:
      op: the op's name.
      device_kind: the device the call runs on.
      dtype, shape, variant: the call's problem (:class:`ops._op.Problem`: dims
        bucketed here, the variant as its fields).
      pass_: "fwd" or "fwd+bwd" (a "bwd" entry answers only "bwd").

    Raises:
      RankingsError: a malformed packaged file.
    """
    dtype = np.dtype(dtype).name
    bucket = cache.shape_bucket(shape)
    want = dict(cache.full_variant(op, variant, f"{op}: variant")) if variant is not None else None
    entries = [e for e in current().entries.values() if e.op == op
               and (e.pass_ == pass_ or (pass_ != "bwd" and e.pass_ != "bwd"))]
    pool = [e for e in entries if e.device_kind == device_kind]
    family = device_family(device_kind)
    if not pool and family is not None:
        pool = [e for e in entries if device_family(e.device_kind) == family]
    scored = []
    for e in pool:
        distance = _bucket_distance(e.bucket, bucket)
        if distance is None:
            continue
        differing = tuple(k for k, v in e.variant if want is not None and want.get(k) != v)
        scored.append(((e.pass_ != pass_, len(differing), e.dtype != dtype, distance), e,
                       differing))
    if not scored:
        return None
    score, entry, differing = min(scored, key=lambda s: (s[0], s[1].key))
    words = []
    if entry.device_kind != device_kind:
        words.append(f"measured on {entry.device_kind} ({family} family)")
    if score[0]:
        words.append(f"pass {entry.pass_}")
    words += [f"{k}={dict(entry.variant)[k]!r}" for k in differing]
    if score[2]:
        words.append(f"dtype {entry.dtype}")
    if score[3]:
        words.append(f"bucket {'x'.join(map(str, entry.bucket))}")
    return Match(entry, exact=not words, differences=tuple(words))


def write(path, entries: Iterable[Ranking], sources: Mapping[str, Mapping] | None = None, *,
          merge: bool = True) -> int:
    """Writes ``entries`` (and ``sources``) to the rankings file ``path``; returns how
    many entries it holds. With ``merge`` the file's entries and sources are kept unless
    a new one has their key. Written whole to a temporary name and renamed.

    Raises:
      RankingsError: (with ``merge``) a malformed existing file.
    """
    path = Path(path)
    table: dict[tuple, Ranking] = {}
    all_sources: dict[str, Mapping] = {}
    if merge and path.exists():
        old = load(path)
        table.update(old.entries)
        all_sources.update(old.sources)
    all_sources.update(sources or {})
    for entry in entries:
        table[entry.key] = entry
    used = {e.source for e in table.values()}
    document = {"version": RANKINGS_VERSION,
                "sources": {k: dict(v) for k, v in sorted(all_sources.items()) if k in used},
                "entries": [e.as_json() for e in sorted(
                    table.values(), key=lambda e: (e.op, e.device_kind, e.dtype, e.bucket,
                                                   e.pass_, repr(e.variant)))]}
    parse(json.loads(json.dumps(document)), os.fspath(path))  # never write what cannot be read
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(document, indent=1) + "\n")
    tmp.replace(path)
    return len(table)
