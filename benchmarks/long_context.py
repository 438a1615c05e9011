"""Long-context benchmarks: longest trainable sequence, tokens/s, sparse attention, sequence parallelism.

    # One H200 (the figures of issue 16; not measured yet):
    python benchmarks/long_context.py search --model gpt-1.3b --systems torch,fsdp2,deepspeed,partita --out r.json
    python benchmarks/long_context.py search --model gpt-7b --systems torch,partita --start 16384 --out r7.json
    python benchmarks/long_context.py throughput --model gpt-1.3b --seqs 8192,32768,131072 --out t.json
    python benchmarks/long_context.py sparse --seqs 16384,65536 --out s.json
    python benchmarks/long_context.py kernels --seq 4096 --out k.json   # ring block kernels vs SDPA
    # CPU, tiny sizes (what CI-sized machines can run):
    python benchmarks/long_context.py search --device cpu --model tiny --start 128 --max-seq 1024
    python benchmarks/long_context.py sparse --device cpu --seqs 256,512 --heads 2 --head-dim 16
    python benchmarks/long_context.py sp-steps --device cpu --world 4 --seq 512

``search``: for each system, the longest sequence that trains one optimizer step at micro-batch 1
(bf16 on GPU, every block checkpointed, AdamW), doubling from ``--start`` and then halving the gap
down to ``--granularity``. Each attempt runs in a fresh subprocess, so an out-of-memory attempt
leaves nothing behind for the next. Systems: ``torch`` (what users run: fp32 weights, bf16
autocast, fused AdamW), ``fsdp2`` (``fully_shard`` on one rank, bf16 mixed precision), ``deepspeed`` (ZeRO-3, bf16; only if
installed), ``partita`` (ZeRO-3, bf16, plus ``--partita-config`` JSON merged in for the
long-context options). The reference GPT's learned position table grows with the sequence
(``block_size`` = the sequence); it is included in every system alike.

``throughput``: partita's tokens/s at each of ``--seqs`` (median step after warm-up).
``sparse``: forward + backward time of ``SparseSelfAttention`` (fixed, bigbird; FlexAttention,
compiled on CUDA) against dense causal SDPA at each length.
``sp-steps``: ``--world`` gloo processes train the tiny GPT with ``sequence_parallel_size`` =
world, Ulysses and ring; median step time each.
``kernels``: ring attention's fused block kernels checked against SDPA on this device.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
GIB = 2**30


def _model_config(name: str, seq: int):
    from partita.models.gpt import GPTConfig

    if name == "tiny":
        return GPTConfig(vocab_size=256, block_size=seq, n_layer=2, n_head=4, n_embd=64)
    shapes = {"gpt-1.3b": GPTConfig.gpt_1_3b(), "gpt-7b": GPTConfig.gpt_7b()}
    if name not in shapes:
        raise SystemExit(f"--model {name!r}: choose tiny, gpt-1.3b or gpt-7b")
    base = shapes[name]
    return GPTConfig(vocab_size=base.vocab_size, block_size=seq, n_layer=base.n_layer, n_head=base.n_head,
                     n_embd=base.n_embd)  # fmt: skip


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _peak_gib(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / GIB if device == "cuda" else None


def _single_rank_env() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)


def _build(system: str, model_name: str, seq: int, device: str, partita_config: dict):
    """(step function, cleanup) for one system: step() runs forward, backward and the optimizer once."""
    from partita.activation_checkpointing import apply_activation_checkpointing
    from partita.models.gpt import GPT

    torch.manual_seed(0)
    config = _model_config(model_name, seq)
    bf16 = device == "cuda"
    with torch.device(device):
        model = GPT(config)
    apply_activation_checkpointing(model, policy="every")
    x = torch.randint(0, config.vocab_size, (1, seq), device=device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    if system in ("torch", "fsdp2"):
        if system == "fsdp2":
            import torch.distributed as dist
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            _single_rank_env()
            dist.init_process_group("nccl" if device == "cuda" else "gloo")
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
            for block in model.blocks:
                fully_shard(block, **({"mp_policy": policy} if policy else {}))
            fully_shard(model, **({"mp_policy": policy} if policy else {}))
            autocast = contextlib.nullcontext()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")

        def step() -> float:
            with autocast:
                _, loss = model(x, x)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return float(loss)

        return step
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 3},
        "steps_per_print": 10**9,
        **({"bf16": {"enabled": True}} if bf16 else {}),
    }
    if system == "deepspeed":
        import deepspeed

        _single_rank_env()
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    elif system == "partita":
        import partita

        _single_rank_env()
        engine, *_ = partita.initialize(model=model, config={**cfg, **partita_config})
    else:
        raise SystemExit(f"unknown system {system!r}: choose torch, fsdp2, deepspeed or partita")

    def engine_step() -> float:
        _, loss = engine(x, x)
        engine.backward(loss)
        engine.step()
        return float(loss)

    return engine_step


def trial(args: argparse.Namespace) -> dict[str, Any]:
    """One attempt (run in its own process by ``search``): steps at one length, or the error."""
    device = args.device
    try:
        step = _build(args.system, args.model, args.seq, device, json.loads(args.partita_config))
        times = []
        for _ in range(args.steps):
            _sync(device)
            start = time.perf_counter()
            step()
            _sync(device)
            times.append(time.perf_counter() - start)
        median = statistics.median(times[1:] if len(times) > 1 else times)
        return {"ok": True, "seq": args.seq, "step_s": median, "tokens_per_s": args.seq / median,
                "peak_gib": _peak_gib(device)}  # fmt: skip
    except torch.OutOfMemoryError as error:
        return {"ok": False, "seq": args.seq, "error": f"out of memory: {str(error)[:200]}", "peak_gib": _peak_gib(device)}
    except RuntimeError as error:  # CPU allocators and NCCL report memory exhaustion as RuntimeError
        return {"ok": False, "seq": args.seq, "error": str(error)[:300]}


def _attempt(args: argparse.Namespace, system: str, seq: int, steps: int) -> dict[str, Any]:
    command = [sys.executable, os.path.abspath(__file__), "trial", "--system", system, "--seq", str(seq),
               "--model", args.model, "--device", args.device, "--steps", str(steps),
               "--partita-config", args.partita_config]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=args.trial_timeout)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return {"ok": False, "seq": seq, "error": f"exit {done.returncode}: {done.stderr[-400:]}"}
    return json.loads(lines[-1])


def search(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for system in args.systems.split(","):
        attempts, good, bad = [], None, None
        seq = args.start
        while seq <= args.max_seq:  # doubling until the first failure
            row = _attempt(args, system, seq, steps=2)
            attempts.append(row)
            print(json.dumps({"system": system, **row}), flush=True)
            if not row["ok"]:
                bad = seq
                break
            good, seq = seq, seq * 2
        while good is not None and bad is not None and bad - good > args.granularity:  # halve the gap
            mid = (good + bad) // 2 // args.granularity * args.granularity
            if mid in (good, bad):
                break
            row = _attempt(args, system, mid, steps=2)
            attempts.append(row)
            print(json.dumps({"system": system, **row}), flush=True)
            good, bad = (mid, bad) if row["ok"] else (good, mid)
        results[system] = {"longest_seq": good, "first_failure": bad, "attempts": attempts}
    return results


def throughput(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for seq in (int(s) for s in args.seqs.split(",")):
        row = _attempt(args, "partita", seq, steps=args.steps)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def sparse(args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch.nn.functional as F

    from partita.ops.sparse_attention import BigBirdSparsityConfig, FixedSparsityConfig, SparseSelfAttention

    device = args.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    rows = []
    for seq in (int(s) for s in args.seqs.split(",")):
        patterns = {
            "fixed": FixedSparsityConfig(num_heads=args.heads, block=args.block, attention="unidirectional"),
            "bigbird": BigBirdSparsityConfig(num_heads=args.heads, block=args.block, attention="unidirectional"),
        }
        layers: dict[str, Any] = {"dense_sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)}
        for name, pattern in patterns.items():
            layers[name] = SparseSelfAttention(pattern, max_seq_length=seq)
        for name, layer in layers.items():
            q, k, v = (torch.randn(1, args.heads, seq, args.head_dim, device=device, dtype=dtype, requires_grad=True)
                       for _ in range(3))  # fmt: skip
            times = []
            for _ in range(args.steps + 1):
                _sync(device)
                start = time.perf_counter()
                layer(q, k, v).sum().backward()
                _sync(device)
                times.append(time.perf_counter() - start)
            density = None if name == "dense_sdpa" else float(layer.layout(seq).float().mean())
            rows.append({"seq": seq, "attention": name, "fwd_bwd_ms": 1e3 * statistics.median(times[1:]),
                         "block_density": density})  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    return rows


def kernels(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Ring attention's block-kernel contract on this device, without a ring: keys and values cut in
    two blocks, each block's (out, lse) merged, then each block's backward given the merged out and
    lse; outputs and gradients against SDPA on the whole sequence. The GPU check for the fused CUDA
    kernels, which CPU CI cannot reach."""
    import torch.nn.functional as F

    from partita.sequence.block_kernels import pick_kernel
    from partita.sequence.ring import _merge

    device = args.device
    rows = []
    for dtype in (torch.float32, torch.bfloat16) if device == "cuda" else (torch.float32,):
        for prefer_math in (False, True):
            gen = torch.Generator(device=device).manual_seed(0)
            shape = (2, args.heads, args.seq, args.head_dim)
            q, k, v, dout = (torch.randn(shape, device=device, dtype=dtype, generator=gen) for _ in range(4))
            kernel = pick_kernel(q, prefer_math=prefer_math)
            scale = args.head_dim**-0.5
            half = args.seq // 2
            # Queries of the second half: causal against their own block, full against the first.
            q2 = q[:, :, half:].contiguous()
            blocks = [(k[:, :, :half].contiguous(), v[:, :, :half].contiguous(), False),
                      (k[:, :, half:].contiguous(), v[:, :, half:].contiguous(), True)]  # fmt: skip
            out = torch.zeros(q2.shape, device=device, dtype=torch.float32)
            lse = torch.full(q2.shape[:-1], float("-inf"), device=device)
            for kb, vb, causal in blocks:
                _merge(out, lse, *kernel.forward(q2, kb, vb, causal=causal, scale=scale))
            out = out.to(dtype)
            dq = torch.zeros(q2.shape, device=device, dtype=torch.float32)
            dkv = []
            for kb, vb, causal in blocks:
                g = kernel.backward(dout[:, :, half:].contiguous(), q2, kb, vb, out, lse, causal=causal, scale=scale)
                dq += g[0]
                dkv.append((g[1], g[2]))
            inputs = [t.clone().requires_grad_() for t in (q, k, v)]
            ref = F.scaled_dot_product_attention(*inputs, is_causal=True)
            ref.backward(torch.cat([torch.zeros_like(dout[:, :, :half]), dout[:, :, half:]], dim=2))
            ref_dk, ref_dv = inputs[1].grad, inputs[2].grad
            err = {
                "out": float((out.float() - ref.detach()[:, :, half:].float()).abs().max()),
                "dq": float((dq - inputs[0].grad[:, :, half:].float()).abs().max()),
                "dk": float((torch.cat([dkv[0][0], dkv[1][0]], 2).float() - ref_dk.float()).abs().max()),
                "dv": float((torch.cat([dkv[0][1], dkv[1][1]], 2).float() - ref_dv.float()).abs().max()),
            }
            rows.append({"dtype": str(dtype), "kernel": kernel.name, "max_abs_error": err})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def _sp_worker(rank: int, world: int, port: int, seq: int, steps: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))  # fmt: skip
    torch.set_num_threads(1)
    import torch.distributed as dist

    import partita
    from partita.models.gpt import GPT

    out = {}
    for mode in ("ulysses", "ring"):
        torch.manual_seed(0)
        model = GPT(_model_config("tiny", seq))
        cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
               "sequence_parallel_size": world, "sequence_parallel": {"mode": mode}, "steps_per_print": 10**9}  # fmt: skip
        engine, *_ = partita.initialize(model=model, config=cfg)
        x = torch.randint(0, 256, (1, seq), generator=torch.Generator().manual_seed(1))
        times = []
        for _ in range(steps + 1):
            dist.barrier()
            start = time.perf_counter()
            _, loss = engine(x, x)
            engine.backward(loss)
            engine.step()
            times.append(time.perf_counter() - start)
        out[mode] = {"step_ms": 1e3 * statistics.median(times[1:]), "loss": float(loss.detach())}
    queue.put((rank, out))
    dist.destroy_process_group()


def sp_steps(args: argparse.Namespace) -> dict[str, Any]:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_sp_worker, args=(r, args.world, port, args.seq, args.steps, queue)) for r in range(args.world)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=args.trial_timeout) for _ in procs)
    for p in procs:
        p.join()
    row = {"world": args.world, "seq": args.seq, "model": "tiny (2 layers, 4 heads, d 64)", **results[0]}
    print(json.dumps(row), flush=True)
    return row


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("search", "throughput", "sparse", "sp-steps", "kernels", "trial"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    parser.add_argument("--model", default="gpt-1.3b", help="tiny, gpt-1.3b or gpt-7b")
    parser.add_argument("--systems", default="torch,fsdp2,deepspeed,partita")
    parser.add_argument("--system", default="partita", help="(trial) the one system to run")
    parser.add_argument("--seq", type=int, default=2048, help="(trial, sp-steps) the sequence length")
    parser.add_argument("--seqs", default="8192,32768,131072", help="(throughput, sparse) lengths to time")
    parser.add_argument("--start", type=int, default=32768)
    parser.add_argument("--max-seq", type=int, default=2**21)
    parser.add_argument("--granularity", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--partita-config", default="{}", help="JSON merged into partita's config (search, throughput)")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block", type=int, default=128, help="(sparse) block size of the patterns")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--trial-timeout", type=float, default=1800)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.what == "trial":
        print(json.dumps(trial(args)), flush=True)
        return
    run = {"search": search, "throughput": throughput, "sparse": sparse, "sp-steps": sp_steps, "kernels": kernels}[args.what]
    result = {"what": args.what, "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "torch": torch.__version__, "model": args.model, "result": run(args)}  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
