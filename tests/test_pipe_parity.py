"""Pipeline parallelism (partita/pipe) equals single-process torch on the same global batch.

The model is a tiny GPT-like LayerSpec stack: a TiedLayerSpec embedding, residual tanh blocks,
a LayerNorm, and the LM head tied to the embedding (``forward_fn``: ``x @ embedding.weight.T``),
so the tied gradient crosses the first and last stages. The oracle builds the same layers under
the same seeds (``seed_layers``: layer i under ``base_seed + i``), runs the whole global batch,
``clip_grad_norm_`` over every parameter (the tied one once) and torch AdamW. Clipping is active
in every step, so a gradient norm missing a stage (or counting the tie twice) fails.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.harness import run_distributed

VOCAB, DIM, SEQ, MICRO = 11, 8, 5, 2
N_BLOCKS = 4
STEPS = 2
LR, CLIP, BASE_SEED = 1e-2, 0.05, 1234


class Block(nn.Module):
    calls = 0  # forwards run in this process (activation checkpointing runs each one again in backward)

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        Block.calls += 1
        return x + torch.tanh(self.linear(x))


def lm_head(embedding: nn.Embedding, x: torch.Tensor) -> torch.Tensor:
    return x @ embedding.weight.t()


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def layer_specs():
    from partita.pipe import LayerSpec, TiedLayerSpec

    return ([TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM)]
            + [LayerSpec(Block, DIM) for _ in range(N_BLOCKS)]
            + [LayerSpec(nn.LayerNorm, DIM), TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM, forward_fn=lm_head)])


def global_batches(micro_batches: int, data: int) -> tuple[torch.Tensor, torch.Tensor]:
    """STEPS global batches of ids and next-token labels: [STEPS, data * micro_batches * MICRO, SEQ]."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (STEPS, data * micro_batches * MICRO, SEQ + 1), generator=g)
    return ids[..., :-1], ids[..., 1:]


def build_like_the_pipeline(specs: list) -> dict:
    """Each spec built with the seed PipelineModule(seed_layers=True) gives it (BASE_SEED + its
    index), a tied spec once under its key: the single-process copy of the pipeline's layers."""
    built = {}
    for i, spec in enumerate(specs):
        key = getattr(spec, "key", None)
        if key is not None and key in built:
            continue
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(BASE_SEED + i)
            built[key if key is not None else i] = spec.build()
    return built


def reference(micro_batches: int, data: int) -> dict:
    """Single-process torch: the same layers and seeds, the whole global batch per step."""
    torch.manual_seed(0)
    built = build_like_the_pipeline(layer_specs())
    embed = built["embed"]
    blocks = [built[i] for i in range(1, N_BLOCKS + 2)]
    params = [p for m in [embed, *blocks] for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    xs, ys = global_batches(micro_batches, data)
    losses = []
    for step in range(STEPS):
        h = embed(xs[step])
        for block in blocks:
            h = block(h)
        loss = lm_loss(lm_head(embed, h), ys[step])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():  # what eval_batch on global batch 0 must give after training
        h = embed(xs[0])
        for block in blocks:
            h = block(h)
        eval_loss = lm_loss(lm_head(embed, h), ys[0]).item()
    state = {"tied_modules.embed.weight": embed.weight.detach().clone()}
    for i, block in enumerate(blocks, start=1):
        for name, value in block.state_dict().items():
            state[f"{i}.{name}"] = value.clone()
    return {"losses": losses, "state": state, "eval": eval_loss}


def _config(micro_batches: int, schedule: str, stage: int, checkpoint_interval: int = 0,
            pipeline: dict | None = None) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": micro_batches,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}},
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 50},
        "pipeline": {"schedule": schedule, "activation_checkpoint_interval": checkpoint_interval, **(pipeline or {})},
        "steps_per_print": 1000,
    }


def train_pipeline(runs: list[dict]) -> list[dict]:
    """Every rank: one pipeline training run per entry, in one process group."""
    import torch.distributed as dist

    import partita
    from partita.pipe import PipelineModule

    partita.init_distributed()
    out = []
    for run in runs:
        m, stages, virtual = run["micro_batches"], run["stages"], run.get("virtual_stages", 1)
        model = PipelineModule(layer_specs(), num_stages=stages, loss_fn=lm_loss, partition_method="uniform",
                               seed_layers=True, base_seed=BASE_SEED, virtual_stages=virtual)
        engine, *_ = partita.initialize(model=model, config=_config(m, run["schedule"], run["zero_stage"],
                                                                    run.get("checkpoint_interval", 0), run.get("pipeline")))
        calls_before = Block.calls
        data, data_rank = engine.topology.data_size, engine.topology.data_rank
        xs, ys = global_batches(m, data)
        losses = []
        for step in range(STEPS):
            micro = [(xs[step][(data_rank * m + k) * MICRO:][:MICRO], ys[step][(data_rank * m + k) * MICRO:][:MICRO])
                     for k in range(m)]
            losses.append(engine.train_batch(iter(micro)).item())
            if step == 0:
                first = micro
        eval_loss = engine.eval_batch(iter(first)).item()
        out.append({"losses": losses, "eval": eval_loss, "block_calls": Block.calls - calls_before, "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
                    "first": engine.is_first_stage(), "last": engine.is_last_stage(), "rank": dist.get_rank(),
                    "parts": list(model.parts)})
    return out


def _check(results: list[list[dict]], runs: list[dict]) -> None:
    for r, run in enumerate(runs):
        expected = reference(run["micro_batches"], len(results) // run["stages"])
        merged: dict[str, torch.Tensor] = {}
        for rank_results in results:
            got = rank_results[r]
            # The loss of the batch, the same on every stage and data rank.
            assert got["losses"] == pytest.approx(expected["losses"], rel=1e-5), (run, got["rank"])
            assert got["eval"] == pytest.approx(expected["eval"], rel=1e-5), (run, got["rank"])
            for key, value in got["state"].items():
                if key in merged:  # a tied weight on two stages, or a data-parallel replica: identical
                    torch.testing.assert_close(value, merged[key], rtol=0, atol=0)
                merged[key] = value
        assert sorted(merged) == sorted(expected["state"]), run
        for key, value in expected["state"].items():
            torch.testing.assert_close(merged[key], value, rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{run} {k}: {m}")


def test_pipe_2_every_schedule_matches_torch() -> None:
    runs = [
        {"stages": 2, "micro_batches": 2, "schedule": "gpipe", "zero_stage": 0},
        # pipeline.activation_checkpoint_interval: runs of 2 layers recomputed in backward.
        {"stages": 2, "micro_batches": 2, "schedule": "gpipe", "zero_stage": 0, "checkpoint_interval": 2},
        {"stages": 2, "micro_batches": 3, "schedule": "1f1b", "zero_stage": 1},
        {"stages": 2, "micro_batches": 4, "schedule": "interleaved_1f1b", "zero_stage": 0, "virtual_stages": 2},
        # Weight gradients outside autograd's hooks (torch's backward_weight): reduced after the schedule all the same.
        {"stages": 2, "micro_batches": 2, "schedule": "zero_bubble", "zero_stage": 1, "virtual_stages": 2},
        # Zero bubble with one chunk per rank (ZB-H1), torch's split ...
        {"stages": 2, "micro_batches": 4, "schedule": "zero_bubble", "zero_stage": 0},
        # ... and with W the deferred nn.Linear weight gradients, under activation checkpointing (I recomputes
        # the layers, W still gets their GEMMs).
        {"stages": 2, "micro_batches": 4, "schedule": "zero_bubble", "zero_stage": 0, "checkpoint_interval": 2,
         "pipeline": {"zero_bubble_weight_split": "linear"}},
    ]
    results = run_distributed(train_pipeline, 2, runs)
    assert [(r[0]["first"], r[0]["last"]) for r in results] == [(True, False), (False, True)]
    assert results[0][0]["parts"] == [0, 4, 7]  # uniform: 7 layers, the extra one on stage 0
    assert results[0][3]["parts"] == [0, 2, 4, 6, 7]  # 2 stages x 2 chunks: rank 0 holds parts 0 and 2
    # Checkpointed: every block forward of the two training steps runs once more in backward (blocks
    # x micro-batches x steps), plus on torch 2.13 one recompute on stage 1, whose backward-metadata
    # inference differentiates its input through the checkpoint once.
    extra = [r[1]["block_calls"] - r[0]["block_calls"] for r in results]
    assert extra[0] == 3 * 2 * STEPS and 1 * 2 * STEPS <= extra[1] <= 1 * 2 * STEPS + 1, extra
    _check(results, runs)


def test_pipe_2_by_data_2_and_pipe_4_match_torch() -> None:
    runs = [
        {"stages": 2, "micro_batches": 2, "schedule": "1f1b", "zero_stage": 1},
        {"stages": 2, "micro_batches": 2, "schedule": "gpipe", "zero_stage": 0},
        # pipe 4 (world 4): the tie spans stages 0 and 3, two middle stages in between.
        {"stages": 4, "micro_batches": 4, "schedule": "1f1b", "zero_stage": 0},
    ]
    results = run_distributed(train_pipeline, 4, runs)
    assert [r[0]["first"] for r in results] == [True, True, False, False]  # pipe is the outermost axis
    assert [(r[2]["first"], r[2]["last"]) for r in results] == [(True, False), (False, False), (False, False), (False, True)]
    _check(results, runs)
