"""What a GPU target allows one Triton program: the limits the tuner and the static gate check.

Shared memory per block is the opt-in maximum of each architecture (CUDA C
Programming Guide, "Compute Capabilities", table "Technical Specifications per
Compute Capability"): 227 KiB on sm_90 (H100/H200), 163 KiB on sm_80
(A100), 99 KiB on sm_86 / sm_89 (consumer Ampere and Ada).
"""
from __future__ import annotations

SMEM_LIMIT_BYTES = {"sm_80": 163 * 1024, "sm_86": 99 * 1024, "sm_89": 99 * 1024,
                    "sm_90": 227 * 1024}

# device_kind strings (jax.Device.device_kind) of the GPUs each target names, for
# reading the shipped cache entries of a target on a host that has no such GPU.
TARGET_DEVICE_KINDS = {"sm_90": ("NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H200"),
                       "sm_80": ("NVIDIA A100-SXM4-80GB", "NVIDIA A100-SXM4-40GB")}


def smem_limit(target: str) -> int:
    """Bytes of shared memory one block may use on ``target`` ("sm_90", ...).

    Raises:
      ValueError: a target not in :data:`SMEM_LIMIT_BYTES`.
    """
    if target not in SMEM_LIMIT_BYTES:
        raise ValueError(f"target: expected one of {sorted(SMEM_LIMIT_BYTES)}, got {target!r}.")
    return SMEM_LIMIT_BYTES[target]
