"""ZeRO-1 against ZeRO-3 at one rank on CPU: tokens/s and what each step does beyond the math.

A small GPT (d_model 256, 4 layers, 4 heads, vocabulary 4096, sequence 256, micro-batch 4),
one process, one thread, AdamW, trained at ZeRO-1 and ZeRO-3 by one or two partita trees
(``--before`` / ``--after``: e.g. a ``git archive`` export of an older commit and this tree). Each
(tree, stage, dtype) run is a fresh subprocess; runs alternate round by round so the drift of a
shared machine lands on all alike. Reported per run: the median step time over ``--steps`` steps
after 3 warm-ups, tokens/s, and for one steady-state step (counted in a separate, untimed step):

- ``partita_zero_calls``: Python function calls into ``partita/zero/`` (hooks, gathers, releases);
- ``copies`` / ``copy_bytes``: ``aten::copy_`` calls and the bytes they wrote (torch.profiler);
- ``allocated_bytes``: bytes of tensor storage created during the step (profiler memory timeline).

    python benchmarks/zero3_vs_zero1_cpu.py --after . --before /tmp/before --resident --rounds 5 \\
        --json benchmarks/results/zero3_one_rank_cpu_2026-12-04.json

``--gpu`` runs GPT-2 124M on one CUDA device (micro-batch 32 x 1024, bf16, 10 steps after 3 warm-ups):

    python benchmarks/zero3_vs_zero1_cpu.py --gpu --dtypes bf16 --steps 10 --rounds 3 --resident \\
        --before /tmp/before --json benchmarks/results/zero3_one_rank_h200.json
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

SHAPE = {"vocab_size": 4096, "block_size": 256, "n_layer": 4, "n_head": 4, "n_embd": 256}
BATCH = 4
# --gpu: GPT-2 124M (vocabulary 50304), micro-batch 32 x 1024 tokens, bf16, as benchmarks/zero3_freed_overhead.py --gpu.
GPU_SHAPE = {"vocab_size": 50304, "block_size": 1024, "n_layer": 12, "n_head": 12, "n_embd": 768}
GPU_BATCH = 32


def _engine(stage: int, dtype: str, extra: dict, *, gpu: bool = False):
    import torch

    import partita
    from partita.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(**(GPU_SHAPE if gpu else SHAPE)))
    if gpu:
        model = model.cuda()
    zero = {"stage": stage, **extra}
    cfg = {"train_micro_batch_size_per_gpu": GPU_BATCH if gpu else BATCH, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
           "bf16": {"enabled": dtype == "bf16"}, "zero_optimization": zero, "gradient_clipping": 1.0,
           "steps_per_print": 10**6}
    engine, *_ = partita.initialize(model=model, config=cfg)
    return engine


def _count_step(step, *, gpu: bool = False) -> dict:
    """One step's Python calls into partita/zero/, its copies and allocations (CPU only)."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action, MemoryProfile

    zero_dir = os.sep + os.path.join("partita", "zero") + os.sep
    calls = [0]

    def tracer(frame, event, arg):
        if event == "call" and zero_dir in frame.f_code.co_filename:
            calls[0] += 1

    sys.setprofile(tracer)
    try:
        step()
    finally:
        sys.setprofile(None)
    if gpu:
        return {"partita_zero_calls": calls[0], "copies": None, "copy_bytes": None, "allocated_bytes": None}
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        step()
    copies = copy_bytes = 0
    for event in prof.events():
        if event.name == "aten::copy_" and event.input_shapes and event.input_shapes[0]:
            copies += 1
            numel = 1
            for n in event.input_shapes[0]:
                numel *= n
            copy_bytes += numel * _itemsize(event.input_dtypes[0] if event.input_dtypes else "float")
    timeline = MemoryProfile(prof.profiler.kineto_results).timeline
    allocated = sum(size for _, action, _, size in timeline if action is Action.CREATE)
    return {"partita_zero_calls": calls[0], "copies": copies, "copy_bytes": copy_bytes, "allocated_bytes": allocated}


def _itemsize(name: str) -> int:
    return {"c10::BFloat16": 2, "c10::Half": 2, "float": 4, "double": 8, "long int": 8, "int": 4, "bool": 1}.get(name, 4)


def worker(stage: int, dtype: str, steps: int, extra: dict, *, gpu: bool = False) -> dict:
    import torch

    if not gpu:
        torch.set_num_threads(1)
    shape, batch = (GPU_SHAPE, GPU_BATCH) if gpu else (SHAPE, BATCH)
    engine = _engine(stage, dtype, extra, gpu=gpu)
    g = torch.Generator().manual_seed(1)
    sync = torch.cuda.synchronize if gpu else (lambda: None)

    def step() -> None:
        x = torch.randint(0, shape["vocab_size"], (batch, shape["block_size"]), generator=g)
        if gpu:
            x = x.cuda()
        loss = engine(x, x)[1]
        engine.backward(loss)
        engine.step()

    for _ in range(3):
        step()
    times = []
    for _ in range(steps):
        sync()
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    counts = _count_step(step, gpu=gpu)
    step_s = statistics.median(times)
    return {"stage": stage, "dtype": dtype, "step_s": step_s, "tokens_per_s": batch * shape["block_size"] / step_s,
            **counts}


def _run(tree: Path, stage: int, dtype: str, steps: int, extra: dict, port: int, gpu: bool) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_WORLD_SIZE": "1", **({} if gpu else {"OMP_NUM_THREADS": "1"})}
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", str(stage), "--dtype", dtype,
               "--steps", str(steps), "--zero-extra", json.dumps(extra)] + (["--gpu"] if gpu else [])
    out = subprocess.run(command, env=env, cwd=tree, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"the {tree} worker (stage {stage}, {dtype}) failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--after", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--before", type=Path, default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--dtypes", default="bf16,fp32")
    parser.add_argument("--zero-extra", default="{}", help="JSON merged into zero_optimization (both stages)")
    parser.add_argument("--resident", action="store_true",
                        help="also run the --after tree's ZeRO-3 with stage3_one_rank_resident (row 'resident zero3')")
    parser.add_argument("--gpu", action="store_true", help="GPT-2 124M on CUDA, micro-batch 32 x 1024, bf16 (--dtypes bf16)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="bf16", help=argparse.SUPPRESS)
    args = parser.parse_args()
    extra = json.loads(args.zero_extra)
    if args.worker is not None:
        print(json.dumps(worker(args.worker, args.dtype, args.steps, extra, gpu=args.gpu)))
        return
    trees = {"after": args.after.resolve()}
    if args.before is not None:
        trees = {"before": args.before.resolve(), **trees}
    for tree in trees.values():
        if not (tree / "partita" / "__init__.py").is_file():
            parser.error(f"{tree} holds no partita tree (partita/__init__.py): export one with git archive")
    jobs = [(name, tree, stage, extra) for stage in (1, 3) for name, tree in trees.items()]
    if args.resident:
        jobs.append(("resident", trees["after"], 3, {**extra, "stage3_one_rank_resident": True}))
    runs: dict[str, list[dict]] = {}
    port = 29650
    for _ in range(args.rounds):
        for dtype in args.dtypes.split(","):
            for name, tree, stage, job_extra in jobs:
                port += 1
                runs.setdefault(f"{name} zero{stage} {dtype}", []).append(
                    _run(tree, stage, dtype, args.steps, job_extra, port, args.gpu))
    summary = {}
    for key, results in runs.items():
        summary[key] = {"tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in results),
                        "tokens_per_s_runs": [round(r["tokens_per_s"]) for r in results],
                        **{k: results[-1][k] for k in ("partita_zero_calls", "copies", "copy_bytes", "allocated_bytes")}}
    ratios = {}
    for name in [*trees, "resident"]:
        for dtype in args.dtypes.split(","):
            z1 = summary.get(f"{'after' if name == 'resident' else name} zero1 {dtype}")
            z3 = summary.get(f"{name} zero3 {dtype}")
            if z1 and z3:
                ratios[f"{name} zero3/zero1 {dtype}"] = z3["tokens_per_s_median"] / z1["tokens_per_s_median"]
    report = {"shape": GPU_SHAPE if args.gpu else SHAPE, "micro_batch": GPU_BATCH if args.gpu else BATCH,
              "device": "cuda" if args.gpu else "cpu", "zero_extra": extra, "rounds": args.rounds, "steps": args.steps,
              "trees": {k: str(v) for k, v in trees.items()}, "summary": summary, "ratios": ratios}
    text = json.dumps(report, indent=1)
    if args.json is not None:
        args.json.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
