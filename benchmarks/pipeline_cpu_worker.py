"""One rank of the pipeline benchmark (``benchmarks/pipeline_cpu.py`` launches it under torchrun).

    OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu torchrun --nproc-per-node 4 benchmarks/pipeline_cpu_worker.py \
        --configs partita:1f1b:1:8,deepspeed:1f1b:1:8,... --rounds 3 --steps 4 --warmup 2 --out DIR

Every configuration (engine : schedule : virtual stages : micro-batches) gets its own
PipelineModule and engine, all built first in this one gloo process group (DeepSpeed and partita
both adopt it); then ``rounds`` rounds run ``steps`` timed batches of every configuration, in an
order rotated each round, so drift of the shared machine spreads over both engines and all
schedules alike.

Idle (bubble) time per stage, the same method for both engines (and the one partita's own
``pipeline.measure_bubble`` timers use): the schedule's wall time minus the time spent inside its
compute calls.

- partita: the torch PipelineStage methods ``forward_one_chunk``, ``backward_one_chunk`` and
  ``backward_weight_one_chunk`` of the engine's training stages and the loss function are
  wrapped with timers; the window is the torch schedule's ``step``.
- DeepSpeed: the engine's instruction table (``_INSTRUCTION_MAP``, looked up on the instance by
  ``_exec_schedule``) is replaced on the instance by timed copies; compute = ``ForwardPass`` +
  ``BackwardPass`` (the loss runs inside ``ForwardPass``); the window is ``_exec_schedule`` minus
  ``ReduceTiedGrads``, ``ReduceGrads`` and ``OptimizerStep``, which run after the pipeline drains.

Each timed call also records the main thread's CPU time (``time.thread_time``), so the record
shows how much of a compute call's wall time the rank actually had a core.

Both wrap private attributes of the engines (partita's ``_stages`` / ``_train_schedule``,
DeepSpeed's ``_INSTRUCTION_MAP``); that is what a benchmark that must time inside both may do,
and the worker fails loudly if they move.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from types import MethodType

import torch
import torch.distributed as dist
from torch import nn
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ is not a package
from output_paths import output_file  # noqa: E402

DIM, HIDDEN, ROWS, BLOCKS, BASE_SEED = 256, 1024, 64, 16, 1234
OPTIMIZER = {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}}


class Block(nn.Module):
    """A pre-norm residual MLP block: the repeated layer of a transformer without attention."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


def batch(step: int, micro_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same micro-batches for every engine at the same step (every rank draws them; cheap)."""
    g = torch.Generator().manual_seed(10_000 + step)
    x = torch.randn(micro_batches, ROWS, DIM, generator=g)
    y = torch.randn(micro_batches, ROWS, DIM, generator=g)
    return [(x[k], y[k]) for k in range(micro_batches)]


class Clock:
    """Per-batch sums of timed regions, by name."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}

    def reset(self) -> None:
        self.sums = {}

    def add(self, name: str, seconds: float) -> None:
        self.sums[name] = self.sums.get(name, 0.0) + seconds

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            begin, cpu = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(name, time.perf_counter() - begin)
                self.add("cpu_" + name, time.thread_time() - cpu)

        return timed


def config(micro_batches: int, extra: dict) -> dict:
    return {
        "train_micro_batch_size_per_gpu": ROWS,
        "gradient_accumulation_steps": micro_batches,
        "gradient_clipping": 1.0,
        "steps_per_print": 1_000_000,
        "optimizer": json.loads(json.dumps(OPTIMIZER)),
        "zero_optimization": {"stage": 0},
        **extra,
    }


def build_partita(schedule: str, virtual: int, micro_batches: int, clock: Clock):
    import partita
    from partita.pipe import LayerSpec, PipelineModule

    model = PipelineModule([LayerSpec(Block, DIM, HIDDEN) for _ in range(BLOCKS)], num_stages=dist.get_world_size(),
                           loss_fn=clock.wrap("loss", mse), partition_method="uniform", seed_layers=True,
                           base_seed=BASE_SEED, virtual_stages=virtual)
    # "zero_bubble/autograd": the schedule with pipeline.zero_bubble_weight_split "autograd" (torch's split)
    name, _, split = schedule.partition("/")
    pipeline = {"schedule": name, **({"zero_bubble_weight_split": split} if split else {})}
    engine, *_ = partita.initialize(model=model, config=config(micro_batches, {"pipeline": pipeline}))
    for stage in engine._stages:
        for method, name in (("forward_one_chunk", "forward"), ("backward_one_chunk", "backward"),
                             ("backward_weight_one_chunk", "backward_weight")):
            setattr(stage, method, clock.wrap(name, getattr(stage, method)))
    engine._train_schedule.step = clock.wrap("window", engine._train_schedule.step)
    return engine


_DS_COMPUTE = {"ForwardPass": "forward", "BackwardPass": "backward"}
_DS_AFTER = {"ReduceTiedGrads", "ReduceGrads", "OptimizerStep"}


def build_deepspeed(micro_batches: int, clock: Clock):
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule

    model = PipelineModule([LayerSpec(Block, DIM, HIDDEN) for _ in range(BLOCKS)], num_stages=dist.get_world_size(),
                           loss_fn=mse, partition_method="uniform", seed_layers=True, base_seed=BASE_SEED)
    cfg = config(micro_batches, {})
    # torch.optim.AdamW rather than DeepSpeed's CPU FusedAdam, which would be JIT-compiled first (~2 min here).
    cfg["optimizer"]["params"]["torch_adam"] = True
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                      config=cfg)
    table = {}
    for instr, fn in type(engine)._INSTRUCTION_MAP.items():
        name = instr.__name__
        label = _DS_COMPUTE.get(name, "after" if name in _DS_AFTER else "other_" + name)
        table[instr] = _timed_method(clock, label, fn)
    engine._INSTRUCTION_MAP = table  # the instance's table shadows the class's in _exec_schedule
    engine._exec_schedule = MethodType(_timed_method(clock, "schedule", type(engine)._exec_schedule), engine)
    return engine


def _timed_method(clock: Clock, name: str, fn):
    def timed(self, *args, **kwargs):
        begin, cpu = time.perf_counter(), time.thread_time()
        try:
            return fn(self, *args, **kwargs)
        finally:
            clock.add(name, time.perf_counter() - begin)
            clock.add("cpu_" + name, time.thread_time() - cpu)

    return timed


def run_batch(engine, micro_batches: int, step: int, clock: Clock) -> dict:
    data = batch(step, micro_batches)
    clock.reset()
    dist.barrier()
    cpu0, begin = time.process_time(), time.perf_counter()
    loss = engine.train_batch(iter(data))
    step_s = time.perf_counter() - begin
    sums = dict(clock.sums)
    if "schedule" in sums:  # DeepSpeed: the pipelined part of _exec_schedule
        sums["window"] = sums.pop("schedule") - sums.get("after", 0.0)
    kinds = ("forward", "backward", "backward_weight", "loss")
    compute = sum(sums.get(k, 0.0) for k in kinds)
    # The main thread's CPU time inside compute: below compute_s when the OS ran another rank
    # on this core meanwhile (4 ranks on 2 cores).
    compute_cpu = sum(sums.get("cpu_" + k, 0.0) for k in kinds)
    return {"step_s": step_s, "window_s": sums.get("window", 0.0), "compute_s": compute, "compute_cpu_s": compute_cpu,
            "cpu_s": time.process_time() - cpu0, "loss": float(loss), "parts": {k: round(v, 6) for k, v in sums.items()}}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--configs", required=True, help="comma-separated engine:schedule:virtual:micro_batches")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", type=output_file, required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    configs = []
    for item in args.configs.split(","):
        engine, schedule, virtual, m = item.split(":")
        configs.append((engine, schedule, int(virtual), int(m)))
    # Both engines in one process group, so their batches take turns on the same machine minutes.
    dist.init_process_group(backend="gloo")
    if any(c[0] == "deepspeed" for c in configs):
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")  # adopts the gloo group
    if any(c[0] == "partita" for c in configs):
        import partita

        partita.init_distributed()  # adopts it too
    rank = dist.get_rank()
    runs = []
    for engine_name, schedule, virtual, m in configs:
        clock = Clock()
        started = time.perf_counter()
        if engine_name == "partita":
            engine = build_partita(schedule, virtual, m, clock)
        else:
            engine = build_deepspeed(m, clock)
        runs.append({"engine": engine_name, "schedule": schedule, "virtual_stages": virtual, "micro_batches": m,
                     "rank": rank, "init_s": time.perf_counter() - started, "clock": clock, "impl": engine,
                     "steps": [], "warmup": [], "next_step": 0})
    shift = max(1, len(runs) // max(1, args.rounds))
    for round_ in range(args.rounds):
        at = (round_ * shift) % len(runs)
        order = runs[at:] + runs[:at]
        for run in order:
            n_warm = args.warmup if round_ == 0 else 0
            for i in range(n_warm + args.steps):
                record = run_batch(run["impl"], run["micro_batches"], run["next_step"], run["clock"])
                record["round"] = round_
                bubble = getattr(run["impl"], "last_bubble", None)  # partita's own timers, where present
                if isinstance(bubble, dict):
                    record["engine_bubble"] = {k: bubble.get(k) for k in ("schedule_s", "compute_s", "idle_fraction")}
                run["next_step"] += 1
                (run["warmup"] if i < n_warm else run["steps"]).append(record)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump([{k: v for k, v in r.items() if k not in ("clock", "impl", "next_step")} for r in runs], f)


if __name__ == "__main__":
    main()
