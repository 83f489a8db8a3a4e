"""``python -m benchmarks.jax_pallas_tests DIR``: JAX's own Pallas tests against pallas_core.

The measure of issue 16 §1. DIR holds a copy, fetched outside this
repository, of four files of the JAX release we follow (tag ``jax-v0.10.2``
of jax-ml/jax)::

    tests/pallas/pallas_test.py         tests/pallas/indexing_test.py
    jax/_src/pallas/pallas_test_util.py jax/_src/hypothesis_test_util.py

(the last two are test helpers the installed wheel leaves out). Their
interpret-mode test classes (names ending in ``InterpretTest``) run twice, in
a scratch directory, each time in a pytest subprocess: once as written, on
``jax.experimental.pallas``, and once with ``pl``, ``pltpu`` and ``pltriton``
(and the helpers' ``pallas_call``) imported from ``pallas_core``. Only import
lines change; the tests themselves are JAX's. The report gives both pass
counts and every test that passes on JAX but not on pallas_core, with the
first line of its failure.

Exit status 0 when every test that passes on JAX passes on pallas_core,
except those named with ``--expect-differ`` (the differences
docs/pallas_core.md lists), 1 otherwise.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

TEST_FILES = ("pallas_test.py", "indexing_test.py")
HELPERS = {"pallas_test_util.py": "ptu_shim", "hypothesis_test_util.py": "htu_shim"}
# The helpers are imported from JAX's private package; the copies are imported
# from the scratch directory instead.
HELPER_IMPORTS = {
    "from jax._src.pallas import pallas_test_util as ptu": "import ptu_shim as ptu",
    "from jax._src import hypothesis_test_util as htu": "import htu_shim as htu",
}
# The one-import swap a user makes to move a kernel onto pallas_core.
PALLAS_CORE_IMPORTS = {
    "from jax.experimental import pallas as pl\n": "import pallas_core as pl\n",
    "from jax.experimental.pallas import tpu as pltpu": "from pallas_core import tpu as pltpu",
    "from jax.experimental.pallas import triton as pltriton":
        "from pallas_core import triton as pltriton",
    "from jax.experimental.pallas import mosaic_gpu as plmgpu":
        "from pallas_core import gpu as plmgpu",
    "from jax._src.pallas import pallas_call as pl_lib": "import pallas_core as pl_lib",
}
# Tests that differ on purpose, with the reason in docs/pallas_core.md section 14.
DOCUMENTED_DIFFERENCES = (
    "PallasCallInterpretTest::test_const_args",
    "ApiErrorInterpretTest::test_pallas_call_index_map_captures_consts",
    "ApiErrorInterpretTest::test_pallas_error_for_ref_to_jax",
)


def swap_imports(source: str, swaps: dict[str, str]) -> str:
    """``source`` with each import line of ``swaps`` that it has replaced."""
    for old, new in swaps.items():
        source = source.replace(old, new)
    return source


def prepare(src: Path, dest: Path, on_pallas_core: bool) -> None:
    """Writes the test files and helpers into ``dest`` with imports swapped."""
    missing = [f for f in (*TEST_FILES, *HELPERS) if not (src / f).is_file()]
    if missing:
        raise FileNotFoundError(f"{src}: missing {', '.join(missing)} (see the module doc for "
                                "where they come from).")
    dest.mkdir(parents=True, exist_ok=True)
    swaps = dict(HELPER_IMPORTS, **(PALLAS_CORE_IMPORTS if on_pallas_core else {}))
    for f in TEST_FILES:
        (dest / f).write_text(swap_imports((src / f).read_text(), swaps))
    for f, module in HELPERS.items():
        (dest / f"{module}.py").write_text(swap_imports((src / f).read_text(), swaps))
    (dest / "conftest.py").write_text("")  # keeps this repository's conftest out


def run(dest: Path, select: str) -> dict[str, str]:
    """Runs the interpret-mode classes in ``dest``; ``{class::test: outcome}``, where
    an outcome is "passed", "skipped" or "failed: <first line of the error>"."""
    report = dest / "junit.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0",
                    "-k", select, "--junitxml", str(report), *TEST_FILES],
                   cwd=dest, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    outcomes = {}
    for case in ET.parse(report).iter("testcase"):
        name = f"{case.get('classname').split('.')[-1]}::{case.get('name')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                first = (child.get("message") or "").strip().splitlines() or [""]
                outcome = f"failed: {first[0][:160]}"
            elif child.tag == "skipped":
                outcome = "skipped"
        outcomes[name] = outcome
    return outcomes


def compare(on_jax: dict[str, str], on_ours: dict[str, str], expect_differ=()) -> tuple[list, list]:
    """``(unexpected, documented)``: tests passing on JAX but not on pallas_core."""
    lost = [(t, on_ours.get(t, "not run")) for t, o in on_jax.items()
            if o == "passed" and on_ours.get(t) != "passed"]
    return ([x for x in lost if x[0] not in expect_differ],
            [x for x in lost if x[0] in expect_differ])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.jax_pallas_tests",
        description="Run JAX's own interpret-mode Pallas tests twice, on jax.experimental.pallas "
                    "and on pallas_core (only the imports swapped), and report every test that "
                    "passes on JAX but not on pallas_core.")
    parser.add_argument("dir", type=Path,
                        help="The fetched copy of JAX's test files (the module docstring lists them).")
    parser.add_argument("-k", default="", help="A further pytest -k selection.")
    parser.add_argument("--expect-differ", nargs="*", default=DOCUMENTED_DIFFERENCES,
                        help="Tests allowed to pass on JAX only (default: the differences "
                             "docs/pallas_core.md lists).")
    args = parser.parse_args(argv)
    select = "InterpretTest" + (f" and ({args.k})" if args.k else "")
    with tempfile.TemporaryDirectory() as scratch:
        results = {}
        for label, on_pallas_core in (("jax.experimental.pallas", False), ("pallas_core", True)):
            dest = Path(scratch) / label
            prepare(args.dir, dest, on_pallas_core)
            results[label] = run(dest, select)
    on_jax, on_ours = results["jax.experimental.pallas"], results["pallas_core"]
    passing = [t for t, o in on_jax.items() if o == "passed"]
    print(f"passed on jax.experimental.pallas: {len(passing)}")
    print(f"of those, passed on pallas_core:   {sum(on_ours.get(t) == 'passed' for t in passing)}")
    unexpected, documented = compare(on_jax, on_ours, set(args.expect_differ))
    for title, rows in (("documented differences", documented), ("FAILING", unexpected)):
        if rows:
            print(f"{title}:")
            for test, outcome in rows:
                print(f"  {test}: {outcome}")
    return 1 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
