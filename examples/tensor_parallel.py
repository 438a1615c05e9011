"""Tensor parallelism: each layer of the model is split over 2 ranks (Megatron's layout: attention
heads and MLP columns per rank, the vocabulary split in the embedding and the loss).

    partita run --nproc 2 examples/tensor_parallel.py   # tensor 2 x data 1 on 2 processes
    partita run --nproc 4 examples/tensor_parallel.py   # tensor 2 x data 2, ZeRO-1 over the data axis

A tiny byte-level GPT trains on the standard library's own source code. Both tensor ranks of a
data rank read the same rows (that is the rule: the layer halves need the same tokens); each
holds half of every weight. Afterwards rank 0 trains the unsplit model on the whole batches in
one process with plain PyTorch and prints whether the losses are equal (exit status 1 if not).
Guide: docs/guides/tensor-parallelism.md.
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
    whole = sum(p.numel() for p in model.parameters())
    config = adamw_config(args.batch, tensor_parallel={"autotp_size": 2}, zero_optimization={"stage": 1})
    engine, *_ = partita.initialize(model=model, config=config)
    topology = engine.topology
    weights = sum(p.numel() for p in engine.module.parameters())
    micro = engine.train_micro_batch_size_per_gpu()  # batch / data ranks (tensor ranks share rows)
    batches = corpus_batches(args.steps, args.batch)
    losses = []
    for batch in batches:
        rows = batch[topology.data_rank * micro:(topology.data_rank + 1) * micro].to(engine.device)
        _, loss = engine(rows[:, :-1], rows[:, 1:])  # the vocabulary-parallel loss: the same on both tensor ranks
        engine.backward(loss)
        engine.step()
        losses.append(mean_over(loss, topology.data_group))
    is_main = topology.rank == 0
    if is_main:
        print(f"tensor parallel: {weights:,} of the model's {whole:,} weights on this rank", flush=True)
    reference = reference_losses(reference_model, batches, engine.device) if args.check and is_main else None
    summary = report(f"tensor parallel over {topology.tensor_size} ranks (data {topology.data_size})", losses,
                     reference, is_main=is_main)
    summary["weights_on_rank"] = weights
    engine.destroy()
    return summary


if __name__ == "__main__":
    sys.exit(exit_code(main(sys.argv[1:])))
