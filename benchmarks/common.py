"""Pieces shared by the benchmark driver and its workers: the model size, the training config,
the data, and the facts about the machine that go next to every figure.

Kept in one place so that every engine in a run trains exactly the same thing: the same model
shape, the same seed, the same token windows on the same rank at the same step, and the same
DeepSpeed-style config dict (only keys both partita and DeepSpeed understand).

Benchmarks are not part of the ``partita`` package: peers such as DeepSpeed are installed only in
the benchmark environment, never as dependencies of partita.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass
from typing import Any

# The engines the CPU step-time benchmark knows. "ddp" is plain torch DistributedDataParallel:
# not a ZeRO engine, so it only appears at stage 0, as the floor both ZeRO engines are measured
# against.
ENGINES = ("partita", "deepspeed", "ddp")


@dataclass(frozen=True)
class ModelSize:
    """Shape of the CPU reference GPT (3.3 M parameters, 1024 tokens per rank per step).
    Chosen so that one step on one core takes well under a second:
    long enough that timer and barrier noise (~0.1 ms) is negligible, short enough that a whole
    run (3 stages x 2 engines, plus the DDP row) finishes in a few minutes on 2 cores."""

    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 256
    micro_batch: int = 8


def training_config(*, stage: int, micro_batch: int, lr: float = 3e-4) -> dict[str, Any]:
    """The one config dict given to both partita and DeepSpeed.

    fp32 (no fp16/bf16 section), AdamW with weight decay, gradient clipping 1.0, DeepSpeed's
    default bucket sizes written out so neither engine silently picks another. ``overlap_comm``
    is left out on purpose: each engine keeps its own default for it (DeepSpeed: off below
    stage 3), which is what a user who copies this config gets.
    """
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 1_000_000,  # keep per-step logging out of the timed region
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1},
        },
        "zero_optimization": {
            "stage": stage,
            "contiguous_gradients": True,
            "reduce_scatter": True,
            "reduce_bucket_size": 500_000_000,
            "allgather_bucket_size": 500_000_000,
        },
    }


def best_seconds(fn, reps: int = 3) -> float:
    """The fastest of ``reps`` timed calls of ``fn``, after one untimed warm-up call (page
    faults, thread pool start)."""
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def median_ms(seconds: list[float]) -> float:
    return 1000.0 * statistics.median(seconds)


def git_commit(repo: str) -> str:
    """Short commit of the partita tree measured, with '+dirty' when it has uncommitted changes
    (a figure must say which code produced it)."""
    try:
        head = subprocess.run(
            ["git", "-C", repo, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (subprocess.CalledProcessError, FileNotFoundError):
        return "uncommitted"  # a fresh repository without commits has no HEAD
    dirty = subprocess.run(
        ["git", "-C", repo, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
    ).stdout.strip()
    return head + ("+dirty" if dirty else "")


def hardware_summary() -> dict[str, Any]:
    """CPU model, core count and cache sizes from lscpu (falls back to platform on machines
    without util-linux)."""
    info: dict[str, Any] = {"nproc": os.cpu_count(), "machine": platform.machine()}
    try:
        out = subprocess.run(["lscpu", "-J"], capture_output=True, text=True, check=True).stdout
        fields = {row["field"].rstrip(":"): row["data"] for row in json.loads(out)["lscpu"]}
    except (subprocess.CalledProcessError, FileNotFoundError, json.JSONDecodeError, KeyError):
        fields = {}
    for key in ("Model name", "CPU(s)", "Thread(s) per core", "Hypervisor vendor", "L2 cache", "L3 cache"):
        if key in fields:
            info[key] = fields[key]
    flags = fields.get("Flags", "")
    info["simd"] = " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f in flags.split())
    try:
        with open("/proc/meminfo") as f:
            kib = int(f.readline().split()[1])
        info["memory_gib"] = round(kib / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    return info


def versions() -> dict[str, str]:
    """Versions of everything that decides a figure; DeepSpeed is optional here (the driver can
    run without it installed)."""
    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        from importlib.metadata import version

        out["deepspeed"] = version("deepspeed")
    except Exception:  # noqa: BLE001 - metadata lookup failures all mean "not installed"
        out["deepspeed"] = "not installed"
    return out


def size_dict(size: ModelSize) -> dict[str, int]:
    return asdict(size)


def cpu_busy_seconds() -> float:
    """CPU-seconds the whole machine has spent busy since boot (all cores, from /proc/stat)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    # guest time is already counted in user time; leave it out so nothing counts twice
    busy = sum(fields[:8]) - idle
    return busy / os.sysconf("SC_CLK_TCK")


def children_cpu_seconds() -> float:
    """CPU-seconds used by this process's finished children and their descendants (torchrun
    waits for its workers, so their time is included)."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def wait_until_quiet(*, threshold: float, max_wait_s: float, sample_s: float = 2.0) -> float:
    """Sleep until the machine's busy fraction over one sample is below ``threshold`` (0-1) or
    ``max_wait_s`` has passed; return the seconds waited.

    On a machine shared with other jobs a launch that overlaps them measures them too; waiting
    for a quiet moment is cheaper than discarding the run afterwards.
    """
    import time

    ncpu = os.cpu_count() or 1
    waited = 0.0
    while True:
        b0, t0 = cpu_busy_seconds(), time.monotonic()
        time.sleep(sample_s)
        busy = (cpu_busy_seconds() - b0) / ((time.monotonic() - t0) * ncpu)
        waited += sample_s
        if busy < threshold or waited >= max_wait_s:
            return waited
