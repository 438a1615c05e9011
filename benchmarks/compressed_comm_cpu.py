"""Measured step time and counted bytes with compression on and off, on sockets: 4 gloo ranks on CPU.

    python -m benchmarks.compressed_comm_cpu            # ~1-2 min on 2 CPU cores
    python -m benchmarks.compressed_comm_cpu --json out.json

gloo moves every collective over TCP (here loopback), so this is the socket transport a slow
inter-node link would use, but at loopback speed and with the ranks sharing the host's cores: it
shows the bytes really shrink and what quantizing costs on a CPU, not the speedup a slow network
would give (partita/monitor/comm_model.py models that). No throttle: gloo has no rate limit and
`tc` needs root. The reference GPT (default shape, 858,880 parameters), bf16, 2 samples x 64
tokens per rank, STEPS steps; the step time is the median of the steps after the first two, each
bracketed by barriers; bytes are the comms logger's message bytes of one step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from tests.harness import run_distributed

WORLD, STEPS, WARMUP = 4, 10, 2
Z3 = {"stage": 3, "stage3_param_persistence_threshold": 0}  # every weight sharded (the default keeps this model whole)
CASES = {
    "ZeRO-3": ("AdamW", Z3),
    "ZeRO-3 + qwZ": ("AdamW", {**Z3, "zero_quantized_weights": True}),
    "ZeRO-3 + qwZ + qgZ (int4)": ("AdamW", {**Z3, "zero_quantized_weights": True, "zero_quantized_gradients": True}),
    "ZeRO-0 AdamW": ("AdamW", {"stage": 0}),
    "ZeRO-0 OneBitAdam (compressed)": ("OneBitAdam", {"stage": 0}),
}


def run_case(name: str) -> dict:
    import torch.distributed as dist

    import partita
    from partita.models.gpt import GPT, GPTConfig
    from partita.monitor.comms_logger import COMMS_LOGGER

    kind, zero = CASES[name]
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    params = {"lr": 1e-3, **({"freeze_step": 1} if kind == "OneBitAdam" else {})}  # compressed from step 2
    cfg = {"train_batch_size": 2 * WORLD, "bf16": {"enabled": True}, "optimizer": {"type": kind, "params": params},
           "zero_optimization": zero, "comms_logger": {"enabled": True}, "steps_per_print": 10_000}
    engine, _, _, _ = partita.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    g = torch.Generator().manual_seed(dist.get_rank())
    times, counted, comm_s = [], 0, 0.0
    for step in range(STEPS):
        x = torch.randint(0, 256, (2, 64), generator=g)
        COMMS_LOGGER.reset()
        dist.barrier()
        begin = time.perf_counter()
        _, loss = engine(x, x)
        engine.backward(loss)
        engine.step()
        dist.barrier()
        times.append(time.perf_counter() - begin)
        if step == STEPS - 1:
            records = COMMS_LOGGER.records()
            counted = sum(r.message_bytes for r in records)
            comm_s = sum(r.seconds for r in records)
    return {"step_s": statistics.median(times[WARMUP:]), "message_bytes": counted, "comm_s": comm_s,
            "loss": float(loss.detach())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    args = parser.parse_args()
    results = {}
    print(f"{'case':<34}{'step ms':>10}{'bytes/step':>14}{'in collectives ms':>20}")
    for name in CASES:
        rank0 = run_distributed(run_case, WORLD, name)[0]
        results[name] = rank0
        print(f"{name:<34}{rank0['step_s'] * 1e3:>10.1f}{rank0['message_bytes']:>14,}{rank0['comm_s'] * 1e3:>20.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"world": WORLD, "steps": STEPS, "warmup": WARMUP, "torch": torch.__version__,
                       "cases": results}, f, indent=1)


if __name__ == "__main__":
    main()
