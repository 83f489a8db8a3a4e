"""Every Python example in docs/pallas_core.md runs, in order, in one namespace."""
import pathlib
import re

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "pallas_core.md"


def test_guide_examples_run():
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) >= 10
    namespace: dict = {}
    for i, block in enumerate(blocks):
        code = compile(block, f"{DOC.name}[block {i}]", "exec")
        exec(code, namespace)  # noqa: S102 - executing our own documentation
