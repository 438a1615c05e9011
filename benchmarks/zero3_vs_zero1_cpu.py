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

    python benchmarks/zero3_vs_zero1_cpu.py --after . --before /tmp/before --rounds 5 \\
        --json benchmarks/results/zero3_one_rank_cpu_2026-12-04.json

The figures on the GPU come from benchmarks/gpu_throughput.py (see the report's command).
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


def _engine(stage: int, dtype: str, extra: dict):
    import torch

    import partita
    from partita.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(**SHAPE))
    zero = {"stage": stage, **extra}
    cfg = {"train_micro_batch_size_per_gpu": BATCH, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
           "bf16": {"enabled": dtype == "bf16"}, "zero_optimization": zero, "gradient_clipping": 1.0,
           "steps_per_print": 10**6}
    engine, *_ = partita.initialize(model=model, config=cfg)
    return engine


def _count_step(step) -> dict:
    """One step's Python calls into partita/zero/, its copies and allocations."""
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


def worker(stage: int, dtype: str, steps: int, extra: dict) -> dict:
    import torch

    torch.set_num_threads(1)
    engine = _engine(stage, dtype, extra)
    g = torch.Generator().manual_seed(1)

    def step() -> None:
        x = torch.randint(0, SHAPE["vocab_size"], (BATCH, SHAPE["block_size"]), generator=g)
        loss = engine(x, x)[1]
        engine.backward(loss)
        engine.step()

    for _ in range(3):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    counts = _count_step(step)
    step_s = statistics.median(times)
    return {"stage": stage, "dtype": dtype, "step_s": step_s, "tokens_per_s": BATCH * SHAPE["block_size"] / step_s,
            **counts}


def _run(tree: Path, stage: int, dtype: str, steps: int, extra: dict, port: int) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_WORLD_SIZE": "1", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", str(stage), "--dtype", dtype,
               "--steps", str(steps), "--zero-extra", json.dumps(extra)]
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
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="bf16", help=argparse.SUPPRESS)
    args = parser.parse_args()
    extra = json.loads(args.zero_extra)
    if args.worker is not None:
        print(json.dumps(worker(args.worker, args.dtype, args.steps, extra)))
        return
    trees = {"after": args.after.resolve()}
    if args.before is not None:
        trees = {"before": args.before.resolve(), **trees}
    for tree in trees.values():
        if not (tree / "partita" / "__init__.py").is_file():
            parser.error(f"{tree} holds no partita tree (partita/__init__.py): export one with git archive")
    runs: dict[str, list[dict]] = {}
    port = 29650
    for _ in range(args.rounds):
        for dtype in args.dtypes.split(","):
            for stage in (1, 3):
                for name, tree in trees.items():
                    port += 1
                    runs.setdefault(f"{name} zero{stage} {dtype}", []).append(
                        _run(tree, stage, dtype, args.steps, extra, port))
    summary = {}
    for key, results in runs.items():
        summary[key] = {"tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in results),
                        "tokens_per_s_runs": [round(r["tokens_per_s"]) for r in results],
                        **{k: results[-1][k] for k in ("partita_zero_calls", "copies", "copy_bytes", "allocated_bytes")}}
    ratios = {}
    for name in trees:
        for dtype in args.dtypes.split(","):
            z1, z3 = summary.get(f"{name} zero1 {dtype}"), summary.get(f"{name} zero3 {dtype}")
            if z1 and z3:
                ratios[f"{name} zero3/zero1 {dtype}"] = z3["tokens_per_s_median"] / z1["tokens_per_s_median"]
    report = {"shape": SHAPE, "micro_batch": BATCH, "zero_extra": extra, "rounds": args.rounds, "steps": args.steps,
              "trees": {k: str(v) for k, v in trees.items()}, "summary": summary, "ratios": ratios}
    text = json.dumps(report, indent=1)
    if args.json is not None:
        args.json.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
