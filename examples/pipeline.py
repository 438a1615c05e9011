"""Pipeline parallelism: the model is a list of layers cut into 2 stages, one per rank; each rank
builds only its own stage's layers, and micro-batches flow through the stages (1F1B schedule).

    partita run --nproc 2 examples/pipeline.py          # pipe 2 x data 1
    partita run --nproc 4 examples/pipeline.py          # pipe 2 x data 2

A tiny byte-level GPT written as DeepSpeed's ``PipelineModule`` (an embedding layer, two GPT
blocks, the final norm and the LM head) trains on the standard library's own source code:
every optimizer step is 4 micro-batches of 2 sequences through ``engine.train_batch``, which
returns the batch's mean loss on every stage. Afterwards rank 0 builds the same layers under the
same seeds in one process, trains them on the whole batches with plain PyTorch and prints whether
the losses are equal (exit status 1 if not). Guide: docs/guides/pipeline-parallelism.md.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

import partita
from _shared import SEQ, adamw_config, corpus_batches, exit_code, parse_args, reference_losses, report
from partita.models.gpt import Block, GPTConfig
from partita.pipe import LayerSpec, PipelineModule

CONFIG = GPTConfig(vocab_size=256, block_size=SEQ, n_layer=2, n_head=4, n_embd=32)
MICRO = 2
BASE_SEED = 1234  # seed_layers=True builds layer i under BASE_SEED + i, whatever the stage count


class Embed(nn.Module):
    """Token plus position embedding: the pipeline's first layer (one tensor in, one out)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.tokens = nn.Embedding(config.vocab_size, config.n_embd)
        self.positions = nn.Embedding(config.block_size, config.n_embd)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))


def next_byte_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def layers() -> list[LayerSpec]:
    return [LayerSpec(Embed, CONFIG), *[LayerSpec(Block, CONFIG) for _ in range(CONFIG.n_layer)],
            LayerSpec(nn.LayerNorm, CONFIG.n_embd), LayerSpec(nn.Linear, CONFIG.n_embd, CONFIG.vocab_size, bias=False)]


def single_process_model() -> nn.Sequential:
    """The pipeline's layers built in one process with the seeds the pipeline gives them."""
    built = []
    for index, spec in enumerate(layers()):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(BASE_SEED + index)
            built.append(spec.build())
    return nn.Sequential(*built)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(__doc__, argv)
    partita.init_distributed()  # which layers this rank builds depends on its rank
    model = PipelineModule(layers(), num_stages=2, loss_fn=next_byte_loss, seed_layers=True, base_seed=BASE_SEED,
                           partition_method="uniform")
    config = adamw_config(args.batch, train_micro_batch_size_per_gpu=MICRO, zero_optimization={"stage": 1})
    engine, *_ = partita.initialize(model=model, config=config)
    topology = engine.topology
    rows_per_rank = args.batch // topology.data_size
    batches = corpus_batches(args.steps, args.batch)
    losses = []
    for batch in batches:
        rows = batch[topology.data_rank * rows_per_rank:(topology.data_rank + 1) * rows_per_rank].to(engine.device)
        micro_batches = iter([(part[:, :-1], part[:, 1:]) for part in rows.split(MICRO)])
        losses.append(engine.train_batch(micro_batches).item())  # the mean over micro-batches and data ranks
    is_main = topology.rank == 0
    if is_main:
        print(f"pipeline: stage 0 holds layers {model.parts[0]}-{model.parts[1] - 1} of {len(layers())}", flush=True)
    reference = None
    if args.check and is_main:
        reference = reference_losses(single_process_model(), batches, engine.device,
                                     lambda m, x, y: next_byte_loss(m(x), y))
    summary = report(f"pipeline over {topology.pipe_size} stages (data {topology.data_size})", losses, reference,
                     is_main=is_main)
    engine.destroy()
    return summary


if __name__ == "__main__":
    sys.exit(exit_code(main(sys.argv[1:])))
