"""The JAX versions pallas_core is verified with, and the warning outside them.

pallas_core reads private JAX APIs and the params of JAX's jaxpr equations
(:mod:`pallas_core._jax_internals`, docs/pallas_core.md section 15), which JAX
changes between minor versions without notice. ``pyproject.toml`` asks only
for ``jax>=0.10.2``, so that installing pallas-kernels beside a newer JAX never
downgrades it; instead, importing ``pallas_core`` under a JAX outside
:data:`VERIFIED_JAX` warns once (:class:`JaxVersionWarning`, a UserWarning that
``warnings.filterwarnings`` can silence) naming the range.
"""
from __future__ import annotations

import re
import warnings

import jax

# [lowest verified, first not verified): 0.10.2 is tested here; 0.11.0 and JAX's
# main branch of August 2026 (0.11.1) by running their Python source over jaxlib
# 0.10.2; 0.11.2 is the GPU image's. 0.12 is newer than any source read so far.
VERIFIED_JAX = ("0.10.2", "0.12")


class JaxVersionWarning(UserWarning):
    """pallas_core was imported under a JAX version outside :data:`VERIFIED_JAX`."""


def version_tuple(version: str) -> tuple[int, ...]:
    """The leading numeric release of a version string: ``"0.11.1.dev2026"`` -> ``(0, 11, 1)``.

    Raises:
      ValueError: no leading number.
    """
    release = re.match(r"\d+(?:\.\d+)*", str(version).strip())
    if release is None:
        raise ValueError(f"version: expected a version such as '0.10.2', got {version!r}.")
    return tuple(int(part) for part in release.group().split("."))


def is_verified(version: str) -> bool:
    """Whether JAX ``version`` is within :data:`VERIFIED_JAX` (lowest inclusive, highest exclusive)."""
    low, high = (version_tuple(v) for v in VERIFIED_JAX)
    return low <= version_tuple(version) < high


_warned = False


def check_jax_version(version: str | None = None) -> bool:
    """Warns (once per process) if JAX ``version`` (default: the installed one) is
    outside :data:`VERIFIED_JAX`; returns whether it is inside.

    Warns:
      JaxVersionWarning: the version and the verified range, the first time a
        version outside it is seen.
    """
    global _warned
    version = jax.__version__ if version is None else version
    try:
        verified = is_verified(version)
    except ValueError:
        verified = False
    if not verified and not _warned:
        _warned = True
        low, high = VERIFIED_JAX
        warnings.warn(
            f"pallas_core is verified with JAX {low} up to (not including) {high}; this is JAX "
            f"{version}. pallas_core reads private JAX APIs (docs/pallas_core.md section 15), so "
            "kernels may fail to trace or lower under it; install a JAX in that range "
            f"(pip install 'jax>={low},<{high}') if they do.", JaxVersionWarning, stacklevel=3)
    return verified
