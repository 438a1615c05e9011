"""GPU throughput of the reference GPT: partita ZeRO 0/1/2/3 against plain torch (DDP on
several GPUs), torch FSDP2 (fully_shard per block) and DeepSpeed.

Each engine runs in its own torchrun job (fresh process, fresh CUDA memory), on the same
model, data and optimizer settings: bf16, AdamW (torch's fused kernel for every engine),
gradient clipping 1.0, micro-batch 8, no gradient accumulation.

"-off" offloads the optimizer to CPU memory ("partita2-off", "deepspeed2-off"); "-offd" adds
partita's one-step-delayed update ("partita2-offd").

A trailing "c" compiles each transformer block with torch.compile (inductor): "partita2c" /
"partita3c" through partita's "compile" config section, "torchc" and "fsdp2c" by wrapping each
block in torch.compile before DDP / fully_shard (torchtitan's recipe). Compilation happens in the
warm-up steps, outside the timed region.

    python benchmarks/gpu_throughput.py --model gpt_1_3b --nproc 1 \
        --engines torch,fsdp2,partita0,partita1,partita2,deepspeed1,deepspeed2 --json results.json

Prints tokens/s, MFU (against 989 dense bf16 TFLOP/s), mean step time and peak memory.
DeepSpeed is a benchmark-only dependency (install 0.19.8 into the benchmark environment).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PEAK_TFLOPS = 989.0


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(REPO))
    from partita.models.gpt import GPT, GPTConfig

    engine_name = args.engine
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)
    gpt_cfg = getattr(GPTConfig, args.model)()
    with torch.device(device):
        model = GPT(gpt_cfg)
    seq, micro = gpt_cfg.block_size, args.micro_batch
    # Counted before any engine shards the parameters (DeepSpeed ZeRO-3 empties them in place).
    flops_per_token, num_params = model.flops_per_token(seq_len=seq), model.num_parameters()
    base_cfg = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "gradient_clipping": 1.0,
        "steps_per_print": 10**6,
    }
    adamw = {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}

    # "-off": optimizer states offloaded to CPU memory; "-offd": with partita's delayed update.
    engine_name, marker, offload_flag = engine_name.partition("-off")
    if offload_flag not in ("", "d"):
        raise SystemExit(f"unknown offload suffix -off{offload_flag} (use -off or -offd)")
    offload = ("delayed" if offload_flag == "d" else "cpu") if marker else None
    compiled = engine_name.endswith("c")  # "torchc", "fsdp2c", "partita3c": torch.compile per block
    base_name = engine_name[:-1] if compiled else engine_name

    def compile_blocks_in_place() -> None:
        # Plain torch / FSDP2: each block becomes its own compiled region; hooks added afterwards
        # (fully_shard's) sit on the wrapper, outside the compiled code.
        for index, block in enumerate(model.blocks):
            model.blocks[index] = torch.compile(block)

    if base_name == "torch":
        if compiled:
            compile_blocks_in_place()
        dist.init_process_group("nccl")
        opt = torch.optim.AdamW(model.parameters(), fused=True, **{**adamw, "betas": tuple(adamw["betas"])})
        # One GPU: plain torch. Several: DDP, the plain-torch way to data-parallel.
        wrapped = model
        if dist.get_world_size() > 1:
            wrapped = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])

        def train_step(x, y):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                _, loss = wrapped(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss
    elif base_name == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if compiled:
            compile_blocks_in_place()
        dist.init_process_group("nccl")
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        opt = torch.optim.AdamW(model.parameters(), fused=True, **{**adamw, "betas": tuple(adamw["betas"])})

        def train_step(x, y):
            _, loss = model(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss
    elif base_name.startswith("partita"):
        import partita

        cfg = {**base_cfg, "optimizer": {"type": "AdamW", "params": adamw},
               "zero_optimization": {"stage": int(base_name[-1]), "reduce_bucket_size": args.bucket,
                                     "allgather_bucket_size": args.bucket}}
        if compiled:
            cfg["compile"] = {"enabled": True, "backend": "inductor"}
        if offload:
            cfg["zero_optimization"]["offload_optimizer"] = {
                "device": "cpu", "pin_memory": True, "delayed_param_update": offload == "delayed"}
        engine, _, _, _ = partita.initialize(model=model, config=cfg)

        def train_step(x, y):
            _, loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            return loss
    elif engine_name.startswith("deepspeed") and not compiled:
        import deepspeed

        deepspeed.init_distributed("nccl")
        cfg = {**base_cfg, "optimizer": {"type": "AdamW", "params": {**adamw, "torch_adam": True, "fused": True}},
               "zero_optimization": {"stage": int(engine_name[-1]), "reduce_bucket_size": args.bucket,
                                     "allgather_bucket_size": args.bucket, "overlap_comm": True}}
        if offload:
            # DeepSpeed's offload steps with its own AVX CPU Adam (JIT-built), not torch's.
            cfg["optimizer"]["params"] = dict(adamw)
            cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)

        def train_step(x, y):
            _, loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            return loss
    else:
        raise SystemExit(f"unknown engine {engine_name}")

    gen = torch.Generator(device=device).manual_seed(1 + dist.get_rank())
    x = torch.randint(0, gpt_cfg.vocab_size, (micro, seq), device=device, generator=gen)
    y = torch.randint(0, gpt_cfg.vocab_size, (micro, seq), device=device, generator=gen)
    for _ in range(args.warmup):
        train_step(x, y)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = train_step(x, y)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30], device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        world = dist.get_world_size()
        tokens = args.steps * micro * seq * world
        tps = tokens / elapsed
        result = {
            "engine": args.engine, "model": args.model, "world": world, "micro_batch": micro, "seq": seq,
            "tokens_per_s": tps, "tokens_per_s_per_gpu": tps / world, "step_ms": 1000 * elapsed / args.steps,
            "mfu": tps / world * flops_per_token / (PEAK_TFLOPS * 1e12), "peak_gib": float(peak),
            "final_loss": float(loss), "params": num_params,
        }
        print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt_1_3b")
    parser.add_argument("--engines", default="torch,fsdp2,partita0,partita1,partita2,deepspeed1,deepspeed2")
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--bucket", type=int, default=500_000_000)
    parser.add_argument("--json", default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--engine", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return
    results = []
    for engine in args.engines.split(","):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
               __file__, "--worker", f"--engine={engine}", f"--model={args.model}",
               f"--micro-batch={args.micro_batch}", f"--steps={args.steps}", f"--warmup={args.warmup}",
               f"--bucket={args.bucket}"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            print(f"{engine}: FAILED (exit {proc.returncode})\n{proc.stderr[-3000:]}", flush=True)
            results.append({"engine": engine, "error": proc.stderr[-1500:]})
            continue
        result = json.loads(lines[-1][len("RESULT "):])
        results.append(result)
        print(f"{engine:>11}: {result['tokens_per_s_per_gpu'] / 1e3:7.1f}k tokens/s/GPU  "
              f"MFU {100 * result['mfu']:5.1f}%  step {result['step_ms']:7.1f} ms  "
              f"peak {result['peak_gib']:6.1f} GiB  loss {result['final_loss']:.3f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
