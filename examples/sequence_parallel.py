"""Sequence parallelism: every sequence is split over 2 ranks, so each rank holds the activations
of half its tokens (DeepSpeed-Ulysses by default; ``--mode ring`` for ring attention).

    partita run --nproc 2 examples/sequence_parallel.py
    partita run --nproc 2 examples/sequence_parallel.py --mode ring

A tiny byte-level GPT trains on the standard library's own source code. Both ranks of the
sequence group read the same whole sequences; the engine cuts each rank's slice of the tokens
(and their positions), and the loss is the exact mean over all the group's tokens. Afterwards
rank 0 trains the same model on the whole sequences in one process with plain PyTorch and
prints whether the losses are equal (exit status 1 if not). Guide:
docs/guides/sequence-parallelism.md.
"""

from __future__ import annotations

import sys

import partita
from _shared import adamw_config, corpus_batches, exit_code, mean_over, parse_args, reference_losses, report, \
    snapshot, tiny_gpt


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(__doc__, argv, more=lambda parser: parser.add_argument(
        "--mode", choices=("ulysses", "ring"), default="ulysses", help="sequence_parallel.mode"))
    mode = args.mode
    model = tiny_gpt()
    reference_model = snapshot(model) if args.check else None
    config = adamw_config(args.batch, sequence_parallel_size=2, sequence_parallel={"mode": mode},
                          zero_optimization={"stage": 2})
    engine, *_ = partita.initialize(model=model, config=config)
    topology = engine.topology
    micro = engine.train_micro_batch_size_per_gpu()  # batch / data ranks (sequence ranks share samples)
    batches = corpus_batches(args.steps, args.batch)
    losses = []
    for batch in batches:
        rows = batch[topology.data_rank * micro:(topology.data_rank + 1) * micro].to(engine.device)
        _, loss = engine(rows[:, :-1], rows[:, 1:])  # whole sequences in; the engine cuts this rank's slice
        engine.backward(loss)
        engine.step()
        losses.append(mean_over(loss, topology.data_group))
    is_main = topology.rank == 0
    reference = reference_losses(reference_model, batches, engine.device) if args.check and is_main else None
    summary = report(f"sequence parallel ({mode}) over {topology.sequence_size} ranks", losses, reference,
                     is_main=is_main)
    engine.destroy()
    return summary


if __name__ == "__main__":
    sys.exit(exit_code(main(sys.argv[1:])))
