"""SASS (the GPU's machine code) of a compiled kernel, and its loops.

:func:`pallas_core.triton.compile` reports what ``ptxas -v`` says (registers,
spills); how long a kernel's inner loop is needs the machine code itself.
``nvdisasm``, which ships with Triton, turns the cubin into SASS text;
:func:`loops` finds each loop as a backward branch and counts the
instructions from its target to the branch: what every thread issues per
iteration (one ``HGMMA`` counts as one instruction, however much work it
does). Straight-line code between loops, and the self-branch at the end of
every kernel, are not loops.
"""
from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import tempfile

_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(.*?)\s*;")
_BRANCH = re.compile(r"\bBRA\b.*`\((\.L_x_\d+)\)")


@dataclasses.dataclass(frozen=True)
class Loop:
    """One loop of a kernel's SASS: instructions ``[first, last]`` (indices into the
    kernel's instruction list), ``size = last - first + 1`` per iteration, and the
    count of each opcode (``HGMMA``, ``MUFU``, ``FFMA``, ...) in it."""

    first: int
    last: int
    opcodes: dict

    @property
    def size(self) -> int:
        return self.last - self.first + 1


def disassemble(cubin: bytes) -> str:
    """The SASS text of a cubin (Triton's own ``nvdisasm``; no GPU needed)."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as fh:
            fh.write(cubin)
        return subprocess.run([tool, "-c", path], capture_output=True, text=True, check=True).stdout


def instructions(sass: str) -> tuple[list[str], dict[str, int]]:
    """``(instructions, labels)``: every instruction's text (predicate, opcode,
    operands) in address order, and each label's index into that list."""
    found, labels = [], {}
    for line in sass.splitlines():
        label = _LABEL.match(line)
        if label:
            labels[label.group(1)] = len(found)
            continue
        ins = _INSTRUCTION.match(line)
        if ins:
            found.append(ins.group(2))
    return found, labels


def opcode(ins: str) -> str:
    """``"@!P0 FFMA.FTZ R1, ..."`` -> ``"FFMA"``."""
    words = ins.split()
    word = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
    return word.split(".")[0]


def loops(sass: str) -> list[Loop]:
    """Every loop (a backward branch spanning more than itself), in address order."""
    found, labels = instructions(sass)
    out = []
    for index, ins in enumerate(found):
        branch = _BRANCH.search(ins)
        if not branch or branch.group(1) not in labels:
            continue
        first = labels[branch.group(1)]
        if first < index:
            counts: dict[str, int] = {}
            for body in found[first:index + 1]:
                counts[opcode(body)] = counts.get(opcode(body), 0) + 1
            out.append(Loop(first, index, counts))
    return out
