"""The largest reference GPT each offload setting should train on one H200, by partita's estimator.

A prediction, not a measurement: it tells a GPU session which sizes to try first for issue 5's
"largest GPT per offload setting" (no offload, optimizer offload, optimizer + parameter offload,
NVMe added). For each setting it walks GPT-3-family shapes (sequence 2048, vocabulary 50304,
micro-batch 1, bf16, AdamW, every block checkpointed) from small to large and keeps the largest
whose predicted per-rank peaks fit the machine: accelerator ≤ (1 - headroom) × 139.8 GiB,
host ≤ (1 - headroom) × 128 GiB, NVMe swap files ≤ 64 GiB of disk.

    python benchmarks/largest_gpt_prediction.py [--headroom 0.05] [--markdown]

The estimator's model states are exact against partita's allocations; activations are within
3% of saved-tensor bytes measured on CPU; on the GPU its peaks came within 0.1-3% of measured
ones (benchmarks/results/2026-12-01-report.md), so a size at the edge of a limit still needs the GPU run.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from partita.estimate import Checkpointing, GPTShape, Setup, estimate_memory  # noqa: E402
from partita.estimate.model_info import model_info  # noqa: E402

GIB = 2**30
H200_GPU_BYTES = int(139.8 * GIB)  # what torch reports on the lent H200s
HOST_BYTES = 128 * GIB  # the one-H200 machine (KINDS.md)
DISK_BYTES = 64 * GIB

# (name, d_model, n_layers, n_heads): the GPT-3 paper's family, plus sizes between its 6.7 B and 13 B
# and between 13 B and 175 B.
SHAPES = (
    ("1.3B", 2048, 24, 16), ("2.7B", 2560, 32, 32), ("6.7B", 4096, 32, 32), ("8.1B", 4096, 40, 32),
    ("9.7B", 4096, 48, 32), ("11.4B", 4608, 44, 36), ("13B", 5120, 40, 40),
    ("20B", 6144, 44, 48), ("30B", 7168, 48, 56), ("40B", 8192, 48, 64), ("52B", 8192, 64, 64),
    ("65B", 8192, 80, 64), ("100B", 10240, 80, 80), ("175B", 12288, 96, 96),
)

SETTINGS = (
    ("no offload", dict(stage=3)),
    ("optimizer offload (cpu)", dict(stage=3, offload_optimizer="cpu")),
    ("optimizer + parameter offload (cpu)", dict(stage=3, offload_optimizer="cpu", offload_param="cpu")),
    ("optimizer + parameter offload (nvme)", dict(stage=3, offload_optimizer="nvme", offload_param="nvme")),
)


@dataclass(frozen=True)
class Fit:
    name: str
    params: int
    accelerator: int
    host: int
    nvme: int


def predict(shape: tuple[str, int, int, int], options: dict) -> Fit:
    name, d_model, n_layers, n_heads = shape
    gpt = GPTShape(d_model=d_model, n_layers=n_layers, n_heads=n_heads, vocab=50304, seq_len=2048)
    setup = Setup(dtype="bf16", micro_batch=1, checkpointing=Checkpointing("every"), **options)
    info = model_info(gpt)
    estimate = estimate_memory(info, setup)
    return Fit(name, info.trainable_numel, estimate.peak_accelerator, estimate.peak_cpu, estimate.nvme)


def largest(options: dict, headroom: float) -> tuple[Fit | None, Fit | None]:
    """The largest shape that fits, and the next one (the first that does not)."""
    fits = None
    for shape in SHAPES:
        fit = predict(shape, options)
        ok = (fit.accelerator <= (1 - headroom) * H200_GPU_BYTES and fit.host <= (1 - headroom) * HOST_BYTES
              and fit.nvme <= DISK_BYTES)
        if not ok:
            return fits, fit
        fits = fit
    return fits, None


def why_not(fit: Fit, headroom: float) -> str:
    limits = []
    if fit.accelerator > (1 - headroom) * H200_GPU_BYTES:
        limits.append(f"GPU {fit.accelerator / GIB:.1f} GiB")
    if fit.host > (1 - headroom) * HOST_BYTES:
        limits.append(f"host {fit.host / GIB:.1f} GiB")
    if fit.nvme > DISK_BYTES:
        limits.append(f"disk {fit.nvme / GIB:.1f} GiB")
    return ", ".join(limits)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--headroom", type=float, default=0.05, help="fraction of GPU and host memory kept free")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    args = parser.parse_args(argv)
    rows = []
    for label, options in SETTINGS:
        fit, beyond = largest(options, args.headroom)
        if fit is None:
            rows.append((label, "none", "—", "—", "—", "—", why_not(beyond, args.headroom)))
            continue
        stop = f"{beyond.name}: {why_not(beyond, args.headroom)}" if beyond else "all shapes fit"
        rows.append((label, fit.name, f"{fit.params / 1e9:.2f} B", f"{fit.accelerator / GIB:.1f}",
                     f"{fit.host / GIB:.1f}", f"{fit.nvme / GIB:.1f}", stop))
    headers = ("setting", "largest", "parameters", "GPU GiB", "host GiB", "NVMe GiB", "next size over the limit")
    if args.markdown:
        print("| " + " | ".join(headers) + " |")
        print("|" + "---|" * len(headers))
        for row in rows:
            print("| " + " | ".join(row) + " |")
        return
    widths = [max(len(str(x)) for x in column) for column in zip(headers, *rows)]
    for row in (headers, *rows):
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths)))


if __name__ == "__main__":
    main(sys.argv[1:])
