"""``engine.offload_states`` / ``reload_states`` on one GPU: the device memory freed and the time taken.

    python benchmarks/offload_states_gpu.py --model gpt_1_3b --stage 3 --out results.json

A reference GPT trains one step (bf16, AdamW: optimizer states, fp32 masters, gradients and 16-bit
weights all exist), then ``offload_states()`` moves every kind to pinned host memory and
``reload_states()`` brings them back; a second step checks training goes on. Memory is
``torch.cuda.memory_allocated()`` after a synchronize, before and after each call. The colocated-
rollout goal (issue 29): allocated memory after ``offload_states`` <= 5% of before.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from output_paths import output_file  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt_1_3b")
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--out", type=output_file, default=None)
    args = parser.parse_args()

    import torch

    import partita
    from partita.models.gpt import GPT, GPTConfig

    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29573", "RANK": "0", "LOCAL_RANK": "0",
                        "WORLD_SIZE": "1"}.items():
        os.environ.setdefault(name, value)
    torch.manual_seed(0)
    model = GPT(getattr(GPTConfig, args.model)())
    config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
              "zero_optimization": {"stage": args.stage}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    engine, *_ = partita.initialize(model=model, config=config)
    vocab = model.config.vocab_size
    x = torch.randint(0, vocab, (1, args.seq), device="cuda")

    def step() -> float:
        _, loss = engine(x, x)
        engine.backward(loss)
        engine.step()
        return float(loss)

    def allocated() -> int:
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()

    first = step()
    before = allocated()
    start = time.perf_counter()
    moved = engine.offload_states()
    after = allocated()
    offload_s = time.perf_counter() - start
    start = time.perf_counter()
    engine.reload_states()
    reloaded = allocated()
    reload_s = time.perf_counter() - start
    second = step()
    report = {"date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv), "model": args.model, "stage": args.stage,
              "parameters_b": round(sum(p.numel() for p in model.parameters()) / 1e9, 3),
              "allocated_before_gib": round(before / 2**30, 2), "allocated_after_offload_gib": round(after / 2**30, 2),
              "after_over_before": round(after / before, 4), "allocated_after_reload_gib": round(reloaded / 2**30, 2),
              "offload_s": round(offload_s, 2), "reload_s": round(reload_s, 2),
              "moved_gib": {str(getattr(k, "value", k)): round(v / 2**30, 2) for k, v in moved.items()}, "loss_step1": first, "loss_step2": second,
              "torch": torch.__version__}
    print(json.dumps(report), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
