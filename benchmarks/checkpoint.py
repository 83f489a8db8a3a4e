"""A benchmark run that survives its time limit: budgets, checkpoints and resuming.

A lent GPU comes in calls of a few minutes, and the whole suite takes longer
than one. So :mod:`benchmarks.__main__`

* starts no new case once ``--budget-s`` seconds have passed (:class:`Budget`),
  and lists the cases it did not run;
* rewrites ``results.json`` after every case (:func:`write_checkpoint`), so a
  run killed from outside loses one case at most;
* ends cleanly on SIGTERM (what ``timeout`` sends; :func:`stop_on_sigterm`):
  the case in progress is dropped and the report is written;
* with ``--resume FILE`` keeps an earlier run's rows and runs only the cases
  it lacks (:func:`load_resume`), so the next call carries on where the last
  one stopped.

Rows are measured against their own run's ceilings (every row carries its
fraction of them), so rows of several calls on one device kind can share a
report; :func:`load_resume` refuses a file from another device kind or
platform, or from another kind of run (timed vs accuracy only).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import signal
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any


def positive_seconds(text: str) -> float:
    """``--budget-s``'s argparse type: a positive number of seconds (what :class:`Budget`
    takes), else argparse's usage error."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return seconds


class Budget:
    """Seconds a run may spend starting cases; None: no limit."""

    def __init__(self, seconds: float | None, *, start: float | None = None):
        if seconds is not None and not seconds > 0:
            raise ValueError(f"budget_s must be a positive number of seconds, got {seconds!r}")
        self.seconds = seconds
        self.start = time.perf_counter() if start is None else start

    def spent(self) -> bool:
        return self.seconds is not None and time.perf_counter() - self.start >= self.seconds


class Stopped(BaseException):
    """Raised inside the run when SIGTERM arrives (see :func:`stop_on_sigterm`).

    A BaseException, as KeyboardInterrupt is: the ``except Exception`` that records
    one implementation's failure and goes on (a case's row, a tuning candidate's
    verdict) must not swallow it, or a stopped run would carry on until killed.
    """


@contextlib.contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """Turns SIGTERM into :class:`Stopped` while the block runs.

    Python's default for SIGTERM ends the process at once, without the
    report; raised as an exception instead, it unwinds to the case loop,
    which writes what it has. The handler is installed only in the main
    thread (elsewhere ``signal`` refuses), and the previous one is restored.
    """
    def handler(signum, frame):
        raise Stopped(f"signal {signum}")

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: run without the handler
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def load_resume(path: Path, *, device_kind: str, platform: str, timed: bool
                ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """An earlier run's rows and a summary of its meta, to continue that run.

    Args:
      path: a ``results.json`` written by ``python -m benchmarks``, complete or not.
      device_kind, platform, timed: this run's; the file's must be the same.

    Returns:
      ``(rows, summary)``: the rows as written, and ``{"path", "date",
      "git_commit", "ceilings", "cases"}`` of that run, recorded in this one's meta.

    Raises:
      ValueError: if the file cannot be read as a results file, or is from
        another device kind, platform or kind of run.
    """
    try:
        data = json.loads(Path(path).read_text())
        meta, rows = data["meta"], data["rows"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--resume {path}: not a results.json of python -m benchmarks ({e})") \
            from e
    theirs = (meta.get("device_kind"), meta.get("platform"), bool(meta.get("timed")))
    ours = (device_kind, platform, timed)
    if theirs != ours:
        raise ValueError(f"--resume {path}: that run was on {theirs[0]} ({theirs[1]}, "
                         f"{'timed' if theirs[2] else 'not timed'}); this one is on {ours[0]} "
                         f"({ours[1]}, {'timed' if timed else 'not timed'}): their rows cannot "
                         "share a report")
    summary = {"path": str(path), "date": meta.get("date"), "git_commit": meta.get("git_commit"),
               "ceilings": meta.get("ceilings"), "cases": len(done_cases(rows))}
    return rows, summary


def done_cases(rows: Sequence[Mapping[str, Any]]) -> set[str]:
    """Names of the cases that have rows (a failed implementation's row counts: it ran)."""
    return {row["case"] for row in rows}


def write_checkpoint(path: Path, meta: Mapping[str, Any], rows: Sequence[Mapping[str, Any]],
                     not_run: Sequence[str]) -> None:
    """``results.json`` of an unfinished run: its meta marked ``complete: false``, the rows so
    far and the cases still to run. Written to a temporary name and renamed, so a kill
    while writing leaves the previous checkpoint whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"meta": {**meta, "complete": False, "not_run": list(not_run)},
                               "rows": list(rows), "static": None}, indent=2, allow_nan=True)
                   + "\n")
    tmp.replace(path)
