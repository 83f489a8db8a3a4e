"""Which source tree a run measured: its commit, never another repository's.

A lent GPU runs a copy of the working tree without its ``.git`` folder, and
that copy may sit inside some other git repository, whose HEAD a plain ``git
rev-parse`` would report (a run once recorded such a commit). So
:func:`git_commit` reads, in order:

1. ``$PALLAS_KERNELS_COMMIT`` (what ``benchmarks/gpu_session.sh`` exports,
   from its ``COMMIT`` or from the step below);
2. git, only where the repository's top level is this tree itself;
3. the tree file (:data:`TREE_FILE`, ``.whl/tree.json``) written on the host
   that sends the tree (``python -m benchmarks.provenance --prepare``): the
   commit, the files that differed from it, and a fingerprint of the sources
   (:func:`source_fingerprint`). Where the sources no longer match the
   fingerprint, the commit is reported with ``+changed-since-prepare``.

``.whl/`` is git-ignored and travels with the device call (``carry``), beside
the wheels the device lacks.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
ENV_VAR = "PALLAS_KERNELS_COMMIT"
TREE_FILE = REPO_ROOT / ".whl" / "tree.json"
# The sources a benchmark's numbers depend on (what the fingerprint hashes).
SOURCE_FOLDERS = ("ops", "pallas_core", "layers", "benchmarks")
_SOURCE_SUFFIXES = (".py", ".json", ".sh")


def source_fingerprint(root: Path = REPO_ROOT) -> str:
    """A hash of every ``.py``, ``.json`` and ``.sh`` file under :data:`SOURCE_FOLDERS`
    (``benchmarks/results`` left out): equal on two hosts when they run the same code."""
    digest = hashlib.sha256()
    for folder in SOURCE_FOLDERS:
        for path in sorted((root / folder).rglob("*")):
            rel = path.relative_to(root)
            if (path.suffix in _SOURCE_SUFFIXES and path.is_file()
                    and "__pycache__" not in rel.parts and rel.parts[:2] != ("benchmarks", "results")):
                digest.update(rel.as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def _git(*args: str, root: Path) -> str:
    return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, text=True,
                          timeout=10).stdout


def git_state(root: Path = REPO_ROOT) -> dict | None:
    """``{"commit": short HEAD, "dirty": [tracked files that differ from it]}`` of the git
    repository whose top level is ``root``; None when git is missing or the nearest
    repository is another one (a copy of the tree inside some other checkout)."""
    try:
        top = Path(_git("rev-parse", "--show-toplevel", root=root).strip()).resolve()
        if top != root.resolve():
            return None
        head = _git("rev-parse", "--short", "HEAD", root=root).strip()
        status = _git("status", "--porcelain", "--untracked-files=no", root=root)
    except (OSError, subprocess.SubprocessError):
        return None
    # Porcelain lines are "XY path": two status letters (either may be a space), a space.
    return {"commit": head, "dirty": sorted(line[3:] for line in status.splitlines() if line.strip())}


def _label(state: dict) -> str:
    return state["commit"] + ("+dirty" if state.get("dirty") else "")


def git_commit(root: Path = REPO_ROOT, tree_file: Path | None = None) -> str | None:
    """The measured tree's commit: short hash, ``+dirty`` when tracked files differed
    from it (and ``+changed-since-prepare`` when the sources changed after the tree
    file was written); None when nothing says (see the module docstring)."""
    if os.environ.get(ENV_VAR, "").strip():
        return os.environ[ENV_VAR].strip()
    state = git_state(root)
    if state is not None:
        return _label(state)
    recorded = read_tree_file(tree_file or root / TREE_FILE.relative_to(REPO_ROOT))
    if recorded is None:
        return None
    same = recorded.get("fingerprint") == source_fingerprint(root)
    return _label(recorded) + ("" if same else "+changed-since-prepare")


def read_tree_file(path: Path = TREE_FILE) -> dict | None:
    """The tree file's contents, or None if it is missing or unreadable."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("commit") else None


def prepare(path: Path = TREE_FILE, root: Path = REPO_ROOT) -> dict:
    """Writes the tree file for a device call (run on the host that has the git checkout).

    Raises:
      RuntimeError: ``root`` is not the top level of a git checkout.
    """
    state = git_state(root)
    if state is None:
        raise RuntimeError(f"{root} is not the top level of a git checkout: nothing to record.")
    data = {**state, "fingerprint": source_fingerprint(root),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    return data


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.provenance",
        description="Print the commit a run here would record; --prepare writes .whl/tree.json "
                    "(the commit, the files that differ from it, a fingerprint of the sources) "
                    "for a device call, whose copy of the tree has no .git.")
    parser.add_argument("--prepare", action="store_true", help="Write the tree file and print it.")
    args = parser.parse_args(argv)
    if args.prepare:
        data = prepare()
        print(f"{TREE_FILE.relative_to(REPO_ROOT)}: commit {_label(data)}, "
              f"{len(data['dirty'])} file(s) differ from it, fingerprint {data['fingerprint']}")
        return 0
    print(git_commit() or "unknown")
    return 0


if __name__ == "__main__":
    sys.exit(main())
