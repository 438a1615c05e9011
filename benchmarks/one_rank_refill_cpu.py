"""Host cost of the one-rank weight freeing (partita/zero/one_rank_weights.py): free + refill of
every block of a 24-layer GPT, timed on CPU, where small-batch GPU steps are bound by the host.

    python benchmarks/one_rank_refill_cpu.py [--layers 24] [--repeats 5] [--rounds 50]

Prints the best per-block time over the repeats (one thread, so it is the Python and dispatch
cost, not the copy's bandwidth).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import partita  # noqa: E402
from partita.models.gpt import GPT, GPTConfig  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=args.layers, n_head=2, n_embd=32))
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "bf16": {"enabled": True}, "zero_optimization": {"stage": 2}, "steps_per_print": 10**6}
    engine, *_ = partita.initialize(model=model, config=cfg)
    weights = engine.zero.one_rank_weights
    units = list(weights._units)
    best = float("inf")
    for _ in range(args.repeats):
        start = time.perf_counter()
        for _ in range(args.rounds):
            for unit in units:
                weights._free(unit)
                weights._refill(unit)
        best = min(best, (time.perf_counter() - start) / (args.rounds * len(units)))
    print(f"free + refill: {best * 1e6:.1f} us per block ({len(weights._units[units[0]])} parameters each, "
          f"{len(units)} blocks)")


if __name__ == "__main__":
    main()
