"""Bytes on the wire of one optimizer step, AdamW against OneBitAdam's compressed phase.

    python -m benchmarks.onebit_bytes          # from the repository root; ~1 min on 2 CPU cores

The reference GPT (default shape, 858,880 parameters) in bf16 on 4 gloo ranks at ZeRO stages 0, 1
and 2. The comms logger counts step 4's collectives. OneBitAdam's freeze_step is 2, so that step
is compressed. Prints the message bytes per collective (nccl-tests sizes) and the bus bytes,
which are what each link carries: all-reduce 2(n-1)/n of the message; all-gather, reduce-scatter
and all-to-all (n-1)/n.
"""

from __future__ import annotations

import torch

from partita.monitor.comms_logger import bus_factor
from tests.harness import run_distributed

WORLD = 4


def one_step_bytes(kind: str, stage: int) -> dict:
    import torch.distributed as dist

    import partita
    from partita.models.gpt import GPT, GPTConfig
    from partita.monitor.comms_logger import COMMS_LOGGER

    torch.manual_seed(0)
    model = GPT(GPTConfig())
    params = {"lr": 1e-3, **({"freeze_step": 2} if kind == "OneBitAdam" else {})}
    cfg = {"train_batch_size": 8, "bf16": {"enabled": True}, "optimizer": {"type": kind, "params": params},
           "zero_optimization": {"stage": stage}}
    engine, _, _, _ = partita.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    tokens = torch.Generator().manual_seed(dist.get_rank())
    counted: dict[tuple[str, str], int] = {}
    for step in range(4):
        COMMS_LOGGER.enabled = step == 3
        COMMS_LOGGER.reset()
        x = torch.randint(0, 256, (2, 64), generator=tokens)
        _, loss = engine(x, x)
        engine.backward(loss)
        engine.step()
    for record in COMMS_LOGGER.records():
        key = (record.op, record.purpose.split(" (")[0].split(":")[0])
        counted[key] = counted.get(key, 0) + record.message_bytes
    COMMS_LOGGER.enabled = False
    return {"params": sum(p.numel() for p in model.parameters()), "bytes": counted}


def main() -> None:
    for stage in (0, 1, 2):
        for kind in ("AdamW", "OneBitAdam"):
            result = run_distributed(one_step_bytes, WORLD, kind, stage)[0]
            message = sum(result["bytes"].values())
            bus = sum(v * bus_factor(op, WORLD) for (op, _), v in result["bytes"].items())
            print(f"stage {stage} {kind:<10} {result['params']:,} params: message {message:,} B, bus {bus:,.0f} B")
            for (op, purpose), value in sorted(result["bytes"].items()):
                print(f"    {op:<24}{purpose:<50}{value:>12,}")


if __name__ == "__main__":
    main()
