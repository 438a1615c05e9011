"""Where ZeRO-Offload's step time goes on a GPU host.

1. The host kernels of an offloaded step per thread count, on 256 M fp32 elements (scaled to
   GPT-1.3B's 1.316 B): torch's fused AdamW, the bf16 -> fp32 gradient add (from the main thread
   and from a worker thread), the fp32 -> bf16 weight cast.
2. Pinned host <-> device bandwidth with 64 MiB copies.
3. Two GPT-1.3B steps with optimizer offload (one GPU, ZeRO-2, bf16, micro-batch 8, sequence
   2048) under torch.profiler: per-phase wall times and the top operators by CPU time.

    python benchmarks/diagnostics/offload_profile.py [--delayed]    # trace: $OUT/offload_trace.json

Results of 2026-11-29 (one H200, 32 host cores): benchmarks/results/offload_diagnosis_before_2026-11-29.log
(before the direct gradient write) and ..._after_2026-11-29.log, printed by the same steps in an
earlier, unstructured form of this script (this one has not run on a GPU yet).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import best_seconds  # noqa: E402

import partita  # noqa: E402
from partita.models import GPT, GPTConfig  # noqa: E402

KERNEL_NUMEL = 256 * 2**20
GPT_1_3B_NUMEL = 1_315_819_520


def host_kernels() -> None:
    param, grad = torch.empty(KERNEL_NUMEL).uniform_(), torch.empty(KERNEL_NUMEL).uniform_()
    low, cast_out = torch.empty(KERNEL_NUMEL, dtype=torch.bfloat16).uniform_(), torch.empty(KERNEL_NUMEL, dtype=torch.bfloat16)
    optimizer = torch.optim.AdamW([param], lr=1e-4, fused=True)
    param.grad = grad
    scale = GPT_1_3B_NUMEL / KERNEL_NUMEL
    default = torch.get_num_threads()
    for threads in sorted({1, 4, 8, 16, default, os.cpu_count() or 1}):
        torch.set_num_threads(threads)
        adam = best_seconds(optimizer.step)
        add = best_seconds(lambda: grad.add_(low, alpha=0.5))
        cast = best_seconds(lambda: cast_out.copy_(param))
        in_worker: dict[str, float] = {}
        worker = threading.Thread(target=lambda: in_worker.setdefault("s", best_seconds(lambda: grad.add_(low, alpha=0.5))))
        worker.start()
        worker.join()
        print(f"threads {threads:2d}: per 1.3 B elements  fused AdamW {adam * scale * 1e3:5.0f} ms  "
              f"bf16->fp32 add {add * scale * 1e3:5.0f} ms (worker thread {in_worker['s'] * scale * 1e3:5.0f})  "
              f"fp32->bf16 cast {cast * scale * 1e3:5.0f} ms", flush=True)
    torch.set_num_threads(default)


def pcie() -> None:
    pinned = torch.empty(64 * 2**20, dtype=torch.uint8).pin_memory()
    device = torch.empty_like(pinned, device="cuda")
    for name, copy in (("H2D", lambda: device.copy_(pinned, non_blocking=True)),
                       ("D2H", lambda: pinned.copy_(device, non_blocking=True))):
        copy()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(50):
            copy()
        torch.cuda.synchronize()
        print(f"{name} pinned, 64 MiB copies: {50 * 64 / 1024 / (time.perf_counter() - start):.1f} GiB/s", flush=True)


def profiled_steps(delayed: bool) -> None:
    config = GPTConfig.gpt_1_3b()
    with torch.device("cuda"):
        model = GPT(config)
    engine, _, _, _ = partita.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 8, "gradient_clipping": 1.0, "steps_per_print": 10**6,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True,
                                                                "delayed_param_update": delayed}},
    })
    tokens = torch.randint(0, config.vocab_size, (8, config.block_size), device="cuda")

    def step() -> list[int]:
        marks = [time.perf_counter()]
        loss = engine(tokens, tokens)[1]
        torch.cuda.synchronize()
        marks.append(time.perf_counter())
        engine.backward(loss)
        torch.cuda.synchronize()
        marks.append(time.perf_counter())
        engine.step()
        torch.cuda.synchronize()
        marks.append(time.perf_counter())
        return [round(1e3 * (b - a)) for a, b in zip(marks, marks[1:])]

    for _ in range(3):
        print("warm-up step forward/backward/step ms", step(), flush=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            print("profiled step forward/backward/step ms", step(), flush=True)
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=60), flush=True)
    prof.export_chrome_trace(os.path.join(os.environ.get("OUT", "/tmp"), "offload_trace.json"))


def main() -> None:
    print(f"torch threads {torch.get_num_threads()}, OMP_NUM_THREADS {os.environ.get('OMP_NUM_THREADS')}, "
          f"cores {os.cpu_count()}", flush=True)
    host_kernels()
    pcie()
    profiled_steps(delayed="--delayed" in sys.argv)


if __name__ == "__main__":
    main()
