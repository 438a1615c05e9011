"""MoE layer speed: partita's MoE (capacity mode and dropless grouped-GEMM mode) against
DeepSpeed's MoE in the same run, forward + backward of one layer at ep_size 1.

On a GPU (the issue's figure, d_model 2048, top-2, 8 or 64 experts, 2048-token sequences):

    python benchmarks/moe_layer.py --d-model 2048 --ffn 8192 --experts 8 --tokens 16384 --dtype bf16
    python benchmarks/moe_layer.py --d-model 2048 --ffn 8192 --experts 64 --tokens 16384 --dtype bf16

On a CPU at a tiny size (what CI-sized machines can run; figures mean little there):

    python benchmarks/moe_layer.py --d-model 64 --ffn 128 --experts 4 --tokens 256 --steps 3

Prints one line per engine and mode: tokens/s, peak memory (GPU only), and the ratio to
DeepSpeed's same mode. DeepSpeed's layer needs torch.distributed (a one-process group is
started here) and its expert groups (``set_deepspeed_parallelism``); when DeepSpeed is missing
or refuses, its rows say why and the partita rows still print. Not measured yet on a GPU. For the whole MoE GPT on one GPU see benchmarks/moe_gpu.py.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _expert(d_model: int, ffn: int) -> nn.Module:
    return nn.Sequential(nn.Linear(d_model, ffn), nn.GELU(), nn.Linear(ffn, d_model))


def _partita_layer(args, drop_tokens: bool) -> nn.Module:
    from partita.moe.layer import MoE

    return MoE(args.d_model, _expert(args.d_model, args.ffn), num_experts=args.experts, k=2,
               capacity_factor=args.capacity_factor, drop_tokens=drop_tokens, use_rts=False)


def _deepspeed_layer(args, drop_tokens: bool) -> nn.Module:
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    layer = DeepSpeedMoE(args.d_model, _expert(args.d_model, args.ffn), num_experts=args.experts, ep_size=1, k=2,
                         capacity_factor=args.capacity_factor, drop_tokens=drop_tokens, use_rts=False)
    layer.set_deepspeed_parallelism()
    return layer


def _measure(layer: nn.Module, args, device: torch.device, dtype: torch.dtype) -> tuple[float, float | None]:
    layer = layer.to(device=device, dtype=dtype)
    x = torch.randn(args.tokens // args.seq, args.seq, args.d_model, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)

    def step() -> None:
        out, l_aux, _ = layer(x)
        (out.float() * grad.float()).sum().add(l_aux.float()).backward()
        layer.zero_grad(set_to_none=True)
        x.grad = None

    for _ in range(args.warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    begin = time.perf_counter()
    for _ in range(args.steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - begin
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return args.tokens * args.steps / seconds, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--ffn", type=int, default=128)
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=256, help="tokens per step (batch x seq)")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--capacity-factor", type=float, default=1.25)
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="fp32")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    if args.tokens % args.seq:
        parser.error(f"--tokens {args.tokens} must be a multiple of --seq {args.seq}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = _DTYPES[args.dtype]
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    try:  # DeepSpeed's layer asks deepspeed.comm, which adopts the group started above
        import deepspeed

        deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
    except ImportError:
        pass  # its rows say why
    print(f"# MoE layer, {device}, {args.dtype}: d_model {args.d_model}, ffn {args.ffn}, {args.experts} experts, "
          f"top-2, {args.tokens} tokens/step, capacity factor {args.capacity_factor}")
    results: dict[tuple[str, str], tuple[float, float | None] | str] = {}
    for mode, drop in (("capacity", True), ("dropless", False)):
        for engine, build in (("deepspeed", _deepspeed_layer), ("partita", _partita_layer)):
            torch.manual_seed(0)
            try:
                results[(engine, mode)] = _measure(build(args, drop), args, device, dtype)
            except Exception as error:  # noqa: BLE001 - a peer that cannot run is reported, not fatal
                results[(engine, mode)] = f"unavailable: {type(error).__name__}: {error}"[:200]
    for (engine, mode), value in results.items():
        if isinstance(value, str):
            print(f"{engine:9s} {mode:8s} {value}")
            continue
        tokens_s, peak = value
        peer = results.get(("deepspeed", mode))
        ratio = f" ({tokens_s / peer[0]:.2f}x deepspeed {mode})" if engine == "partita" and isinstance(peer, tuple) else ""
        memory = f", peak {peak:.2f} GiB" if peak is not None else ""
        print(f"{engine:9s} {mode:8s} {tokens_s:,.0f} tokens/s{memory}{ratio}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
