"""Expert parallelism: a mixture-of-experts GPT whose 4 experts per MoE block are spread over 2
ranks (2 each); tokens travel to their experts' rank and back by all-to-all.

    partita run --nproc 2 examples/expert_parallel.py

A tiny byte-level GPT (its second block's MLP is 4 experts, top-2 routing, dropless) trains on the
standard library's own source code; each rank takes its half of every global batch. Afterwards
rank 0 builds the same model with all experts in one process, trains it on the whole batches
with plain PyTorch and prints whether the losses are equal (exit status 1 if not). Two settings
make that comparison exact rather than statistical, and a real run would keep the defaults:
routing without the Gumbel noise DeepSpeed adds to the second choice (each process draws it for
its own tokens, so two ranks pick other second experts than one process), and no load-balancing
loss (a product of per-rank means, as DeepSpeed's, so not the whole batch's). Guide:
docs/guides/expert-parallelism.md.
"""

from __future__ import annotations

import sys

import partita
from _shared import adamw_config, corpus_batches, exit_code, mean_over, parse_args, reference_losses, report, \
    tiny_gpt

MOE = dict(moe_every=2, moe_experts=4, moe_top_k=2, moe_drop_tokens=False, moe_aux_loss_coef=0.0)


def moe_gpt(ep_size: int):
    """The same initial weights whatever ``ep_size`` (experts are built by global index)."""
    model = tiny_gpt(**MOE, moe_ep_size=ep_size)
    for block in model.blocks:
        if hasattr(block.mlp, "moe"):
            block.mlp.moe.top2_2nd_expert_sampling = False  # deterministic routing: see the module doc
    return model


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(__doc__, argv)
    model = moe_gpt(ep_size=2)
    config = adamw_config(args.batch, zero_optimization={"stage": 2})
    engine, *_ = partita.initialize(model=model, config=config)
    topology = engine.topology
    moe = next(b.mlp.moe for b in engine.module.blocks if hasattr(b.mlp, "moe"))
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
    if is_main:
        print(f"expert parallel: rank 0 holds experts {list(moe.local_expert_indices)} of {moe.num_experts}", flush=True)
    reference = reference_losses(moe_gpt(ep_size=1), batches, engine.device) if args.check and is_main else None
    summary = report(f"expert parallel over {topology.data_size} ranks", losses, reference, is_main=is_main)
    summary["local_experts"] = list(moe.local_expert_indices)
    engine.destroy()
    return summary


if __name__ == "__main__":
    sys.exit(exit_code(main(sys.argv[1:])))
