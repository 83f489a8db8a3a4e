"""benchmarks.provenance: a run records its own tree's commit, never a surrounding repository's."""
import json
import subprocess

import pytest

from benchmarks import provenance


def _git(root, *args):
    return subprocess.run(["git", "-c", "user.email=t@example.com", "-c", "user.name=t", *args],
                          cwd=root, check=True, capture_output=True, text=True).stdout.strip()


def _tree(root):
    (root / "ops").mkdir(parents=True)
    (root / "ops" / "a.py").write_text("x = 1\n")
    return root


@pytest.fixture
def nested(tmp_path, monkeypatch):
    """A tree copied (without .git) inside another git repository, as a device call sees it."""
    monkeypatch.delenv(provenance.ENV_VAR, raising=False)
    outer = tmp_path / "outer"
    outer.mkdir()
    _git(outer, "init", "-q")
    (outer / "README").write_text("outer\n")
    _git(outer, "add", "README")
    _git(outer, "commit", "-q", "-m", "outer")
    return _tree(outer / "copy"), _git(outer, "rev-parse", "--short", "HEAD")


def test_a_copy_inside_another_repository_never_reports_its_commit(nested):
    tree, outer_head = nested
    assert provenance.git_state(tree) is None
    assert provenance.git_commit(tree, tree_file=tree / "none.json") is None


def test_the_tree_file_names_the_commit_and_whether_the_sources_changed(nested, tmp_path):
    tree, _ = nested
    tree_file = tmp_path / "tree.json"
    tree_file.write_text(json.dumps({"commit": "abc1234", "dirty": ["ops/a.py"],
                                     "fingerprint": provenance.source_fingerprint(tree)}))
    assert provenance.git_commit(tree, tree_file=tree_file) == "abc1234+dirty"
    (tree / "ops" / "a.py").write_text("x = 2\n")
    assert provenance.git_commit(tree, tree_file=tree_file) == "abc1234+dirty+changed-since-prepare"


def test_the_environment_wins(nested, monkeypatch):
    tree, _ = nested
    monkeypatch.setenv(provenance.ENV_VAR, "feedbee")
    assert provenance.git_commit(tree) == "feedbee"


def test_a_checkout_reports_its_head_and_prepare_records_it(tmp_path, monkeypatch):
    monkeypatch.delenv(provenance.ENV_VAR, raising=False)
    tree = _tree(tmp_path / "repo")
    _git(tree, "init", "-q")
    _git(tree, "add", "ops/a.py")
    _git(tree, "commit", "-q", "-m", "one")
    head = _git(tree, "rev-parse", "--short", "HEAD")
    assert provenance.git_commit(tree) == head
    (tree / "ops" / "a.py").write_text("x = 3\n")
    assert provenance.git_commit(tree) == head + "+dirty"
    data = provenance.prepare(tmp_path / "tree.json", root=tree)
    assert data["commit"] == head and data["dirty"] == ["ops/a.py"]
    assert data["fingerprint"] == provenance.source_fingerprint(tree)
