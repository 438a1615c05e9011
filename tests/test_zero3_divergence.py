"""ZeRO-3 with rank-divergent control flow: every rank raises a clear error, nothing hangs.

Before partita checked, a rank running an extra block (``if rank == 0: self.extra(h)``) sent
its all-gather for that block where the other rank gathered the next block: same-sized
blocks silently swapped parameters, then the gradient reduction waited until the collective
timeout (``distributed.timeout_seconds``, 30 minutes by default). These runs use a 20 s
collective timeout: a missed detection fails them as a CollectiveError, not as a hang.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests.harness import run_distributed
from tests.tiny_models import VOCAB, WIDTH, Block, make_batches, param_groups

LR, CLIP, STEPS, GLOBAL_BATCH, WORLD = 1e-2, 0.5, 3, 8, 2


class BranchyNet(nn.Module):
    """Three blocks and an extra block (all ZeRO-3 units); which ranks run the extra block
    after blocks.0, or skip blocks.2, is set per step."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([Block(), Block(), Block()])
        self.extra = nn.ModuleList([Block()])
        self.head = nn.Linear(WIDTH, VOCAB)
        self.step, self.rank = 0, 0
        self.extra_on: dict[int, set[int]] = {}  # step -> ranks that run the extra block
        self.skip_last_on: dict[int, set[int]] = {}  # step -> ranks that skip blocks.2

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx)
        for i, block in enumerate(self.blocks):
            if i == 2 and self.rank in self.skip_last_on.get(self.step, ()):
                continue
            h = block(h)
            if i == 0 and self.rank in self.extra_on.get(self.step, ()):
                h = self.extra[0](h)
        return F.cross_entropy(self.head(h).reshape(-1, VOCAB), targets.reshape(-1))


def _build(extra_on: dict, skip_last_on: dict) -> BranchyNet:
    torch.manual_seed(0)
    model = BranchyNet()
    model.extra_on, model.skip_last_on = extra_on, skip_last_on
    return model


def _train(extra_on: dict, skip_last_on: dict, stage: int = 3) -> dict:
    import torch.distributed as dist

    import partita
    from partita.zero.unit_sync import RankDivergenceError

    model = _build(extra_on, skip_last_on)
    cfg = {
        "train_batch_size": GLOBAL_BATCH,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.1}},
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "distributed": {"timeout_seconds": 20},
        "steps_per_print": 1000,
    }
    engine, _, _, _ = partita.initialize(model=model, model_parameters=param_groups(model), config=cfg)
    model.rank = rank = dist.get_rank()
    micro = GLOBAL_BATCH // WORLD
    xs, ys = make_batches(STEPS, GLOBAL_BATCH)
    try:
        for step in range(STEPS):
            model.step = step
            engine.backward(engine(xs[step][rank * micro : (rank + 1) * micro], ys[step][rank * micro : (rank + 1) * micro]))
            engine.step()
    except RankDivergenceError as error:
        return {"error": str(error), "step": step}
    gatherer = engine.zero.gatherer
    return {"params": engine.get_fp32_state_dict(rank0_only=False), "trace": gatherer and gatherer.trace.state.value}


SCENARIOS = {
    "first step, rank 0 runs an extra block": ({0: {0}}, {}),
    "third step, rank 0 runs an extra block": ({2: {0}}, {}),
    "third step, rank 1 skips the last block": ({}, {2: {1}}),
    "third step, every rank runs the extra block": ({2: {0, 1}}, {}),
}


def run_scenarios() -> dict:
    # One after another in the same processes: a detected divergence leaves the process group usable.
    out = {name: _train(*plan) for name, plan in SCENARIOS.items()}
    out["stage 2, every rank runs the extra block"] = _train(*SCENARIOS["third step, every rank runs the extra block"], 2)
    return out


def _reference(extra_on_every_rank: set[int]) -> dict[str, torch.Tensor]:
    """Single-process torch on the whole batch, running the extra block at the given steps."""
    model = _build({}, {})
    groups = [{**g, "params": [p for p in g["params"] if p.requires_grad]} for g in param_groups(model)]
    opt = torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.999), eps=1e-8)
    model.extra_on = {step: {0} for step in extra_on_every_rank}
    xs, ys = make_batches(STEPS, GLOBAL_BATCH)
    for step in range(STEPS):
        model.step = step
        opt.zero_grad()
        model(xs[step], ys[step]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _what_each_rank_did(message: str) -> list[str]:
    return [line.strip() for line in message.splitlines() if line.startswith("  rank")]


def test_rank_divergent_units_raise_on_every_rank_instead_of_hanging() -> None:
    per_rank = run_distributed(run_scenarios, WORLD, timeout=150)
    expected = {
        # Recording the first step: every on-demand gather is checked first.
        "first step, rank 0 runs an extra block": (0, [
            "rank 0: gathers the parameters of 'extra.0' (Block) for its forward",
            "rank 1: gathers the parameters of 'blocks.1' (Block) for its forward",
        ]),
        # Trace ready: rank 0 leaves it at event 3 (start root, start b0, end b0, start b1 ...),
        # issues the gathers rank 1 still issues, and both meet at the end-of-forward check.
        "third step, rank 0 runs an extra block": (2, [
            "rank 0: at unit event 3 of its forward started the forward of 'extra.0' (Block), where the first "
            "training step started the forward of 'blocks.1' (Block)",
            "rank 1: finished the forward pass as the first training step ran it",
        ]),
        "third step, rank 1 skips the last block": (2, [
            "rank 0: finished the forward pass as the first training step ran it",
            "rank 1: at unit event 5 of its forward ended the forward of the model itself (BranchyNet), where the "
            "first training step started the forward of 'blocks.2' (Block)",
        ]),
    }  # fmt: skip
    for name, (step, lines) in expected.items():
        for rank, result in enumerate(per_rank):
            message = result[name].get("error")
            assert message is not None, (name, rank)
            assert result[name]["step"] == step, name
            assert message.startswith(f"partita rank {rank}: ZeRO-3 ranks ran different modules in one training forward")
            assert _what_each_rank_did(message) == lines, (name, message)
            assert "partita.zero.set_z3_leaf_modules" in message
    # The same change on every rank is no error: the trace is dropped, units are gathered on
    # demand (each gather checked), and training equals stage 2 and single-process torch. (The
    # extra block, without gradients in the first two steps, is compared with stage 2 only:
    # partita's flat optimizer partitions step a parameter without gradient as if its gradient
    # were zero, where torch's AdamW skips it, so Adam's step counts differ.)
    torch_ref = _reference({2})
    for result in per_rank:
        got = result["third step, every rank runs the extra block"]
        assert got.get("error") is None, got.get("error")
        assert got["trace"] == "disabled"
        stage2 = result["stage 2, every rank runs the extra block"]["params"]
        for key, value in stage2.items():
            assert float((got["params"][key] - value).norm() / value.norm().clamp_min(1e-12)) < 1e-6, key
            if key in torch_ref and not key.startswith("extra."):
                want = torch_ref[key]
                assert float((got["params"][key] - want).norm() / want.norm().clamp_min(1e-12)) < 1e-5, key
