"""One timed training run, launched by ``cpu_step_time.py`` under torchrun (one process per rank).

Usage (the driver builds this command; run by hand only to debug one configuration):

    OMP_NUM_THREADS=1 [DS_ACCELERATOR=cpu] torchrun --nproc_per_node 2 benchmarks/cpu_step_worker.py \
        --engine {partita,deepspeed,ddp} --stage {0,1,2,3} [--offload cpu [--delayed-update]] --steps 20 --warmup 5 \
        --out result.json

What is timed: one full optimizer step -- forward, backward, ``step`` -- between two
``torch.distributed.barrier`` calls, so a step counts as done only when both ranks are done (the
slower rank decides, as it does in real training). Warm-up steps (first-touch allocations,
DeepSpeed's lazy buffers, optimizer state creation) are run and left out.

Every engine starts from the same weights (``torch.manual_seed`` before the model is built) and
sees the same token windows on the same rank at the same step, so their losses must agree to
within float rounding; the driver prints them side by side as a check that both engines trained
the same thing.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ModelSize, training_config  # noqa: E402
from output_paths import output_file  # noqa: E402

StepFn = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, float, float, float]]
# Facts an engine's setup learns that belong in the result (which optimizer class really steps).
SETUP_INFO: dict[str, str] = {}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=("partita", "deepspeed", "ddp"), required=True)
    p.add_argument("--stage", type=int, choices=(0, 1, 2, 3), required=True)
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps before the timed ones")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--corpus-bytes", type=int, default=4_000_000)
    p.add_argument("--ds-torch-adam", action="store_true",
                   help="DeepSpeed: use torch.optim.AdamW instead of its own compiled CPU FusedAdam")
    p.add_argument("--offload", choices=("none", "cpu"), default="none",
                   help="zero_optimization.offload_optimizer.device (stages 1-3; ZeRO-Offload)")
    p.add_argument("--delayed-update", action="store_true",
                   help="partita only: offload_optimizer.delayed_param_update (one-step-delayed update)")
    p.add_argument("--out", type=output_file, required=True, help="JSON file rank 0 writes its measurements to")
    return p.parse_args()


def build_model(size: ModelSize, seed: int) -> torch.nn.Module:
    from partita.models.gpt import GPT, GPTConfig

    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=size.vocab_size, block_size=size.block_size, n_layer=size.n_layer,
                         n_head=size.n_head, n_embd=size.n_embd, dropout=0.0, bias=True))


def batches(size: ModelSize, *, total_steps: int, seed: int, rank: int, world: int, corpus_bytes: int):
    """Yield (x, y) for each step: windows of the stdlib corpus at offsets drawn from one seeded
    generator, the same for every engine; each rank takes its own column of offsets."""
    from partita.data.corpus import load_corpus

    tokens = load_corpus(max_bytes=corpus_bytes)
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.randint(0, len(tokens) - size.block_size - 1, (total_steps, world, size.micro_batch), generator=gen)
    for step in range(total_steps):
        rows = [np.asarray(tokens[o:o + size.block_size + 1], dtype=np.int64) for o in offsets[step, rank].tolist()]
        window = torch.from_numpy(np.stack(rows))
        yield window[:, :-1].contiguous(), window[:, 1:].contiguous()


def _timed_engine_step(engine) -> StepFn:
    """partita and DeepSpeed share the same three-call loop."""

    def step(x: torch.Tensor, y: torch.Tensor):
        t0 = time.perf_counter()
        _, loss = engine(x, y)
        t1 = time.perf_counter()
        engine.backward(loss)
        t2 = time.perf_counter()
        engine.step()
        t3 = time.perf_counter()
        return loss.detach(), t1 - t0, t2 - t1, t3 - t2

    return step


def setup_partita(model: torch.nn.Module, cfg: dict) -> StepFn:
    import partita

    engine, _, _, _ = partita.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    inner = engine.optimizer.inner  # the torch optimizer stepping the fp32 master partitions
    fused = inner.param_groups[0].get("fused")
    SETUP_INFO["optimizer_class"] = type(inner).__name__ + (" (fused)" if fused else "")
    return _timed_engine_step(engine)


def setup_deepspeed(model: torch.nn.Module, cfg: dict, *, torch_adam: bool) -> StepFn:
    import deepspeed

    if torch_adam:
        cfg["optimizer"]["params"]["torch_adam"] = True
        if cfg["zero_optimization"].get("offload_optimizer", {}).get("device", "none") != "none":
            # DeepSpeed refuses any optimizer but its CPU Adam with offload unless told otherwise.
            cfg["zero_force_ds_cpu_optimizer"] = False
    # torch.distributed is already up (gloo); DeepSpeed adopts the existing process group.
    deepspeed.init_distributed(dist_backend="gloo")
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    # With offload DeepSpeed swaps in its own CPU Adam: record what it actually built.
    SETUP_INFO["optimizer_class"] = type(engine.basic_optimizer).__name__
    return _timed_engine_step(engine)


def setup_ddp(model: torch.nn.Module, cfg: dict) -> StepFn:
    """Plain torch: DDP + fused AdamW + clip_grad_norm_, the floor a ZeRO-0 engine should reach."""
    from torch.nn.parallel import DistributedDataParallel

    params = cfg["optimizer"]["params"]
    ddp = DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=params["lr"], betas=tuple(params["betas"]), eps=params["eps"],
                            weight_decay=params["weight_decay"], fused=True)
    clip = cfg["gradient_clipping"]

    def step(x: torch.Tensor, y: torch.Tensor):
        t0 = time.perf_counter()
        _, loss = ddp(x, y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        return loss.detach(), t1 - t0, t2 - t1, t3 - t2

    return step


def main() -> None:
    args = parse_args()
    # The same process group for every engine: gloo over the torchrun rendezvous.
    dist.init_process_group(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    size = ModelSize()
    cfg = training_config(stage=args.stage, micro_batch=size.micro_batch)
    if args.offload != "none":
        if args.engine == "ddp" or args.stage == 0:
            raise SystemExit("--offload needs a ZeRO engine at stage 1, 2 or 3")
        # Only the device: every other offload key stays at its default, the same in both engines
        # (pin_memory true, buffer_count 4; pinning is a no-op without a GPU in both).
        cfg["zero_optimization"]["offload_optimizer"] = {"device": args.offload}
    if args.delayed_update:
        if args.engine != "partita" or args.offload == "none":
            raise SystemExit("--delayed-update is a partita option of CPU offload: "
                             "use it with --engine partita --offload cpu")
        cfg["zero_optimization"]["offload_optimizer"]["delayed_param_update"] = True
    model = build_model(size, args.seed)
    n_params = sum(p.numel() for p in model.parameters())

    t_init = time.perf_counter()
    if args.engine == "partita":
        step = setup_partita(model, cfg)
    elif args.engine == "deepspeed":
        step = setup_deepspeed(model, cfg, torch_adam=args.ds_torch_adam)
    else:
        if args.stage != 0:
            raise SystemExit("ddp is plain data parallelism: only --stage 0 makes sense")
        step = setup_ddp(model, cfg)
    init_s = time.perf_counter() - t_init

    total = args.warmup + args.steps
    step_s: list[float] = []
    phases: list[tuple[float, float, float]] = []
    losses: list[torch.Tensor] = []
    for i, (x, y) in enumerate(batches(size, total_steps=total, seed=args.seed, rank=rank, world=world,
                                       corpus_bytes=args.corpus_bytes)):
        dist.barrier()
        t0 = time.perf_counter()
        loss, fwd, bwd, opt = step(x, y)
        dist.barrier()
        elapsed = time.perf_counter() - t0
        losses.append(loss)
        if i >= args.warmup:
            step_s.append(elapsed)
            phases.append((fwd, bwd, opt))

    # Mean over ranks of each step's loss: the global-batch loss, comparable across engines.
    loss_curve = torch.stack(losses).float()
    dist.all_reduce(loss_curve)
    loss_curve /= world
    peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss], dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)

    if rank == 0:
        result = {
            "engine": args.engine,
            "stage": args.stage,
            "world_size": world,
            "params": n_params,
            "init_s": init_s,
            "step_s": step_s,
            "forward_s": [p[0] for p in phases],
            "backward_s": [p[1] for p in phases],
            "optimizer_step_s": [p[2] for p in phases],
            "loss_curve": loss_curve.tolist(),
            "peak_rss_mib": peak.item() / 1024.0,
            "ds_torch_adam": args.ds_torch_adam if args.engine == "deepspeed" else None,
            "offload": args.offload,
            "delayed_update": args.delayed_update,
            **SETUP_INFO,
        }
        with open(args.out, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
