"""``python -m benchmarks.jax_pallas_tests DIR``: JAX's own Pallas tests against pallas_core.

The measure of compatibility with JAX's Pallas. DIR holds a copy, fetched outside this
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

The same runs JAX's tests of its TPU op library (``--files
tpu_splash_attention_kernel_test.py --interpret-class SplashAttentionTest``,
DIR holding that file of ``tests/pallas/`` too): on pallas_core their imports
of the op library's kernels are swapped to the kernels loaded by
:func:`load_on_pallas_core`, the installed jax package's own source with only
its Pallas imports swapped. The GPU op library loads the same way
(``load_on_pallas_core("jax.experimental.pallas.ops.gpu.paged_attention")`` runs
JAX's paged attention kernel on pallas_core, e.g. on its interpreter with
``interpret=True``).

Exit status 0 when every test that passes on JAX passes on pallas_core,
except those named with ``--expect-differ`` (the differences
docs/pallas_core.md lists), 1 otherwise.
"""
from __future__ import annotations

import argparse
import importlib.util
import re
import subprocess
import sys
import tempfile
import types
import xml.etree.ElementTree as ET
from pathlib import Path

TEST_FILES = ("pallas_test.py", "indexing_test.py")
# Tests of JAX's TPU op library (tests/pallas/ of the same tag): --files and
# --interpret-class SplashAttentionTest run the splash attention kernel's own tests.
OPS_TEST_FILES = ("tpu_splash_attention_kernel_test.py",)
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
# Pallas's backend modules under any alias (JAX's GPU op library imports ``triton as
# plgpu``): each becomes pallas_core's module of that name.
_BACKEND_IMPORT = re.compile(
    r"^from jax\.experimental\.pallas import (tpu|triton|mosaic_gpu) as (\w+)$", re.MULTILINE)
_BACKEND_MODULES = {"tpu": "tpu", "triton": "triton", "mosaic_gpu": "gpu"}
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


def to_pallas_core(source: str) -> str:
    """``source`` with its Pallas imports swapped to pallas_core: the lines of
    :data:`PALLAS_CORE_IMPORTS`, and a backend module (``tpu``, ``triton``,
    ``mosaic_gpu``) imported under any alias."""
    return _BACKEND_IMPORT.sub(lambda m: f"from pallas_core import {_BACKEND_MODULES[m[1]]} as {m[2]}",
                               swap_imports(source, PALLAS_CORE_IMPORTS))


def _imports_pallas(source: str) -> bool:
    return any(old in source for old in PALLAS_CORE_IMPORTS) or bool(_BACKEND_IMPORT.search(source))


# An import of another module of JAX's Pallas op library, in one of the two forms its
# modules use: ``from PACKAGE import MODULE [as NAME]`` or ``from MODULE import NAMES``.
_OPS_IMPORT = re.compile(r"^from (jax\.experimental\.pallas\.ops\.[\w.]+) import (\w+)( as \w+)?$",
                         re.MULTILINE)
_PORTED: dict[str, types.ModuleType] = {}


def _uses_pallas(module: str) -> bool:
    """Whether ``module`` is a module (not a name in one) whose source imports Pallas."""
    try:
        spec = importlib.util.find_spec(module)
    except ModuleNotFoundError:  # a function or class of a module, not a module
        return False
    return (spec is not None and spec.origin is not None and spec.origin.endswith(".py")
            and _imports_pallas(Path(spec.origin).read_text()))


def _ported_name(module: str) -> str:
    return "on_pallas_core__" + module.replace(".", "__")


def load_on_pallas_core(module: str) -> types.ModuleType:
    """A module of JAX's Pallas op library, executed from the installed jax package's
    own source with only its imports swapped to pallas_core (the swap a kernel author
    makes), e.g. ``load_on_pallas_core("jax.experimental.pallas.ops.tpu.megablox.gmm")``.

    The modules it imports from the op library that use Pallas themselves are
    loaded the same way (so ``megablox.ops`` calls the swapped ``megablox.gmm``);
    those that do not (masks, quantization helpers) are JAX's, shared. Each module is
    loaded once, as ``sys.modules["on_pallas_core__jax__experimental__..."]``.

    Raises:
      ModuleNotFoundError: no such module in the installed jax.
    """
    name = _ported_name(module)
    if module in _PORTED:
        return _PORTED[module]
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(f"{module}: not in the installed jax.")
    source = port_ops_imports(to_pallas_core(Path(spec.origin).read_text()))
    ported = types.ModuleType(name)
    ported.__file__ = spec.origin
    sys.modules[name] = ported
    try:
        exec(compile(source, spec.origin, "exec"), ported.__dict__)
    except BaseException:
        del sys.modules[name]
        raise
    _PORTED[module] = ported
    return ported


def port_ops_imports(source: str, by_loader: bool = False) -> str:
    """``source`` with its imports of modules of JAX's Pallas op library that use Pallas
    (or of names in them) turned into imports of the modules loaded by
    :func:`load_on_pallas_core`; other imports stay. With ``by_loader`` the new lines
    call :func:`load_on_pallas_core` themselves (for a file run in another process)."""
    def port(match):
        package, item = match.group(1), match.group(2)
        name = (match.group(3) or f" as {item}")[len(" as "):]
        if _uses_pallas(f"{package}.{item}"):  # a module of the library
            module, attribute = f"{package}.{item}", ""
        elif _uses_pallas(package):  # a name from a module of the library
            module, attribute = package, f".{item}"
        else:
            return match.group(0)
        if by_loader:
            return (f"from benchmarks.jax_pallas_tests import load_on_pallas_core as _on_pallas_core\n"
                    f"{name} = _on_pallas_core({module!r}){attribute}")
        load_on_pallas_core(module)
        if attribute:
            return f"from {_ported_name(module)} import {item} as {name}"
        return f"import {_ported_name(module)} as {name}"

    return _OPS_IMPORT.sub(port, source)


def with_interpret_classes(source: str, classes) -> str:
    """``source`` with, for each class ``NameTest`` of ``classes`` it defines, a subclass
    ``NameInterpretTest`` whose ``INTERPRET`` is True (JAX's TPU op tests run their
    kernels with ``interpret=self.INTERPRET`` but define no interpret-mode class)."""
    for name in classes:
        if re.search(rf"^class {name}\(", source, re.MULTILINE):
            subclass = name.removesuffix("Test") + "InterpretTest"
            source += f"\n\nclass {subclass}({name}):\n  INTERPRET = True\n"
    return source


def prepare(src: Path, dest: Path, on_pallas_core: bool, files=TEST_FILES,
            interpret_classes=()) -> None:
    """Writes the test files and helpers into ``dest`` with imports swapped (on
    pallas_core, imports of JAX's Pallas op library too, see :func:`port_ops_imports`)."""
    missing = [f for f in (*files, *HELPERS) if not (src / f).is_file()]
    if missing:
        raise FileNotFoundError(f"{src}: missing {', '.join(missing)} (see the module doc for "
                                "where they come from).")
    dest.mkdir(parents=True, exist_ok=True)
    swaps = dict(HELPER_IMPORTS, **(PALLAS_CORE_IMPORTS if on_pallas_core else {}))
    for f in files:
        source = swap_imports((src / f).read_text(), swaps)
        if on_pallas_core:
            source = port_ops_imports(to_pallas_core(source), by_loader=True)
        (dest / f).write_text(with_interpret_classes(source, interpret_classes))
    for f, module in HELPERS.items():
        (dest / f"{module}.py").write_text(swap_imports((src / f).read_text(), swaps))
    (dest / "conftest.py").write_text("")  # keeps this repository's conftest out


def run(dest: Path, select: str, files=TEST_FILES) -> dict[str, str]:
    """Runs the interpret-mode classes in ``dest``; ``{class::test: outcome}``, where
    an outcome is "passed", "skipped" or "failed: <first line of the error>"."""
    report = dest / "junit.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0",
                    "-k", select, "--junitxml", str(report), *files],
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
    parser.add_argument("--files", nargs="+", default=TEST_FILES,
                        help="The test files in DIR to run (default: %(default)s); e.g. "
                             f"{OPS_TEST_FILES[0]}, a test of JAX's TPU op library, whose "
                             "imports of the op library are swapped to the kernels loaded on "
                             "pallas_core.")
    parser.add_argument("--interpret-class", nargs="*", default=(), dest="interpret_classes",
                        help="Test classes that take an INTERPRET attribute but have no "
                             "interpret-mode subclass (e.g. SplashAttentionTest): one is added, "
                             "its name ending in InterpretTest instead of Test.")
    args = parser.parse_args(argv)
    select = "InterpretTest" + (f" and ({args.k})" if args.k else "")
    with tempfile.TemporaryDirectory() as scratch:
        results = {}
        for label, on_pallas_core in (("jax.experimental.pallas", False), ("pallas_core", True)):
            dest = Path(scratch) / label
            prepare(args.dir, dest, on_pallas_core, args.files, args.interpret_classes)
            results[label] = run(dest, select, args.files)
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
