"""The attention commands of benchmarks/long_context.py: ``sparse`` (SparseSelfAttention patterns
against dense causal SDPA), ``kernels`` (ring attention's block kernels against SDPA on this
device) and ``sp-steps`` (Ulysses and ring sequence parallelism across gloo processes)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch

from _long_context_trial import _model_config, _sync


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
