"""GPU figures for the memory levers: activation-checkpointing policies and 8-bit optimizer states.

    python benchmarks/memory_levers_gpu.py --out results/memory_levers.json      # one GPU

1. Activation checkpointing on the reference 1.3 B GPT (d 2048, 24 layers, 16 heads, vocab
   50304, sequence 2048, micro-batch 8, bf16 weights, SDPA): for each policy, peak
   allocated memory and time of one forward + backward (no optimizer, so the figure is the
   activations' share), median over timed steps after warm-up.
2. Parity on the GPU: a small GPT with dropout 0.1 (fp32 and bf16; SDPA's fused kernels draw
   their dropout masks from the CUDA generator): gradients with each policy bitwise equal
   to the run without checkpointing.
3. 8-bit optimizer states on the same model through ``partita.initialize`` (one rank,
   ZeRO-1, bf16): device memory held by optimizer states after the first step, and the
   step time, AdamW vs AdamW8bit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import os
import sys
import time

import torch

from partita.activation_checkpointing import apply_activation_checkpointing, remove_activation_checkpointing
from partita.models import GPT, GPTConfig
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ is not a package
from output_paths import output_file  # noqa: E402

POLICIES = (
    ("none", {}),
    ("every", {"policy": "every"}),
    ("every_k=2", {"policy": "every_k", "k": 2}),
    ("selective", {"policy": "selective"}),
    ("every+cpu_offload", {"policy": "every", "cpu_offload": True}),
)
GIB = 2**30


def build(config: GPTConfig) -> GPT:
    torch.manual_seed(0)
    with torch.device("cuda"):
        return GPT(config).to(torch.bfloat16)


def time_policies(model: GPT, *, micro_batch: int, warmup: int, steps: int) -> list[dict]:
    seq = model.config.block_size
    x = torch.randint(0, model.config.vocab_size, (micro_batch, seq), device="cuda")
    rows = []
    for name, options in POLICIES:
        remove_activation_checkpointing(model)
        if options:
            apply_activation_checkpointing(model, **options)
        times = []
        for step in range(warmup + steps):
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            start = time.perf_counter()
            _, loss = model(x, x)
            loss.backward()
            torch.cuda.synchronize()
            if step >= warmup:
                times.append(time.perf_counter() - start)
        peak = torch.cuda.max_memory_allocated() - base
        median = statistics.median(times)
        rows.append({"policy": name, "peak_above_weights_gib": peak / GIB, "fwd_bwd_s": median,
                     "tokens_per_s": micro_batch * seq / median})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    remove_activation_checkpointing(model)
    return rows


def gpu_parity() -> list[dict]:
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = GPT(GPTConfig(n_layer=4, n_head=4, n_embd=256, block_size=256, dropout=0.1)).to(dtype)
        x = torch.randint(0, 256, (4, 256), device="cuda")

        def grads() -> dict[str, torch.Tensor]:
            model.zero_grad(set_to_none=True)
            torch.manual_seed(1)
            model(x, x)[1].backward()
            return {n: p.grad.clone() for n, p in model.named_parameters()}

        reference = grads()
        for name, options in POLICIES[1:]:
            apply_activation_checkpointing(model, **options)
            got = grads()
            remove_activation_checkpointing(model)
            equal = all(torch.equal(got[n], reference[n]) for n in reference)
            worst = max(float((got[n].float() - reference[n].float()).abs().max()) for n in reference)
            rows.append({"dtype": str(dtype), "policy": name, "bitwise_equal": equal, "max_abs_diff": worst})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def optimizer_states(config: GPTConfig, *, micro_batch: int, steps: int) -> list[dict]:
    import partita

    rows = []
    for kind in ("AdamW", "AdamW8bit"):
        model = build(config)
        apply_activation_checkpointing(model, policy="every")  # room for the states, same for both
        cfg = {
            "train_micro_batch_size_per_gpu": micro_batch,
            "optimizer": {"type": kind, "params": {"lr": 3e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}},
            "bf16": {"enabled": True},
            "zero_optimization": {"stage": 1},
            "steps_per_print": 10**9,
        }
        engine, optimizer, _, _ = partita.initialize(model=model, config=cfg)
        x = torch.randint(0, config.vocab_size, (micro_batch, config.block_size), device="cuda")
        times, losses = [], []
        for _ in range(steps):
            torch.cuda.synchronize()
            start = time.perf_counter()
            _, loss = engine(x, x)
            engine.backward(loss)
            engine.step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            losses.append(loss.item())
        state_bytes = sum(t.numel() * t.element_size() for s in optimizer.inner.state.values()
                          for t in s.values() if torch.is_tensor(t) and t.dim() > 0)  # fmt: skip
        params = sum(g.master.numel() for g in optimizer.groups)
        rows.append({"optimizer": kind, "params": params, "state_gib": state_bytes / GIB,
                     "state_bytes_per_param": state_bytes / params, "step_s": statistics.median(times[1:]),
                     "losses": losses})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
        del engine, optimizer, model
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=output_file, required=True)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--skip-optimizer", action="store_true")
    args = parser.parse_args(argv)
    config = GPTConfig.gpt_1_3b()
    parity = gpu_parity()
    model = build(config)
    result = {
        "parity": parity,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "model": "GPT 1.3B (d 2048, 24 layers, 16 heads, vocab 50304, seq 2048), bf16 weights",
        "micro_batch": args.micro_batch,
        "policies": time_policies(model, micro_batch=args.micro_batch, warmup=args.warmup, steps=args.steps),
    }
    del model
    torch.cuda.empty_cache()
    if not args.skip_optimizer:
        result["optimizer_states"] = optimizer_states(config, micro_batch=args.micro_batch, steps=args.steps + 1)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
