"""How our triton backend drives Triton's CPU interpreter (pallas_core.triton.runtime):
launches serialised across threads, the dead overflow sanitizer off. The
interpreter's tile choice is tested in tests/test_tuning.py (test_interpreter_tiles).
"""
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_core as pl

pytest.importorskip("triton")
pytest.importorskip("torch")


def _scaled_by_program(x_ref, o_ref):
    # Each program's result depends on its program id: a launch that saw another
    # launch's ids would write wrong values.
    o_ref[...] = x_ref[...] * (pl.program_id(0) + 1).astype(jnp.float32)


def _call(x):
    return pl.pallas_call(_scaled_by_program, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          grid=(x.shape[0] // 16,), in_specs=[pl.BlockSpec((16, 32), lambda i: (i, 0))],
                          out_specs=pl.BlockSpec((16, 32), lambda i: (i, 0)), backend="triton")(x)


def test_concurrent_launches_from_threads():
    """Triton's interpreter is process-global (patched triton.language, one program
    id); XLA may run independent callbacks on several threads at once, as the
    encoder's fine-tuning step did ("Did you forget to add @triton.jit ?").
    Launches from several threads at once must each give their own results."""
    f = jax.jit(_call)
    inputs = [jnp.full((128, 32), float(t + 1), jnp.float32) for t in range(4)]
    want = [np.repeat(np.arange(1, 9, dtype=np.float32), 16)[:, None] * (t + 1) * np.ones((1, 32))
            for t in range(4)]
    jax.block_until_ready(f(inputs[0]))  # compiled once, before the threads
    errors = []

    def work(t):
        try:
            for _ in range(3):
                np.testing.assert_array_equal(np.asarray(f(inputs[t])), want[t])
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def test_overflow_sanitizer_off_while_asserts_are_off():
    """Its checks end in a device_assert that does nothing without ``debug``: only
    the dead work goes; with ``debug`` on, the option is left alone."""
    import dataclasses

    from triton.runtime.interpreter import interpreter_builder

    from pallas_core.triton import runtime

    x = jnp.arange(128 * 32, dtype=jnp.float32).reshape(128, 32)
    np.testing.assert_array_equal(np.asarray(_call(x)),
                                  np.asarray(x) * np.repeat(np.arange(1, 9), 16)[:, None])
    assert not interpreter_builder.options.sanitize_overflow
    before = interpreter_builder.options
    try:
        interpreter_builder.options = dataclasses.replace(before, debug=True, sanitize_overflow=True)
        runtime._skip_dead_overflow_checks()
        assert interpreter_builder.options.sanitize_overflow
    finally:
        interpreter_builder.options = before
