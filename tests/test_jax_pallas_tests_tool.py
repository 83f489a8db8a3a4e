"""benchmarks.jax_pallas_tests: the runner of JAX's own Pallas tests against pallas_core.

The full run needs a copy of JAX's test files fetched outside this repository
(see the tool's doc); give its directory in JAX_PALLAS_TESTS_DIR and --slow.
"""
import os
from pathlib import Path

import pytest

from benchmarks import jax_pallas_tests as tool


def test_import_swap_and_comparison(tmp_path):
    src = "import os\nfrom jax.experimental import pallas as pl\nfrom jax.experimental.pallas import tpu as pltpu\n"
    swapped = tool.swap_imports(src, tool.PALLAS_CORE_IMPORTS)
    assert swapped == "import os\nimport pallas_core as pl\nfrom pallas_core import tpu as pltpu\n"
    on_jax = {"A::a": "passed", "A::b": "passed", "A::c": "skipped", "A::d": "passed"}
    on_ours = {"A::a": "passed", "A::b": "failed: boom", "A::c": "failed: x", "A::d": "failed: y"}
    unexpected, documented = tool.compare(on_jax, on_ours, {"A::d"})
    assert unexpected == [("A::b", "failed: boom")] and documented == [("A::d", "failed: y")]
    with pytest.raises(FileNotFoundError, match="pallas_test.py"):
        tool.prepare(tmp_path, tmp_path / "out", True)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("JAX_PALLAS_TESTS_DIR"), reason="no copy of JAX's tests")
def test_every_jax_interpret_test_passes_on_pallas_core():
    assert tool.main([str(Path(os.environ["JAX_PALLAS_TESTS_DIR"]))]) == 0
