"""Shared test set-up: GPU-only tests are skipped on machines without one, and
long sweeps (marked ``slow``) unless ``--slow`` is given or ``-m`` selects them;
hypothesis draws the same examples every run unless HYPOTHESIS_PROFILE=explore."""
import os

# numpy's BLAS on one thread, set before numpy loads here and in every pytest-xdist
# worker (they inherit this environment). Triton's CPU interpreter multiplies each
# tile with np.matmul; with two workers on two cores a multi-threaded OpenBLAS
# oversubscribes them: a 128x32x128 float32 tile product measured 40 ms instead of
# 0.03 ms on the CI-like host.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
# Every worker sees 8 CPU devices (tests/test_sharding.py partitions over a mesh of
# them). The flag must be set before JAX initialises its backends; the default
# device, and so every single-device test, is unchanged.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

# On a host without an NVIDIA GPU, XLA compiles its CPU code without LLVM's optimization
# passes: the tests compile thousands of small programs (the interpreters' kernels, the
# float64 references) and run each once or twice, so compile time is most of their time.
# This cut the suite's time by about a fifth on the CI host (test_norms and
# test_softmax_reductions 109 s -> 83 s; test_attention and test_attention_mosaic_gpu
# about 229 s -> 170 s). A GPU host keeps XLA's defaults (the flag would slow its
# kernels), and so does anyone who sets the level in XLA_FLAGS.
_NVIDIA_GPU = any(name.startswith("nvidia") and name[6:].isdigit() for name in os.listdir("/dev"))
if not _NVIDIA_GPU and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_backend_optimization_level=0"
                               " --xla_llvm_disable_expensive_passes=true").strip()

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# Property tests draw the same examples on every run (a red CI is reproducible, never a
# lucky draw); HYPOTHESIS_PROFILE=explore draws fresh ones, to hunt for new failures.
settings.register_profile("reproducible", derandomize=True, print_blob=True)
settings.register_profile("explore", print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "reproducible"))


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", default=False,
                     help="also run tests marked slow (long property sweeps, full compile sweeps)")


def _has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    run_slow = config.getoption("--slow") or "slow" in (config.getoption("-m") or "")
    skip_slow = pytest.mark.skip(reason="slow: run with --slow")
    skip_gpu = None if _has_gpu() else pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "slow" in item.keywords and not run_slow:
            item.add_marker(skip_slow)
        if skip_gpu is not None and "gpu" in item.keywords:
            item.add_marker(skip_gpu)
