"""Client loops that drive gradient accumulation by hand, as DeepSpeed users (and Accelerate) write them.

Three patterns, each on a tiny MLP with the config's Adam, printed step by step:

- ``boundary``: Accelerate's ``DeepSpeedEngineWrapper``: ``engine.set_gradient_accumulation_boundary(
  is_boundary)`` before every backward, ``engine.backward(loss)`` each micro-batch and ``engine.step()``
  only at the boundary (gradient_accumulation_steps 4 in the config).
- ``no_sync_ddp``: DDP-style: gradient_accumulation_steps 1, three backwards inside ``engine.no_sync()``
  and a fourth outside it, then one ``engine.step()``.
- ``no_sync_every``: gradient_accumulation_steps 2, ``engine.step()`` after every backward and the
  window's first backward inside ``engine.no_sync()``.

Also the refusals: ``no_sync`` at ZeRO-2, ``no_sync`` re-entered, ``step()`` inside ``no_sync``.
``CLIENT_BACKEND=deepspeed`` runs it on DeepSpeed (only the import differs).

    CLIENT_BACKEND=deepspeed DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 tests/client_scripts/manual_accumulation_ds_style.py --out ds.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os

import torch
import torch.nn as nn

if os.environ.get("CLIENT_BACKEND") == "deepspeed":
    import deepspeed
else:
    import partita as deepspeed

MICRO = 2
GAS = {"boundary": 4, "no_sync_ddp": 1, "no_sync_every": 2}


def make_engine(pattern: str, stage: int):
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS[pattern],
        "optimizer": {"type": "Adam", "params": {"lr": 0.05}},
        "zero_optimization": {"stage": stage},
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def micro_batches(rank: int, count: int):
    g = torch.Generator().manual_seed(11)
    for _ in range(count):
        x, y = torch.randn(2 * MICRO, 6, generator=g), torch.randn(2 * MICRO, 3, generator=g)
        yield x[rank * MICRO:(rank + 1) * MICRO], y[rank * MICRO:(rank + 1) * MICRO]


def run(pattern: str, stage: int, rank: int) -> dict:
    engine = make_engine(pattern, stage)
    out: dict = {"losses": [], "global_steps": [], "micro_steps": [], "samples": [], "boundary": []}
    for i, (x, y) in enumerate(micro_batches(rank, 12)):
        if pattern == "boundary":
            last = (i + 1) % 4 == 0
            engine.set_gradient_accumulation_boundary(last)
            out["boundary"].append(engine.is_gradient_accumulation_boundary())
            loss = nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            if last:
                engine.step()
        elif pattern == "no_sync_ddp":
            context = engine.no_sync() if (i + 1) % 4 else contextlib.nullcontext()
            with context:
                loss = nn.functional.mse_loss(engine(x), y)
                engine.backward(loss)
            if (i + 1) % 4 == 0:
                engine.step()
        else:
            context = engine.no_sync() if i % 2 == 0 else contextlib.nullcontext()
            with context:
                loss = nn.functional.mse_loss(engine(x), y)
                engine.backward(loss)
            engine.step()
        out["losses"].append(loss.item())
        out["global_steps"].append(engine.global_steps)
        out["micro_steps"].append(engine.micro_steps)
        out["samples"].append(engine.global_samples)
    out["params"] = [p.detach().flatten()[:4].tolist() for p in engine.module.parameters()]
    return out


def refusals() -> dict:
    found = {}
    engine = make_engine("no_sync_every", 2)
    try:
        with engine.no_sync():
            pass
        found["zero2"] = "none"
    except Exception as error:  # noqa: BLE001 - the script records what each library raises
        found["zero2"] = f"{type(error).__name__}: {error}"
    engine = make_engine("no_sync_every", 1)
    try:
        with engine.no_sync():
            with engine.no_sync():
                pass
        found["reentry"] = "none"
    except Exception as error:  # noqa: BLE001
        found["reentry"] = f"{type(error).__name__}: {error}"
    try:
        with engine.no_sync():
            x, y = next(micro_batches(0, 1))
            engine.backward(nn.functional.mse_loss(engine(x), y))
            engine.step()
        found["step_inside"] = "none"
    except Exception as error:  # noqa: BLE001
        found["step_inside"] = f"{type(error).__name__}: {error}"
    return found


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args(argv)
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    result = {f"{pattern}/{stage}": run(pattern, stage, rank)
              for pattern, stages in (("boundary", (0, 1, 2)), ("no_sync_ddp", (0, 1)), ("no_sync_every", (0, 1)))
              for stage in stages}
    result["refusals"] = refusals()
    if rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
