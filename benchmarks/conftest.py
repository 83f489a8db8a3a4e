"""pytest options for ``pytest benchmarks --benchmark-only`` (pytest-benchmark).

The project's pytest defaults run on two xdist workers, under which
pytest-benchmark disables itself (timings from concurrent workers would
disturb each other). When this folder is the one pytest is asked to run,
it runs in one process instead.
"""
import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    if getattr(config.option, "numprocesses", None):
        config.option.numprocesses = 0
        config.option.dist = "no"
