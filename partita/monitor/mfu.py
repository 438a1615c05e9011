"""Model FLOPs utilisation: achieved training FLOP/s per device over the device's peak.

MFU (PaLM, appendix B) counts the FLOPs the *model* needs per token — forward and backward,
not the recomputation of activation checkpointing — so runs with different memory tricks
compare on the same scale:

    achieved TFLOP/s per device = flops_per_token × tokens/s ÷ devices ÷ 1e12
    MFU = achieved TFLOP/s per device ÷ peak dense TFLOP/s of the device

Peaks are the vendors' dense (no structured sparsity) tensor-core numbers in the compute
precision; fp32 uses the TF32 figure when torch lets matmuls use TF32, else plain FP32.
"""

from __future__ import annotations

import torch

# (substring of torch.cuda.get_device_name(), {precision: peak dense TFLOP/s}). The first
# match wins, so more specific names come first ("H100 PCIe" before "H100").
_PEAKS: tuple[tuple[str, dict[str, float]], ...] = (
    ("GH200", {"bf16": 989.0, "fp16": 989.0, "tf32": 494.5, "fp32": 66.9}),
    ("H200", {"bf16": 989.0, "fp16": 989.0, "tf32": 494.5, "fp32": 66.9}),
    ("H100 PCIe", {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.2}),
    ("H100 NVL", {"bf16": 835.0, "fp16": 835.0, "tf32": 417.5, "fp32": 60.0}),
    ("H100", {"bf16": 989.0, "fp16": 989.0, "tf32": 494.5, "fp32": 66.9}),
    ("H800", {"bf16": 989.0, "fp16": 989.0, "tf32": 494.5, "fp32": 66.9}),
    ("B200", {"bf16": 2250.0, "fp16": 2250.0, "tf32": 1100.0, "fp32": 75.0}),
    ("A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    ("A800", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    ("L40S", {"bf16": 362.0, "fp16": 362.0, "tf32": 183.0, "fp32": 91.6}),
    ("L40", {"bf16": 181.0, "fp16": 181.0, "tf32": 90.5, "fp32": 90.5}),
    ("L4", {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    ("A10", {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    ("V100", {"fp16": 125.0, "fp32": 15.7}),
    ("MI300X", {"bf16": 1307.4, "fp16": 1307.4, "tf32": 653.7, "fp32": 163.4}),
    ("MI250X", {"bf16": 383.0, "fp16": 383.0, "fp32": 95.7}),
)


def peak_tflops_for(device_name: str, precision: str, *, allow_tf32: bool = False) -> float | None:
    """The table's peak dense TFLOP/s for a device name and "bf16" | "fp16" | "fp32", or None."""
    for pattern, peaks in _PEAKS:
        if pattern in device_name:
            if precision == "fp32" and allow_tf32 and "tf32" in peaks:
                return peaks["tf32"]
            return peaks.get(precision)
    return None


def device_peak_tflops(device: torch.device, precision: str) -> float | None:
    """Peak of this process's device, or None (CPU, or a GPU the table lacks)."""
    if device.type != "cuda":
        return None
    return peak_tflops_for(
        torch.cuda.get_device_name(device), precision, allow_tf32=torch.backends.cuda.matmul.allow_tf32
    )


def achieved_tflops_per_device(*, flops_per_token: float, tokens_per_second: float, num_devices: int) -> float:
    """Model TFLOP/s each device delivers when the whole job processes ``tokens_per_second``."""
    return flops_per_token * tokens_per_second / num_devices / 1e12


def model_flops_utilization(*, achieved_tflops: float, peak_tflops: float) -> float:
    """Fraction (0..1) of the device's peak the model's FLOPs use."""
    return achieved_tflops / peak_tflops
