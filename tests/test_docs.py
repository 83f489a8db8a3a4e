"""The documentation: every Python example in docs/pallas_core.md runs, and every
reference to docs/design.md or docs/pallas_core.md names a section that exists."""
import importlib
import os
import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "pallas_core.md"
DESIGN = REPO / "docs" / "design.md"
# Not ours, or generated: never searched for references.
_SKIPPED_DIRS = {".git", ".venv", "__pycache__", ".hypothesis", ".benchmarks", ".whl", "results",
                 "pallas_kernels.egg-info"}
_TEXT_SUFFIXES = (".py", ".md", ".sh", ".toml")


def test_guide_examples_run():
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) >= 10
    namespace: dict = {}
    for i, block in enumerate(blocks):
        code = compile(block, f"{DOC.name}[block {i}]", "exec")
        exec(code, namespace)  # noqa: S102 - executing our own documentation


def _sections(doc: pathlib.Path) -> set[str]:
    """The numbers of a page's numbered headings: ``## 3. Backends`` -> "3", ``### 3.1 ...`` -> "3.1"."""
    return set(re.findall(r"^#{2,3} (\d+(?:\.\d+)?)\.?\s", doc.read_text(), flags=re.M))


def _repository_texts():
    for root, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if d not in _SKIPPED_DIRS]
        for name in files:
            if name.endswith(_TEXT_SUFFIXES):
                path = pathlib.Path(root, name)
                yield path.relative_to(REPO), path.read_text(errors="replace")


# "docs/design.md §7.3 and §7.4", "[docs/design.md](docs/design.md) §7", "(docs/design.md §5.6)".
_DESIGN_REF = re.compile(r"docs/design\.md\)?((?:(?:,\s*|\s+and\s+|\s+)§\d+(?:\.\d+)?)+)")
# "docs/pallas_core.md section 5", "docs/pallas_core.md, section 14", "sections 2-4 and 9".
_GUIDE_REF = re.compile(r"docs/pallas_core\.md\)?,?\s+(sections?\s+\d+(?:\s*(?:-|,|and|to)\s*\d+)*)")
# What no file may say: the design handbook outside the repository, its seed documents,
# issue numbers or the handbook's "rungs". Name the behaviour or a docs/ section instead.
_FORBIDDEN = re.compile(r"\bDESIGN\b|\b[Ss]eeds? ?0\d\d\b|\b[Ss]eed-0\d\d\b|\b[Ii]ssue \d+|\b[Rr]ungs? \d")


def test_section_references_exist():
    design, guide = _sections(DESIGN), _sections(DOC)
    assert {"1", "2", "3.3", "5.4", "7.6"} <= design and {"5", "14"} <= guide
    bad = []
    for path, text in _repository_texts():
        for refs in _DESIGN_REF.findall(text):
            bad += [f"{path}: docs/design.md §{n}" for n in re.findall(r"§(\d+(?:\.\d+)?)", refs)
                    if n not in design]
        for refs in _GUIDE_REF.findall(text):
            bad += [f"{path}: docs/pallas_core.md section {n}" for n in re.findall(r"\d+", refs)
                    if n not in guide]
    own = _GUIDE_REF.sub("", DESIGN.read_text())  # design.md's own "section N" refer to itself
    bad += [f"docs/design.md: section {n}" for n in re.findall(r"\bsections? (\d+(?:\.\d+)?)", own)
            if n not in design]
    assert not bad, "references to sections that do not exist:\n" + "\n".join(bad)


def test_no_references_to_documents_outside_the_repository():
    found = [f"{path}:{text.count(chr(10), 0, m.start()) + 1}: {m.group()}"
             for path, text in _repository_texts() if path != pathlib.Path("tests/test_docs.py")
             for m in _FORBIDDEN.finditer(text)]
    assert not found, "name the behaviour or a docs/ section instead:\n" + "\n".join(found)


def test_design_names_modules_that_exist():
    text = DESIGN.read_text()
    paths = set(re.findall(r"`((?:pallas_core|ops|layers|benchmarks|tests|docs)/[\w./-]*)`", text))
    assert len(paths) > 50
    # Output folders (benchmarks/results/...) are made by the runs that write them.
    missing = [p for p in sorted(paths) if not (REPO / p).exists() and not p.startswith("benchmarks/results/")]
    names = set(re.findall(r"`((?:pallas_core|ops|layers|benchmarks)(?:\.\w+)+)", text))
    for name in sorted(names):
        parts = name.split(".")
        for cut in range(len(parts), 0, -1):  # the longest importable prefix, then attributes
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            try:
                for attr in parts[cut:]:
                    obj = getattr(obj, attr)
            except AttributeError:
                missing.append(name)
            break
        else:
            missing.append(name)
    assert not missing, f"docs/design.md names what does not exist: {missing}"
