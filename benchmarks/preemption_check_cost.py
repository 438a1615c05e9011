"""Cost of the preemption check: one 4-byte MAX all-reduce per optimizer step (partita/checkpoint/preemption.py).

Run: ``python benchmarks/preemption_check_cost.py`` (2 CPU gloo ranks). Prints the all-reduce time
next to the optimizer-step time of ``GPTConfig.tiny()`` (micro-batch 8 x 128 tokens) and of the
tiny test model (tests/tiny_models.py), both measured without the check (no save_dir).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.harness import run_distributed  # noqa: E402


def _timed(step, n: int) -> float:
    import torch.distributed as dist

    dist.barrier()
    started = time.perf_counter()
    for _ in range(n):
        step()
    dist.barrier()
    return (time.perf_counter() - started) / n


def _measure() -> dict[str, float]:
    import torch
    import torch.distributed as dist

    import partita
    from partita.models import GPT, GPTConfig
    from tests.tiny_models import build_model, make_batches, param_groups

    base = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 2},
            "steps_per_print": 10**6}
    rank = dist.get_rank() if dist.is_initialized() else int(__import__("os").environ["RANK"])
    torch.manual_seed(0)
    gpt, *_ = partita.initialize(model=GPT(GPTConfig.tiny()), config={**base, "train_micro_batch_size_per_gpu": 8})
    x, y = torch.randint(0, 256, (8, 128)), torch.randint(0, 256, (8, 128))

    def gpt_step() -> None:
        _, loss = gpt(x, y)
        gpt.backward(loss)
        gpt.step()

    tiny_model = build_model()
    tiny, *_ = partita.initialize(model=tiny_model, model_parameters=param_groups(tiny_model),
                                  config={**base, "train_batch_size": 8})
    xs, ys = make_batches(1, 8)
    micro = tiny.train_micro_batch_size_per_gpu()

    def tiny_step() -> None:
        tiny.backward(tiny(xs[0][rank * micro : (rank + 1) * micro], ys[0][rank * micro : (rank + 1) * micro]))
        tiny.step()

    flag = torch.zeros(1, dtype=torch.int32)

    def check() -> None:
        flag.fill_(0)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        bool(flag.item())

    for fn, n in ((gpt_step, 3), (tiny_step, 20), (check, 50)):  # warm-up
        for _ in range(n):
            fn()
    return {"gpt_tiny_step": _timed(gpt_step, 10), "tiny_step": _timed(tiny_step, 200), "check": _timed(check, 2000)}


if __name__ == "__main__":
    result = run_distributed(_measure, 2, timeout=900)[0]
    check = result["check"]
    print(f"check (4-byte MAX all-reduce + read): {check * 1e3:.3f} ms")
    for name in ("gpt_tiny_step", "tiny_step"):
        print(f"{name}: {result[name] * 1e3:.1f} ms per optimizer step; the check adds {100 * check / result[name]:.2f}%")
