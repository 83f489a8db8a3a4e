"""Triton's global scratch for kernels launched through ``jax_triton``: in-kernel tensor descriptors.

A kernel generated with ``tma=True`` makes its tensor descriptors in the
kernel (``tl.make_tensor_descriptor``). Triton 3.6 writes each one (128
bytes on sm_90) to a per-program slice of a *global scratch* buffer and
loads through it: the compiled kernel takes two pointer parameters after its
declared ones, the global scratch and the profile scratch, and reads
``global scratch + linear program id * global_scratch_size`` (the
``global_scratch_size`` / ``global_scratch_align`` of its metadata;
``pl.triton.compile`` reports the first as ``global_scratch_bytes``).
Triton's own launcher allocates ``programs * global_scratch_size`` bytes per
launch. jaxlib's launch (``KernelCall::Launch``) passes a null pointer for
both hidden parameters, after the call's arrays, so such a kernel would
write its descriptors to address 0.

What this module does instead, keeping the jaxlib launch as it is:

1. :func:`with_parameter`: the kernel's source gets one more pointer
   parameter, :data:`PARAMETER`, after its arrays; the launch passes a
   trailing ``uint8`` output of :meth:`Scratch.size` bytes there (``programs
   * global_scratch_size``, plus ``align`` bytes of room to round the base
   up), which the caller never sees.
2. :func:`install` wraps ``jax_triton``'s ``compile_ttir_inplace`` (whose
   ``binary`` is the PTX jaxlib loads). For a kernel announced with
   :func:`expect`, the wrapper checks Triton's metadata against the size
   the output was declared with (:func:`check_metadata`) and rewrites the PTX
   (:func:`redirect`): the one ``ld.param.b64 %rd, [<kernel>_param_{n}]``
   of the hidden global-scratch parameter (n declared parameters, ours the
   last) reads ``<kernel>_param_{n-1}`` instead, and two instructions round
   the address up to ``align`` (128 bytes on sm_90, which the tensor-map
   copies need; XLA guarantees 16 for a custom call's buffers, not more).

What cannot work is refused with an error, never launched: a kernel that
needs global scratch without a declared output for it (once the wrapper is
installed), a profile scratch (Triton's instrumentation), a kernel whose
PTX reads the hidden parameter in any other way, a metadata size that
differs from the one declared at trace time, a warp count changed by the
compiler (warp specialization: jaxlib launches the requested count).
"""
from __future__ import annotations

import dataclasses
import functools
import re

PARAMETER = "descriptor_scratch"
_HOOKED = "__pallas_core_global_scratch__"


@dataclasses.dataclass(frozen=True)
class Scratch:
    """What a compiled kernel needs of its global scratch.

    Attributes:
      bytes_per_program: Triton's ``global_scratch_size``, bytes per program.
      align: Triton's ``global_scratch_align``, bytes (a power of two).
    """

    bytes_per_program: int
    align: int

    def size(self, programs: int) -> int:
        """Bytes of the declared output for ``programs`` programs: every program's
        slice, and room to round an (at least 16-byte-aligned) base up to ``align``."""
        return programs * self.bytes_per_program + self.align


def requirement(metadata) -> Scratch | None:
    """The global scratch a compiled kernel needs (None: none), from its Triton metadata.

    Args:
      metadata: Triton's compile metadata (a mapping, or an object with the
        same attributes, as ``CompiledKernel.metadata``).

    Raises:
      NotImplementedError: the kernel also needs a profile scratch, or an
        alignment that is not a power of two.
    """
    get = metadata.get if isinstance(metadata, dict) else functools.partial(getattr, metadata)
    size, align = get("global_scratch_size") or 0, get("global_scratch_align") or 1
    if get("profile_scratch_size") or 0:
        raise NotImplementedError(
            f"triton backend: kernel {get('name')} needs Triton's profile scratch "
            f"({get('profile_scratch_size')} bytes per program; Triton's instrumentation), which the "
            "jax_triton launch cannot provide. Run it without instrumentation.")
    if not size:
        return None
    if align < 1 or align & (align - 1):
        raise NotImplementedError(f"triton backend: kernel {get('name')}: global scratch alignment "
                                  f"{align} is not a power of two.")
    return Scratch(size, align)


def with_parameter(source: str, name: str, arrays: int) -> str:
    """``source`` with :data:`PARAMETER` added to kernel ``name`` after its first ``arrays``
    parameters (the pointers the launch passes), before its constexprs.

    Raises:
      ValueError: no ``def name(...)`` line, or its first ``arrays`` parameters
        are not plain names followed only by constexprs.
    """
    match = re.search(rf"^def {re.escape(name)}\((.*)\):$", source, re.M)
    if match is None:
        raise ValueError(f"with_parameter: no 'def {name}(...)' in the kernel source.")
    params = [p for p in match.group(1).split(", ") if p]
    pointers, rest = params[:arrays], params[arrays:]
    if (len(pointers) != arrays or any(":" in p for p in pointers) or PARAMETER in params
            or any(not p.endswith(": tl.constexpr") for p in rest)):
        raise ValueError(f"with_parameter: kernel {name}'s parameters {params} do not start with "
                         f"{arrays} pointers followed by constexprs.")
    line = f"def {name}({', '.join(pointers + [PARAMETER] + rest)}):"
    return source[:match.start()] + line + source[match.end():]


def _entry_params(ptx: str, name: str) -> int:
    match = re.search(rf"\.entry {re.escape(name)}\((.*?)\)", ptx, re.S)
    if match is None:
        raise ValueError(f"redirect: no .entry {name} in the PTX.")
    return match.group(1).count(".param ")


def redirect(ptx: str, name: str, declared: int, align: int) -> str:
    """The PTX of kernel ``name`` reading its global scratch from its last declared parameter.

    Args:
      ptx: the module Triton compiled, whose entry ``name`` takes ``declared``
        parameters and Triton's two hidden ones (global, profile scratch).
      declared: the kernel's declared parameters, :data:`PARAMETER` the last.
      align: the address is rounded up to a multiple of this (a power of two).

    Raises:
      NotImplementedError: the entry's parameters are not ``declared + 2``;
        the hidden global scratch is read other than by one ``ld.param.b64``;
        the declared scratch or the profile scratch is read at all.
    """
    total = _entry_params(ptx, name)
    if total != declared + 2:
        raise NotImplementedError(f"triton backend: kernel {name}'s PTX takes {total} parameters, "
                                  f"expected {declared} declared and 2 hidden ones.")
    ours, hidden, profile = (f"{name}_param_{i}" for i in (declared - 1, declared, declared + 1))
    load = re.compile(rf"^(\s*)ld\.param\.b64\s+(%rd\d+),\s*\[{re.escape(hidden)}\];$", re.M)
    loads = load.findall(ptx)
    uses = {p: len(re.findall(rf"\b{re.escape(p)}\b", ptx)) - 1  # less the declaration
            for p in (ours, hidden, profile)}
    if len(loads) != 1 or uses[hidden] != 1 or uses[ours] or uses[profile]:
        raise NotImplementedError(
            f"triton backend: kernel {name}'s PTX reads its global scratch in a way this launch "
            f"cannot redirect ({len(loads)} ld.param.b64 of {hidden}, {uses[hidden]} uses; "
            f"{uses[ours]} uses of {ours}, {uses[profile]} of the profile scratch {profile}).")
    (indent, register), = loads
    replacement = (f"{indent}ld.param.b64 \t{register}, [{ours}];\n"
                   f"{indent}add.s64 \t{register}, {register}, {align - 1};\n"
                   f"{indent}and.b64 \t{register}, {register}, {-align};")
    return load.sub(lambda _: replacement, ptx, count=1)


def check_metadata(metadata: dict, scratch: Scratch, num_warps: int) -> None:
    """Refuses a kernel compiled at launch that differs from what its launch declared.

    Raises:
      NotImplementedError: another global scratch size or alignment than
        ``scratch`` (the output is already sized), or Triton changed the warp
        count (warp specialization adds warps; jaxlib launches ``num_warps``).
    """
    found = requirement(metadata)
    if found != scratch:
        raise NotImplementedError(
            f"triton backend: kernel {metadata.get('name')} compiled at launch needs {found} of global "
            f"scratch per program, but its launch was traced with {scratch}.")
    if metadata.get("num_warps", num_warps) != num_warps:
        raise NotImplementedError(
            f"triton backend: kernel {metadata.get('name')} was compiled to {metadata['num_warps']} warps "
            f"(warp specialization) but jax_triton launches {num_warps}.")


@dataclasses.dataclass(frozen=True)
class _Expected:
    marker: str  # the generated module's file name, which Triton keeps in the TTIR's locations
    scratch: Scratch
    declared: int


_EXPECTED: dict[str, _Expected] = {}


def expect(marker: str, scratch: Scratch, declared: int) -> None:
    """Announces a kernel the wrapped compile must redirect: its source's file name
    (``marker``), its scratch and its declared parameters (ours included)."""
    _EXPECTED[marker] = _Expected(marker, scratch, declared)


class _RecordingBackend:
    """A Triton backend that keeps the metadata dict of the compile it runs."""

    def __init__(self, backend):
        self._backend = backend
        self.metadata = None

    def __getattr__(self, attr):
        return getattr(self._backend, attr)

    def make_llir(self, src, metadata, *args, **kwargs):
        self.metadata = metadata
        return self._backend.make_llir(src, metadata, *args, **kwargs)


def _announced(ttir) -> _Expected | None:
    if not _EXPECTED:
        return None
    text = str(ttir)
    found = [e for marker, e in _EXPECTED.items() if marker in text]
    return found[0] if len(found) == 1 else None


def install(triton_lib) -> None:
    """Wraps ``triton_lib.compile_ttir_inplace`` (jax_triton's) once; again if something
    replaced the wrapper since."""
    if getattr(triton_lib.compile_ttir_inplace, _HOOKED, False):
        return
    real = triton_lib.compile_ttir_inplace

    @functools.wraps(real)
    def compile_ttir_inplace(ttir, backend, options, compute_capability, platform):
        if platform != "cuda":
            return real(ttir, backend, options, compute_capability, platform)
        expected = _announced(ttir)
        recording = _RecordingBackend(backend)
        result = real(ttir, recording, options, compute_capability, platform)
        if expected is None:
            if (recording.metadata or {}).get("global_scratch_size"):
                raise NotImplementedError(
                    f"triton backend: kernel {result.name} needs Triton's global scratch "
                    f"({recording.metadata['global_scratch_size']} bytes per program), which jaxlib's "
                    "launch passes as a null pointer, and no scratch output was declared for it.")
            return result
        check_metadata(recording.metadata, expected.scratch, options.num_warps)
        return dataclasses.replace(result, binary=redirect(result.binary, result.name, expected.declared,
                                                           expected.scratch.align))

    setattr(compile_ttir_inplace, _HOOKED, True)
    triton_lib.compile_ttir_inplace = compile_ttir_inplace
