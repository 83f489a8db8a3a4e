"""Autotuning: a versioned JSON cache of tuned launch configurations, read at trace time.

Every registered op (:mod:`ops._op`) asks :func:`lookup` for its problem
(op, implementation, device kind, dtype, shape bucket, and the variant:
for attention causal, masks, dropout, ...) before its config's heuristic; ``python -m benchmarks.tune`` fills the cache on a GPU. See
:mod:`ops.tuning.cache` for the file format and where lookups look, and
:mod:`ops.tuning.search` for the candidate configurations and their compile
filter.

Point the library at your own cache::

    import ops.tuning
    ops.tuning.set_cache_file("my_tuned.json")   # or PALLAS_KERNELS_TUNING_CACHE=my_tuned.json
"""
from ops.tuning.cache import (CACHE_VERSION, ENV_VAR, PACKAGED_CACHE, TuningCacheError, config_fields,
                              current_device_kind, device_kind, full_variant, load, lookup,
                              make_entry, override, set_cache_file, shape_bucket, user_cache_file,
                              variant_fields, write)

__all__ = ["CACHE_VERSION", "ENV_VAR", "PACKAGED_CACHE", "TuningCacheError", "config_fields",
           "current_device_kind", "device_kind", "full_variant", "load", "lookup", "make_entry",
           "override", "set_cache_file", "shape_bucket", "user_cache_file", "variant_fields",
           "write"]
