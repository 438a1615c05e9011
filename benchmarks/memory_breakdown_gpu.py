"""Where the bytes are at the memory peak: partita ZeRO 1/2/3 and FSDP2 on one GPU, by category.

Issue 17 item 1. For each engine setting, in a fresh process (so one setting's cached blocks do
not shape the next one's peak), the reference GPT is built once and trained with AdamW (fused),
clipping 1.0 and bf16, as in the throughput suite (benchmarks/_suite_worker.py):

1. one warm-up step, then ``--steps`` timed steps: tokens/s and ``torch.cuda.max_memory_allocated``;
2. one more step under ``torch.cuda.memory._record_memory_history``: the allocator's trace is
   replayed to the moment its allocated bytes peak, and every block alive then is put in a
   category: blocks that existed before the recording by the tensor they hold (the engine's
   parameters, fp32 master, optimizer states; FSDP2's sharded parameters and states), blocks
   allocated during the step by the Python frames that allocated them (partita's gradient
   partition, ZeRO-3 gathers, reduce buckets, the step's temporaries; FSDP2's all-gathers and
   reduce-scatters; the model's activations and loss; autograd's gradients).

partita rows also carry the estimator's peak (``partita estimate``) for the same setup.

    python benchmarks/memory_breakdown_gpu.py --json $OUT/breakdown.json
    python benchmarks/memory_breakdown_gpu.py --model gpt_7b --micro-batch 1 --checkpoint \\
        --engines partita3,fsdp2 --json $OUT/breakdown_7b.json
    python benchmarks/memory_breakdown_gpu.py --engines partita2-kept,partita2,partita1 --steps 6
    python benchmarks/memory_breakdown_gpu.py --tiny        # CPU: the same logic, no GPU

``partitaN-kept`` runs stage N with ``zero_optimization.one_rank_free_weights`` off (the whole
bf16 replica kept, as before that key), for an A/B of it in one run. ``partitaN-early``,
``partitaN-end`` and ``partitaN-stream`` fix ``zero_optimization.one_rank_gradient_fold`` (plain
``partitaN``: "auto"):

    python benchmarks/memory_breakdown_gpu.py --micro-batch 2 --engines partita2-early,partita2-end,fsdp2

``--tiny`` runs a small GPT on CPU over gloo (fp32, no snapshot: CPU has no allocator trace) and
checks the peak replay on a synthetic trace, so the script's logic is exercised without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ is not a package
from output_paths import output_file  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30

# Python frames (innermost first) -> category of a block allocated during the recorded step.
# The first rule that matches any frame, walking outwards from the allocation, wins.
FRAME_RULES: tuple[tuple[str, str, str], ...] = (
    # (file substring, function substring, category)
    ("partita/zero/shard_group.py", "", "fp32 gradient partition"),
    ("partita/zero/param_gatherer.py", "", "ZeRO-3 gathered parameters"),
    ("partita/zero/one_rank_weights.py", "", "bf16 block parameters cast back for backward"),
    ("partita/offload/param_offload.py", "", "ZeRO-3 gathered parameters"),
    ("partita/zero/reducer.py", "", "gradient reduce buckets"),
    ("partita/zero/sharded_optimizer.py", "", "step: norm / clip / write-back temporaries"),
    ("torch/optim/", "", "optimizer step temporaries"),
    ("torch/nn/utils/clip_grad", "", "clipping temporaries"),
    ("_fsdp_collectives", "all_gather", "FSDP2 unsharded parameters (all-gather)"),
    ("_fsdp_collectives", "reduce", "FSDP2 gradients (reduce-scatter, fp32)"),
    ("torch/distributed/fsdp", "", "FSDP2 other"),
    ("torch/nn/functional.py", "cross_entropy", "activations: loss (fp32 log-probabilities)"),
    ("partita/models/gpt.py", "", "activations (model forward)"),
    ("torch/utils/checkpoint.py", "", "activations (recomputed)"),
    ("partita/activation_checkpointing", "", "activations (recomputed)"),
    ("torch/autograd/", "backward", "backward: gradients and autograd temporaries"),
    ("torch/_tensor.py", "backward", "backward: gradients and autograd temporaries"),
)


def categorize(frames: list[dict] | None) -> str:
    """The category of one allocation from its Python frames (None: allocated before recording)."""
    if frames is None:
        return "before recording: other"
    for needle, function, category in FRAME_RULES:
        for frame in frames:
            if needle in frame.get("filename", "") and function in frame.get("name", ""):
                return category
    first = next((f for f in frames if f.get("filename", "").endswith(".py")), None)
    return "other: " + (f"{Path(first['filename']).name}:{first['name']}" if first else "no Python frame")


def live_at_peak(snapshot: dict, device: int = 0) -> tuple[int, dict[int, tuple[int, list | None]]]:
    """Replay the allocator trace to the moment allocated bytes peak; return that total and the
    blocks alive then (address -> (size, allocation frames or None if allocated before recording))."""
    end: dict[int, tuple[int, list | None]] = {}
    for segment in snapshot["segments"]:
        if segment.get("device", device) != device:
            continue
        for block in segment["blocks"]:
            if block["state"] == "active_allocated":
                end[block["address"]] = (block["size"], None)
    trace = snapshot["device_traces"][device]
    start = dict(end)
    for event in reversed(trace):  # undo the trace: what was alive when recording started
        if event["action"] == "alloc":
            start.pop(event["addr"], None)
        elif event["action"] == "free_completed":
            start[event["addr"]] = (event["size"], None)
    live = dict(start)
    total = peak = sum(size for size, _ in live.values())
    peak_index = -1
    for index, event in enumerate(trace):
        if event["action"] == "alloc":
            live[event["addr"]] = (event["size"], event.get("frames", []))
            total += event["size"]
            if total > peak:
                peak, peak_index = total, index
        elif event["action"] == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])[0]
    live = dict(start)
    for event in trace[: peak_index + 1]:
        if event["action"] == "alloc":
            live[event["addr"]] = (event["size"], event.get("frames", []))
        elif event["action"] == "free_completed":
            live.pop(event["addr"], None)
    return peak, live


def breakdown(live: dict[int, tuple[int, list | None]], known: list[tuple[int, int, str]]) -> dict[str, int]:
    """Bytes per category of the blocks alive at the peak. ``known``: (data_ptr, nbytes, category)
    of the tensors that live across steps, which name the blocks allocated before recording."""
    known = sorted(known)
    out: dict[str, int] = {}
    for address, (size, frames) in live.items():
        category = categorize(frames) if frames is not None else None
        if category is None:
            category = "before recording: other"
            for ptr, nbytes, name in known:  # a block holding (the start of) a known tensor
                if address <= ptr < address + size:
                    category = name
                    break
        out[category] = out.get(category, 0) + size
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _tensor_entry(t, name: str) -> tuple[int, int, str] | None:
    if t is None or t.untyped_storage().nbytes() == 0:
        return None
    return (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes(), name)


def known_tensors(family: str, model, engine_or_opt) -> list[tuple[int, int, str]]:
    """The tensors that live across steps, by category, for naming pre-existing blocks."""
    import torch

    out = []
    if family == "partita":
        opt = engine_or_opt.optimizer
        for group in opt.groups:
            out.append(_tensor_entry(group.master, "fp32 master weights"))
        for state in opt.inner.state.values():
            out += [_tensor_entry(v, "optimizer states (exp_avg, exp_avg_sq)") for v in state.values() if torch.is_tensor(v)]
        for p in model.parameters():
            out.append(_tensor_entry(p.data, f"{p.dtype} parameters (whole)".replace("torch.", "")))
    else:
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p.data
            out.append(_tensor_entry(local, f"{local.dtype} sharded parameters".replace("torch.", "")))
        for state in engine_or_opt.state.values():
            for v in state.values():
                if torch.is_tensor(v):
                    v = v.to_local() if hasattr(v, "to_local") else v
                    out.append(_tensor_entry(v, "optimizer states (exp_avg, exp_avg_sq)"))
    return [e for e in out if e is not None]


# ----------------------------------------------------------------------------- one setting
def run_setting(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from partita.models.gpt import GPT, GPTConfig

    cuda = not args.tiny
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32) if args.tiny \
        else getattr(GPTConfig, args.model)()
    with torch.device(device):
        model = GPT(config)
    if args.checkpoint:
        from partita.activation_checkpointing import apply_activation_checkpointing

        apply_activation_checkpointing(model, policy="every")
    adamw = {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
    family = "fsdp2" if args.worker == "fsdp2" else "partita"
    predicted = None
    if family == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        kwargs = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} if cuda else {}
        for block in model.blocks:
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
        opt = torch.optim.AdamW(model.parameters(), fused=cuda, **{**adamw, "betas": tuple(adamw["betas"])})
        handle = opt

        def train_step(x, y):
            loss = model(x, y)[1]
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss
    else:
        import partita
        from partita.estimate import GPTShape, Setup, estimate_memory

        # "partitaN-kept": stage N with zero_optimization.one_rank_free_weights off (the whole bf16
        # replica kept through forward and backward, as before it existed).
        # "partitaN-early" / "-end" / "-stream": one_rank_gradient_fold fixed (plain: "auto", decided by the estimate).
        name, kept = args.worker.removesuffix("-kept"), args.worker.endswith("-kept")
        fold = next((f for f in ("early", "end", "stream") if name.endswith("-" + f)), "auto")
        name = name.removesuffix("-" + fold)
        stage = int(name.removeprefix("partita"))
        cfg = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
               "gradient_clipping": 1.0, "steps_per_print": 10**6,
               "optimizer": {"type": "AdamW", "params": adamw},
               "zero_optimization": {"stage": stage, "reduce_bucket_size": 500_000_000,
                                     "allgather_bucket_size": 500_000_000, "one_rank_free_weights": not kept,
                                     "one_rank_gradient_fold": fold}}
        if cuda:
            cfg["bf16"] = {"enabled": True}
        shape = GPTShape(d_model=config.n_embd, n_layers=config.n_layer, n_heads=config.n_head, vocab=config.vocab_size,
                         seq_len=config.block_size, bias=config.bias, dropout=config.dropout)
        if fold == "auto":  # the rule initialize will choose, so the prediction is of what runs
            from partita.config import load_config
            from partita.zero.fold_choice import resolve_gradient_fold

            decided = resolve_gradient_fold(load_config(cfg), model, [{"params": list(model.parameters())}], world_size=1)
            cfg["zero_optimization"]["one_rank_gradient_fold"] = decided.zero_optimization.one_rank_gradient_fold
        estimate = estimate_memory(shape, Setup.from_config(cfg, world_size=1), micro_batch=args.micro_batch,
                                   **({"checkpointing": "every"} if args.checkpoint else {}))
        predicted = {"peak_gib": estimate.peak_accelerator / GIB, "peak_phase": estimate.peak("accelerator")[1],
                     "lines": [[l.category, l.item, l.nbytes / GIB, sorted(l.phases)] for l in estimate.lines
                               if l.device == "accelerator"]}
        engine, _, _, _ = partita.initialize(model=model, config=cfg)
        handle = engine

        def train_step(x, y):
            loss = engine(x, y)[1]
            engine.backward(loss)
            engine.step()
            return loss

    seq, micro = config.block_size, args.micro_batch
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randint(0, config.vocab_size, (micro, seq), device=device, generator=gen)
    y = torch.randint(0, config.vocab_size, (micro, seq), device=device, generator=gen)
    train_step(x, y)  # warm-up (also records the ZeRO-3 trace)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = train_step(x, y)
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    result: dict[str, Any] = {
        "setting": args.worker, "model": "tiny" if args.tiny else args.model, "micro_batch": micro, "seq": seq,
        "checkpoint": args.checkpoint, "tokens_per_s": args.steps * micro * seq / elapsed,
        "step_ms": 1000 * elapsed / args.steps, "loss": float(loss), "predicted": predicted,
    }
    if cuda:
        result["peak_gib"] = torch.cuda.max_memory_allocated() / GIB
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
        train_step(x, y)
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        peak, live = live_at_peak(snapshot)
        result["recorded_step_peak_gib"] = torch.cuda.max_memory_allocated() / GIB
        result["replayed_peak_gib"] = peak / GIB
        parts = breakdown(live, known_tensors(family, model, handle))
        result["at_peak_gib"] = {k: round(v / GIB, 3) for k, v in parts.items()}
    dist.destroy_process_group()
    return result


# ----------------------------------------------------------------------------- driver
def _self_check() -> None:
    """The peak replay on a synthetic trace (CPU has no allocator trace): a block alive before
    recording, one allocated and freed before the peak, two alive at it."""
    frames = lambda f, n: [{"filename": f, "name": n, "line": 1}]  # noqa: E731
    snapshot = {
        "segments": [{"device": 0, "blocks": [{"address": 0, "size": 100, "state": "active_allocated"},
                                               {"address": 300, "size": 10, "state": "active_allocated"}]}],
        "device_traces": [[
            {"action": "alloc", "addr": 100, "size": 50, "frames": frames("partita/models/gpt.py", "forward")},
            {"action": "alloc", "addr": 200, "size": 70, "frames": frames("partita/zero/shard_group.py", "_write_on_device")},
            {"action": "free_completed", "addr": 100, "size": 50},
            {"action": "free_completed", "addr": 200, "size": 70},
            {"action": "alloc", "addr": 300, "size": 10, "frames": frames("x.py", "f")},
        ]],
    }
    peak, live = live_at_peak(snapshot)
    parts = breakdown(live, [(0, 100, "fp32 master weights")])
    want = {"fp32 master weights": 100, "fp32 gradient partition": 70, "activations (model forward)": 50}
    if peak != 220 or parts != want:
        raise SystemExit(f"peak replay self-check failed: peak {peak}, categories {parts}, wanted 220 and {want}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt_1_3b")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--engines", default="partita1,partita2,partita3,fsdp2")
    parser.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up step")
    parser.add_argument("--checkpoint", action="store_true", help="checkpoint every block (all engines)")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke mode: tiny GPT, gloo, no snapshot")
    parser.add_argument("--json", type=output_file, help="write every setting's result here")
    parser.add_argument("--timeout", type=int, default=240, help="seconds per setting")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tiny:
        args.micro_batch = 2
    if args.worker:
        print("RESULT " + json.dumps(run_setting(args)), flush=True)
        return
    if args.tiny:
        _self_check()
    results = []
    for port, setting in enumerate(args.engines.split(",")):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29600 + port + os.getpid() % 300),
               "PYTHONPATH": os.environ.get("PYTHONPATH", str(REPO))}
        command = [sys.executable, __file__, "--worker", setting, "--model", args.model,
                   "--micro-batch", str(args.micro_batch), "--steps", str(args.steps)]
        command += ["--checkpoint"] * args.checkpoint + ["--tiny"] * args.tiny
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            results.append({"setting": setting, "status": f"timed out after {args.timeout} s"})
            continue
        lines = [l for l in done.stdout.splitlines() if l.startswith("RESULT ")]
        if done.returncode != 0 or not lines:
            results.append({"setting": setting, "status": f"failed ({done.returncode})", "stderr": done.stderr[-3000:]})
            print(f"{setting}: failed\n{done.stderr[-3000:]}", flush=True)
            continue
        result = json.loads(lines[-1][len("RESULT "):])
        results.append(result)
        peak = result.get("peak_gib")
        print(f"{setting}: {result['tokens_per_s']:,.0f} tokens/s, step {result['step_ms']:.1f} ms"
              + (f", peak {peak:.2f} GiB (replayed {result['replayed_peak_gib']:.2f})" if peak else "")
              + (f", estimated {result['predicted']['peak_gib']:.2f} GiB at {result['predicted']['peak_phase']}"
                 if result.get("predicted") else ""), flush=True)
        for category, gib in result.get("at_peak_gib", {}).items():
            print(f"    {gib:8.3f} GiB  {category}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
