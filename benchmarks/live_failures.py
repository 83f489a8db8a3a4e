"""A pytest plugin that writes each failure's report the moment the test fails.

pytest prints failures' tracebacks in its summary, at the end: a run stopped
by a time limit (SIGTERM) loses them all, as the first GPU session's
``pytest -m gpu`` did. With ``-p benchmarks.live_failures`` each failed or
erroring test's whole report (``longrepr``) is printed at once and, with
``--live-failures PATH``, appended to that file and flushed. It works under
pytest-xdist too: workers' reports reach the controller's hook as each test
ends. ``benchmarks/gpu_session.sh`` loads it, and stops pytest with SIGINT,
after which pytest still prints its summary.
"""
from __future__ import annotations


def pytest_addoption(parser):
    parser.addoption("--live-failures", default=None, metavar="PATH",
                     help="Append each failure's report to PATH as it happens (and print it).")


_CONFIG: dict = {}


def pytest_configure(config):
    _CONFIG["config"] = config


def pytest_runtest_logreport(report):
    config = _CONFIG.get("config")
    if not report.failed or config is None:
        return
    text = (f"\n===== FAILED {report.nodeid} ({report.when}, {report.duration:.1f} s) =====\n"
            f"{report.longreprtext}\n")
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write(text)
        reporter.flush()
    path = config.getoption("--live-failures")
    if path:
        with open(path, "a") as f:
            f.write(text)
