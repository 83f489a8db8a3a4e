"""Shared test set-up: GPU-only tests are skipped on machines without one, and
long sweeps (marked ``slow``) unless ``--slow`` is given or ``-m`` selects them."""
import jax
import pytest


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", default=False,
                     help="also run tests marked slow (long property sweeps, full compile sweeps)")


def _has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    run_slow = config.getoption("--slow") or "slow" in (config.getoption("-m") or "")
    skip_slow = pytest.mark.skip(reason="slow: run with --slow")
    skip_gpu = None if _has_gpu() else pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "slow" in item.keywords and not run_slow:
            item.add_marker(skip_slow)
        if skip_gpu is not None and "gpu" in item.keywords:
            item.add_marker(skip_gpu)
