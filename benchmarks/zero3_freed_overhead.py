"""Cost of guarding freed ZeRO-3 parameters (partita/zero/freed.py), on CPU.

Two measurements:

1. The primitive, in this process: per parameter of a GPT-2-small-shaped model (d 768, 12 layers,
   vocab 50304), one free + refill as ZeRO-3 did it before (``untyped_storage().resize_`` only)
   and as it does now (``free_param`` / ``allocate_param``: the resize plus a class swap), and the
   resulting host time per training step (each sharded parameter is freed and refilled twice per
   step: after its forward, before its backward).
2. The step: the same model trained at ZeRO-1 and ZeRO-3 on one process, one thread, by two
   partita trees (``--before`` and ``--after``, e.g. ``git archive`` exports of two commits),
   each run a fresh subprocess, interleaved round by round so drift of the shared machine lands
   on both alike. Prints the median step time of each and the ratios.

    python benchmarks/zero3_freed_overhead.py --before /tmp/before --after /tmp/after [--rounds 3] [--gpu]
    python benchmarks/zero3_freed_overhead.py --primitive-only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

GPT2_SMALL = {"vocab_size": 50304, "block_size": 1024, "n_layer": 12, "n_head": 12, "n_embd": 768}


def _engine(stage: int, *, batch: int = 1, bf16: bool = False):
    import torch

    import partita
    from partita.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(**GPT2_SMALL))
    cfg = {"train_micro_batch_size_per_gpu": batch, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
           "bf16": {"enabled": bf16}, "zero_optimization": {"stage": stage}, "steps_per_print": 10**6}
    engine, *_ = partita.initialize(model=model, config=cfg)
    return engine


def primitive() -> dict:
    """Per-parameter free + refill, old and new way, on the real parameters of a ZeRO-3 engine."""
    import torch

    from partita.zero.freed import ZERO3, allocate_param, free_param

    torch.set_num_threads(1)
    engine = _engine(3)
    gatherer = engine.zero.gatherer
    params = [p for p in engine.module.parameters() if gatherer.is_sharded_param(p)]
    gatherer.gather(params)  # whole: both loops start and end there

    def old_way() -> None:
        for p in params:
            p.data.untyped_storage().resize_(0)
        for p in params:
            p.data.untyped_storage().resize_(p.numel() * p.element_size())

    def new_way() -> None:
        for p in params:
            free_param(p, ZERO3)
        for p in params:
            allocate_param(p)

    def best_of(fns: dict) -> dict:
        best = {name: float("inf") for name in fns}
        for _ in range(7):
            for name, fn in fns.items():
                start = time.perf_counter()
                for _ in range(200):
                    fn()
                best[name] = min(best[name], (time.perf_counter() - start) / (200 * len(params)) * 1e6)
        return best

    real = best_of({"old": old_way, "new": new_way})  # allocation-bound: the difference is within its noise
    gatherer.release(params)
    # The same code on 1 KiB parameters: what the guard adds, without the allocator's noise.
    params = [torch.nn.Parameter(torch.zeros(256)) for _ in params]
    small = best_of({"old": old_way, "new": new_way})
    extra = small["new"] - small["old"]
    return {"sharded_params": len(params), "per_param_free_refill_us": real, "small_params_free_refill_us": small,
            "extra_per_step_us": 2 * extra * len(params)}  # freed and refilled twice per step


def step_worker(stage: int, steps: int, *, gpu: bool) -> dict:
    """CPU: micro-batch 1 x 32 tokens in fp32, one thread. GPU: micro-batch 32 x 1024 tokens in bf16
    (the guide's GPT-2 124M setting)."""
    import torch

    torch.set_num_threads(1 if not gpu else torch.get_num_threads())
    batch, seq = (32, 1024) if gpu else (1, 32)
    engine = _engine(stage, batch=batch, bf16=gpu)
    device = torch.device("cuda") if gpu else torch.device("cpu")
    g = torch.Generator().manual_seed(1)
    times = []
    for step in range(steps + 3):  # three warm-up steps
        x = torch.randint(0, GPT2_SMALL["vocab_size"], (batch, seq), generator=g).to(device)
        if gpu:
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss = engine(x, x)[1]
        engine.backward(loss)
        engine.step()
        if gpu:
            torch.cuda.synchronize()
        if step >= 3:
            times.append(time.perf_counter() - start)
    return {"stage": stage, "step_s": statistics.median(times)}


def _run_tree(tree: Path, stage: int, steps: int, gpu: bool) -> float:
    path = os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29600 + stage),
           "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
    if not gpu:
        env["OMP_NUM_THREADS"] = "1"
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", str(stage), "--steps", str(steps)]
    out = subprocess.run(command + (["--gpu"] if gpu else []), env=env, cwd=tree, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"the {tree} worker at stage {stage} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["step_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path)
    parser.add_argument("--after", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--primitive-only", action="store_true")
    parser.add_argument("--gpu", action="store_true", help="time the step on CUDA (micro-batch 32 x 1024, bf16)")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        print(json.dumps(step_worker(args.worker, args.steps, gpu=args.gpu)))
        return
    if args.primitive_only or args.before is None:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29610", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
                          LOCAL_WORLD_SIZE="1")
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        print(json.dumps(primitive(), indent=1))
        return
    args.before, args.after = args.before.resolve(), args.after.resolve()
    for tree in (args.before, args.after):
        if not (tree / "partita" / "__init__.py").is_file():
            parser.error(f"{tree} holds no partita tree (partita/__init__.py): export one with git archive")
    results: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for stage in (1, 3):
            for name, tree in (("before", args.before), ("after", args.after)):
                results.setdefault(f"{name} zero{stage}", []).append(_run_tree(tree, stage, args.steps, args.gpu))
    median = {k: statistics.median(v) for k, v in results.items()}
    report = {
        "runs_s": results,
        "median_step_s": median,
        "after/before zero3": median["after zero3"] / median["before zero3"],
        "zero3/zero1 before": median["before zero3"] / median["before zero1"],
        "zero3/zero1 after": median["after zero3"] / median["after zero1"],
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
