"""ZeRO-3 data parallelism: every rank holds 1/N of the parameters, gradients and AdamW states,
and gathers each block's weights just before it runs.

    partita run --nproc 2 examples/zero3.py            # 2 CPU processes (gloo), or 2 GPUs
    partita run --nproc 2 examples/zero3.py --steps 50

A tiny byte-level GPT trains on the standard library's own source code (nothing is downloaded).
Each rank takes its half of every global batch; the printed loss is the global batch's mean.
Afterwards rank 0 trains the same model on the whole batches in one process with plain PyTorch
and prints whether the losses are equal (exit status 1 if they are not): sharding changes where
the states live, not the arithmetic. Guide: docs/guides/zero.md.
"""

from __future__ import annotations

import sys

import partita
from _shared import adamw_config, corpus_batches, exit_code, mean_over, parse_args, reference_losses, report, \
    snapshot, tiny_gpt


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(__doc__, argv)
    model = tiny_gpt()
    reference_model = snapshot(model) if args.check else None
    config = adamw_config(args.batch, zero_optimization={"stage": 3})
    engine, *_ = partita.initialize(model=model, config=config)
    topology = engine.topology
    micro = engine.train_micro_batch_size_per_gpu()  # batch / data ranks
    batches = corpus_batches(args.steps, args.batch)
    losses = []
    for batch in batches:
        rows = batch[topology.data_rank * micro:(topology.data_rank + 1) * micro].to(engine.device)
        _, loss = engine(rows[:, :-1], rows[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(mean_over(loss, topology.data_group))
    is_main = topology.rank == 0
    reference = reference_losses(reference_model, batches, engine.device) if args.check and is_main else None
    summary = report(f"ZeRO-3 over {topology.data_size} ranks", losses, reference, is_main=is_main)
    engine.destroy()
    return summary


if __name__ == "__main__":
    sys.exit(exit_code(main(sys.argv[1:])))
