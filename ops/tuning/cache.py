"""The autotuning cache: tuned launch configurations, looked up when an op is traced.

A cache file is JSON::

    {"version": 2,
     "entries": [
       {"op": "fused_matmul", "implementation": "triton",
        "device_kind": "NVIDIA H100 80GB HBM3", "dtype": "bfloat16",
        "bucket": [4096, 4096, 4096],
        "config": {"block_m": 128, "block_n": 128, "block_k": 64,
                   "num_warps": 8, "num_stages": 3},
        "measured": {"median_ms": 0.71, "commit": "ee0a11e", ...}},
       {"op": "dot_product_attention", "implementation": "triton", ...,
        "bucket": [4096, 4096, 128], "variant": {"causal": true, "group": 4, ...},
        "config": {"block_q": 128, "block_k": 64}}]}

An entry is keyed by op, implementation, device kind (``jax.Device.device_kind``),
dtype name, shape bucket (:func:`shape_bucket`: every problem dim rounded up
to a power of two, so 3000 and 4096 rows share an entry) and variant:
everything else about the call that changes the op's kernel
(the op's :class:`ops._op.Variant`: for attention causal or not, the window, segment ids,
sequence lengths, bias and mask and their broadcast pattern, the bias dtype,
dropout, the soft cap and the query heads per key/value head). A variant
field an entry leaves out has its plain-call value (not causal, no mask, ...),
so an entry without ``variant`` is the plain call's; ops with no variant
fields have none. ``config`` holds the op's tunable fields
(those its config classes mark :func:`ops._op.tunable`); ``measured`` is free-form provenance (time, commit,
date) that lookups ignore.

Where lookups look, first match wins:

1. entries installed with :func:`override` (the tuner's candidates, tests);
2. the user's file: :func:`set_cache_file`, else the environment variable
   ``PALLAS_KERNELS_TUNING_CACHE``;
3. the file shipped in the package (``ops/tuning/configs.json``, filled by
   ``python -m benchmarks.tune`` on a GPU).

No match: the op's heuristic decides. An explicit ``block_sizes=`` (or
``max_chunk=``) argument is never overridden by the cache.

Versioning: ``version`` is :data:`CACHE_VERSION`; it is raised whenever the
meaning of a config field or of the key changes (version 2 added the variant:
version 1 keyed attention by shapes and dtype alone, so causal and non-causal
calls shared an entry), and a file of another version is refused
with a :class:`TuningCacheError` (rerun the tuner) rather than read with the
wrong meaning.

The design follows the idea of Triton's ``autotune`` (configs keyed by the
problem's sizes) and tokamax's autotuning cache (keyed by device kind, stored
as data beside the code), written here for JAX's trace-time selection.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import jax
import numpy as np

CACHE_VERSION = 2
ENV_VAR = "PALLAS_KERNELS_TUNING_CACHE"
PACKAGED_CACHE = Path(__file__).resolve().parent / "configs.json"

# Each registered op's schema (ops._op.register declares it): its tunable config
# fields (every one a positive int) and its variant fields with the value a plain
# call has (an entry's "variant" names those that differ). Values are JSON scalars:
# bool, int, str or null.
_CONFIG_FIELDS: dict[str, tuple[str, ...]] = {}
_VARIANT_FIELDS: dict[str, dict[str, bool | int | str | None]] = {}
_ENTRY_KEYS = ("op", "implementation", "device_kind", "dtype", "bucket", "config")


def declare(op: str, config_fields: Sequence[str], variant_fields: Mapping | None = None) -> None:
    """Makes ``op`` known to the cache: the names of its tunable config fields and its
    variant fields with their plain-call values (:func:`ops._op.register` calls this
    for every registered op)."""
    _CONFIG_FIELDS[op] = tuple(config_fields)
    _VARIANT_FIELDS[op] = dict(variant_fields or {})


def ops() -> tuple[str, ...]:
    """The ops the cache knows (every registered op), sorted."""
    return tuple(sorted(_CONFIG_FIELDS))


def config_fields(op: str) -> tuple[str, ...]:
    """The tunable config fields of ``op`` (empty for an op the cache does not know)."""
    return _CONFIG_FIELDS.get(op, ())


def variant_fields(op: str) -> dict:
    """The variant fields of ``op`` with their plain-call values (empty: no variant)."""
    return dict(_VARIANT_FIELDS.get(op, {}))


class TuningCacheError(ValueError):
    """A tuning cache file that cannot be used: unreadable, malformed or of another version."""


def shape_bucket(shape: Sequence[int]) -> tuple[int, ...]:
    """Every dim rounded up to a power of two (0 stays 0): the cache's shape key."""
    return tuple(0 if d <= 0 else 1 << (int(d) - 1).bit_length() for d in shape)


def _key(op, implementation, device_kind, dtype, bucket, variant=()) -> tuple:
    return (op, implementation, device_kind, np.dtype(dtype).name, tuple(bucket), variant)


def full_variant(op: str, variant: Mapping | None = None, where: str = "variant") -> dict:
    """``variant`` with every variant field of ``op`` (:func:`variant_fields`), the
    left-out ones at their plain-call values.

    Raises:
      TuningCacheError: a field ``op`` does not have, or a value that is not a
        bool, int, str or None (a ``bool`` field takes only bools).
    """
    fields = _VARIANT_FIELDS.get(op, {})
    variant = {} if variant is None else variant
    if not isinstance(variant, Mapping):
        raise TuningCacheError(f"{where}: variant must be an object, got {variant!r}.")
    full = dict(fields)
    for name, value in variant.items():
        if name not in fields:
            raise TuningCacheError(f"{where}: unknown variant field {name!r} for {op}; expected a "
                                   f"subset of {tuple(fields)}.")
        plain = fields[name]
        ok = (isinstance(value, bool) if isinstance(plain, bool)
              else value is None or (isinstance(value, (int, str)) and not isinstance(value, bool)))
        if not ok:
            raise TuningCacheError(f"{where}: variant field {name!r} must be "
                                   f"{'a bool' if isinstance(plain, bool) else 'an int, a string or null'}"
                                   f", got {value!r}.")
        full[name] = value
    return full


def _variant_key(op, variant, where) -> tuple:
    return tuple(sorted(full_variant(op, variant, where).items()))


def _check_positive_ints(config, fields, where):
    for name, value in config.items():
        if name not in fields:
            raise TuningCacheError(f"{where}: unknown config field {name!r}; expected a subset of "
                                   f"{fields}.")
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise TuningCacheError(f"{where}: config field {name!r} must be a positive int, got "
                                   f"{value!r}.")
    for name, floor in (("num_warps", 1), ("chunk", 128)):  # what the kernels accept
        value = config.get(name)
        if value is not None and (value < floor or value & (value - 1)):
            raise TuningCacheError(f"{where}: {name} must be a power of two >= {floor}, got "
                                   f"{value}.")


def validate_entry(entry, where: str = "entry") -> tuple[tuple, dict]:
    """Checks one cache entry; returns ``(key, config)``.

    Raises:
      TuningCacheError: a missing key, an unknown op, a bucket that is not a
        list of non-negative ints, or a config field unknown to the op or not
        a positive int. The message names ``where`` (file and entry index).
    """
    if not isinstance(entry, Mapping):
        raise TuningCacheError(f"{where}: expected an object, got {type(entry).__name__}.")
    missing = [k for k in _ENTRY_KEYS if k not in entry]
    if missing:
        raise TuningCacheError(f"{where}: missing key(s) {missing}; an entry needs {_ENTRY_KEYS}.")
    op = entry["op"]
    if op not in _CONFIG_FIELDS:
        raise TuningCacheError(f"{where}: unknown op {op!r}; expected one of {ops()}.")
    for name in ("implementation", "device_kind", "dtype"):
        if not isinstance(entry[name], str):
            raise TuningCacheError(f"{where}: {name} must be a string, got {entry[name]!r}.")
    try:
        dtype = np.dtype(entry["dtype"]).name
    except TypeError as e:
        raise TuningCacheError(f"{where}: unknown dtype {entry['dtype']!r}.") from e
    bucket = entry["bucket"]
    if (not isinstance(bucket, list) or not bucket
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in bucket)):
        raise TuningCacheError(f"{where}: bucket must be a list of non-negative ints, got {bucket!r}.")
    if list(shape_bucket(bucket)) != bucket:
        raise TuningCacheError(f"{where}: bucket dims must be powers of two (shape_bucket), got "
                               f"{bucket!r}.")
    config = entry["config"]
    if not isinstance(config, Mapping) or not config:
        raise TuningCacheError(f"{where}: config must be a non-empty object, got {config!r}.")
    _check_positive_ints(config, _CONFIG_FIELDS[op], where)
    variant = _variant_key(op, entry.get("variant"), where)
    return (_key(op, entry["implementation"], entry["device_kind"], dtype, bucket, variant),
            dict(config))


def parse(document, source: str = "<cache>") -> dict[tuple, dict]:
    """The entries of a decoded cache document as ``{key: config}``.

    Raises:
      TuningCacheError: not a ``{"version", "entries"}`` object, a version
        other than :data:`CACHE_VERSION`, a bad entry, or two entries with one key.
    """
    if not isinstance(document, Mapping) or "version" not in document or "entries" not in document:
        raise TuningCacheError(f"{source}: a tuning cache must be a JSON object with 'version' and "
                               "'entries'.")
    if document["version"] != CACHE_VERSION:
        raise TuningCacheError(
            f"{source}: tuning cache version {document['version']!r}, but this library reads "
            f"version {CACHE_VERSION}; rerun `python -m benchmarks.tune` to regenerate it.")
    if not isinstance(document["entries"], list):
        raise TuningCacheError(f"{source}: 'entries' must be a list.")
    table: dict[tuple, dict] = {}
    for i, entry in enumerate(document["entries"]):
        key, config = validate_entry(entry, f"{source}: entries[{i}]")
        if key in table:
            raise TuningCacheError(f"{source}: entries[{i}] repeats the key {key}.")
        table[key] = config
    return table


@functools.lru_cache(maxsize=16)
def _load(path: str, mtime_ns: int, size: int) -> dict[tuple, dict]:
    # Keyed by modification time and size, so a file rewritten in this process is reread.
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise TuningCacheError(f"{path}: cannot read the tuning cache ({e}).") from e
    try:
        document = json.loads(text)
    except json.JSONDecodeError as e:
        raise TuningCacheError(f"{path}: not valid JSON ({e}).") from e
    return parse(document, path)


def load(path) -> dict[tuple, dict]:
    """The entries of the cache file at ``path`` (parsed once per file version).

    Raises:
      TuningCacheError: a missing, unreadable or malformed file (see :func:`parse`).
    """
    path = os.fspath(path)
    try:
        stat = os.stat(path)
    except OSError as e:
        raise TuningCacheError(f"{path}: cannot read the tuning cache ({e}).") from e
    return _load(path, stat.st_mtime_ns, stat.st_size)


_USER_FILE: contextvars.ContextVar[str | None] = contextvars.ContextVar("tuning_file", default=None)
_OVERRIDES: contextvars.ContextVar[dict | None] = contextvars.ContextVar("tuning_overrides",
                                                                         default=None)
_DEVICE_KIND: contextvars.ContextVar[str | None] = contextvars.ContextVar("tuning_device",
                                                                         default=None)


def set_cache_file(path) -> None:
    """Makes ``path`` the user's cache file (before the packaged one); None unsets it.

    The file is read (and checked) right away, so a bad file fails here.

    Raises:
      TuningCacheError: a missing or malformed file.
    """
    if path is None:
        _USER_FILE.set(None)
        return
    load(path)
    _USER_FILE.set(os.fspath(path))


def user_cache_file() -> str | None:
    """The user's cache file: :func:`set_cache_file`'s, else ``$PALLAS_KERNELS_TUNING_CACHE``."""
    return _USER_FILE.get() or os.environ.get(ENV_VAR) or None


@contextlib.contextmanager
def override(entries: Iterable[Mapping]):
    """Within the block, ``entries`` (cache entries, validated) take precedence over every file."""
    fresh = parse({"version": CACHE_VERSION, "entries": list(entries)}, "override")
    token = _OVERRIDES.set({**(_OVERRIDES.get() or {}), **fresh})  # nested blocks: inner wins
    try:
        yield
    finally:
        _OVERRIDES.reset(token)


@contextlib.contextmanager
def device_kind(kind: str):
    """Within the block, lookups use device kind ``kind`` instead of the default device's.

    For compiling a GPU's tuned configurations ahead of time on a host without
    that GPU (the static gate, the tuner's compile filter).
    """
    if not isinstance(kind, str) or not kind:
        raise ValueError(f"kind: expected a non-empty device kind string, got {kind!r}.")
    token = _DEVICE_KIND.set(kind)
    try:
        yield
    finally:
        _DEVICE_KIND.reset(token)


def current_device_kind() -> str:
    """The device kind lookups use: :func:`device_kind`'s, else the default device's."""
    return _DEVICE_KIND.get() or jax.devices()[0].device_kind


def lookup(op: str, implementation: str, dtype, shape: Sequence[int],
           variant: Mapping | None = None) -> dict | None:
    """The tuned config of ``op`` for a problem of ``shape``, or None (use the heuristic).

    Args:
      op: a registered op (:func:`ops`).
      implementation: the backend the op runs on ("triton", "pallas_triton", ...).
      dtype: the input dtype.
      shape: the op's problem dims (fused_matmul ``(m, n, k)``; row-wise ops
        ``(rows, features)``; attention ``(T, S, head_dim)``), bucketed with
        :func:`shape_bucket`.
      variant: the call's variant fields (:func:`variant_fields`); those left
        out, or None, are the plain call's.

    Raises:
      TuningCacheError: the user's or the packaged cache file is malformed, or
        ``variant`` names a field ``op`` does not have.
    """
    key = _key(op, implementation, current_device_kind(), dtype, shape_bucket(shape),
               _variant_key(op, variant, f"{op}: variant"))
    overrides = _OVERRIDES.get() or {}
    if key in overrides:
        return dict(overrides[key])
    for path in (user_cache_file(), PACKAGED_CACHE):
        if path is not None:
            config = load(path).get(key)
            if config is not None:
                return dict(config)
    return None


def make_entry(op: str, implementation: str, device_kind_: str, dtype, shape: Sequence[int],
               config: Mapping[str, int], measured: Mapping | None = None,
               variant: Mapping | None = None) -> dict:
    """A cache entry (validated) for ``shape``'s bucket and ``variant`` (written whole:
    every variant field of ``op``, the left-out ones at their plain-call values)."""
    entry = {"op": op, "implementation": implementation, "device_kind": device_kind_,
             "dtype": np.dtype(dtype).name, "bucket": list(shape_bucket(shape)),
             "config": {k: int(v) for k, v in config.items()}}
    if _VARIANT_FIELDS.get(op):
        entry["variant"] = full_variant(op, variant, f"{op}: variant")
    elif variant:
        full_variant(op, variant, f"{op}: variant")  # raises: the op has no variant fields
    if measured:
        entry["measured"] = dict(measured)
    validate_entry(entry)
    return entry


def write(path, entries: Iterable[Mapping], *, merge: bool = True) -> int:
    """Writes ``entries`` to the cache file ``path``; returns how many entries it holds.

    With ``merge`` the file's existing entries are kept unless a new entry has
    their key. The file is written whole to a temporary name and renamed, so a
    reader never sees half of it.

    Raises:
      TuningCacheError: a bad entry, or (with ``merge``) a malformed existing file.
    """
    path = Path(path)
    new = list(entries)
    new_keys = {validate_entry(e, "new entry")[0] for e in new}
    kept = []
    if merge and path.exists():
        load(path)  # refuse to merge into a malformed or other-version file
        for entry in json.loads(path.read_text())["entries"]:
            if validate_entry(entry)[0] not in new_keys:
                kept.append(entry)
    all_entries = sorted(kept + new, key=lambda e: (e["op"], e["implementation"], e["device_kind"],
                                                    e["dtype"], e["bucket"],
                                                    json.dumps(e.get("variant"), sort_keys=True)))
    text = json.dumps({"version": CACHE_VERSION, "entries": all_entries}, indent=1) + "\n"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return len(all_entries)
