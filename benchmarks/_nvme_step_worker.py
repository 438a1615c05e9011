"""One training run of benchmarks/nvme_step.py, in its own process (fresh host and GPU memory).

Trains partita's GPT with ``zero_optimization.offload_optimizer.device "nvme"`` and times every
step: forward, backward and ``engine.step()`` (the host step: clipping, the swapped optimizer
step, the upload), with the device synchronised at each boundary; and from the swapper's own
record (``swapper.last_step``, partita/offload/swap_stats.py) the exact state bytes read and
written, the swapped step's compute / read-wait / write-wait split and the disk's busy seconds.

The spec (a JSON argument) fixes the model, the engine config and a wall-clock allowance: a step
is only started while the run's elapsed time plus the previous step's time fits the allowance,
so a slow disk shortens the run instead of overrunning the benchmark's time. A ``NVME_STEP``
line is printed after every step, so a run killed from outside still leaves its finished steps.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PREFIX = "NVME_STEP "


def engine_config(spec: dict) -> dict:
    cuda = spec["device"] == "cuda"
    cfg = {
        "train_micro_batch_size_per_gpu": spec["micro_batch"],
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
        "zero_optimization": {
            "stage": spec["stage"], "sub_group_size": spec["sub_group_size"],
            "reduce_bucket_size": spec["bucket"], "allgather_bucket_size": spec["bucket"],
            "offload_optimizer": {
                "device": "nvme", "nvme_path": spec["nvme_path"], "buffer_count": spec["buffer_count"],
                "pin_memory": cuda, "pipeline_read": spec["pipeline"], "pipeline_write": spec["pipeline"],
            },
        },
        "aio": spec["aio"],
    }
    if cuda:
        cfg["bf16"] = {"enabled": True}
    return cfg


def _disk_time(stats, bandwidth: dict | None) -> float:
    """Seconds the disk needs to read and write a full step's states (a step writes them all)."""
    if stats is None or not bandwidth:
        return 0.0
    return stats.bytes_written / (bandwidth["read"] * 1e9) + stats.bytes_written / (bandwidth["write"] * 1e9)


def _emit(row: dict) -> None:
    print(PREFIX + json.dumps(row), flush=True)


def run(spec: dict) -> None:
    import torch

    import partita
    from partita.models.gpt import GPT, GPTConfig

    started = time.perf_counter()
    cuda = spec["device"] == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    torch.manual_seed(0)
    gpt = GPTConfig(**spec["gpt"])
    with torch.device(device):
        model = GPT(gpt)
    params = model.num_parameters()
    engine, optimizer, _, _ = partita.initialize(model=model, config=engine_config(spec))
    swapper = optimizer.swapper
    init_s = time.perf_counter() - started
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randint(0, gpt.vocab_size, (spec["micro_batch"], gpt.block_size), device=device, generator=gen)
    y = torch.randint(0, gpt.vocab_size, (spec["micro_batch"], gpt.block_size), device=device, generator=gen)
    row = {"name": spec["name"], "params": params, "init_s": init_s, "steps": [], "done": False,
           "sub_groups": sum(len(r) for r in swapper._ranges.values()), "pool_gib": swapper.pool.total_bytes / 2**30,
           "pinned": swapper.pool.pinned, "direct_io": swapper.store.direct_io}
    last = 0.0
    for i in range(spec["warmup"] + spec["steps"]):
        # The next step is expected to take as long as the last one, and at least as long as the
        # disk needs for its bytes (the first step only writes, so it is shorter than the rest).
        expected = max(last, _disk_time(swapper.last_step, spec.get("bandwidth_gb_s")))
        if i > 0 and time.perf_counter() - started + expected > spec["allowance_s"]:
            row["stopped"] = f"allowance of {spec['allowance_s']:.0f} s reached after {i} steps"
            break
        io_before = swapper.store.io_counters()
        sync()
        t0 = time.perf_counter()
        _, loss = engine(x, y)
        sync()
        t1 = time.perf_counter()
        engine.backward(loss)
        sync()
        t2 = time.perf_counter()
        engine.step()
        sync()
        t3 = time.perf_counter()
        last = t3 - t0
        stats = swapper.last_step
        io = swapper.store.io_counters() - io_before
        row["steps"].append({
            "warmup": i < spec["warmup"], "step_s": last, "forward_s": t1 - t0, "backward_s": t2 - t1,
            "optimizer_s": t3 - t2, "loss": float(loss.detach()),
            "swap": stats.as_dict(),
            # The store over the whole step: also the reads the previous step's prefetch had left
            # in flight, and the prefetch this step started for the next.
            "step_io": io.as_dict(),
        })
        _emit(row)
    if cuda:
        row["peak_gpu_gib"] = torch.cuda.max_memory_allocated() / 2**30
    row["peak_host_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    row["done"] = True
    engine.destroy()
    _emit(row)


if __name__ == "__main__":
    run(json.loads(sys.argv[1]))
