"""The reference GPT with MoE blocks (GPTConfig.moe_*): the loss carries the load-balancing term,
FLOPs count the active experts only, and experts spread over 2 ranks (ep 2) train exactly as all
experts on one process (dropless routing, the same global batch).

The parity run switches off ``top2_2nd_expert_sampling`` (DeepSpeed's default, on in GPTConfig's
MoE): it adds Gumbel noise, drawn from each process's own RNG stream over its own tokens, to the
second choice, so 2 ranks drawing noise for 16 tokens each pick other second experts than 1
process drawing it for 32 (the noise is random by design, not a function of the token). With
the experts starting as identical copies, the routed output is the same whichever experts a
token reaches (its two weights sum to 1), so the dense parameters matched while the experts'
updates differed 0.6-1.5x: that was the "open ep-2 mismatch". The experts are also given
distinct weights here (by global expert index), so a token sent to the wrong expert changes the
dense parameters too."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.harness import run_distributed

STEPS, GLOBAL_BATCH, SEQ = 3, 4, 8


def _config(**moe):
    from partita.models.gpt import GPTConfig

    return GPTConfig(vocab_size=64, block_size=SEQ, n_layer=4, n_head=2, n_embd=16, moe_every=2, moe_experts=4, **moe)


def test_moe_blocks_loss_and_flops() -> None:
    from partita.models.gpt import GPT
    from partita.models.gpt_moe import MoEFeedForward

    torch.manual_seed(0)
    model = GPT(_config())
    assert [isinstance(b.mlp, MoEFeedForward) for b in model.blocks] == [False, True, False, True]
    x = torch.randint(0, 64, (2, SEQ))
    logits, loss = model(x, x)
    aux = model.blocks[1].mlp.aux_loss + model.blocks[3].mlp.aux_loss
    expected = F.cross_entropy(logits.float().view(-1, 64), x.reshape(-1)) + 0.01 * aux
    assert torch.equal(loss, expected)
    # 6N counts top_k of the moe_experts experts: 2 of 4, so half of each MoE block's expert weights.
    experts = sum(p.numel() for b in (model.blocks[1], model.blocks[3]) for p in b.mlp.moe.experts.parameters())
    dense = model.num_parameters(exclude_position_embedding=True) - experts // 2
    assert model.flops_per_token() == 6 * dense + 12 * 4 * 16 * SEQ
    with pytest.raises(ValueError, match=r"1 <= moe_top_k \(5\) <= moe_experts \(4\)"):
        _config(moe_top_k=5)


def _train(ep: int) -> dict:
    import partita
    from partita.models.gpt import GPT

    torch.manual_seed(0)
    # moe_aux_loss_coef 0: the load-balancing loss is a product of per-rank means (as DeepSpeed's),
    # so it differs from the global batch's by construction; the parity is about the routing.
    model = GPT(_config(moe_ep_size=ep, moe_drop_tokens=False, moe_aux_loss_coef=0.0))
    _distinct_experts_without_sampling(model, ep)
    cfg = {"train_batch_size": GLOBAL_BATCH, "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}},
           "gradient_clipping": 0.0, "zero_optimization": {"stage": 2}, "steps_per_print": 1000}
    engine, *_ = partita.initialize(model=model, config=cfg)
    initial = _by_global_expert(model, engine.get_fp32_state_dict(rank0_only=False))
    rank, world, micro = engine.topology.data_rank, engine.topology.data_size, engine.train_micro_batch_size_per_gpu()
    g = torch.Generator().manual_seed(1)
    # One batch, every step: random tokens are unlearnable, so a fresh batch per step left the
    # "it trains" check at the mercy of the draw; fitting one batch decreases the loss surely.
    xs = torch.randint(0, 64, (1, GLOBAL_BATCH, SEQ), generator=g).expand(STEPS, -1, -1)
    losses = []
    for step in range(STEPS):
        x = xs[step][rank * micro:(rank + 1) * micro]
        _, loss = engine(x, torch.roll(x, -1, dims=1))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"params": _by_global_expert(model, engine.get_fp32_state_dict(rank0_only=False)), "losses": losses,
            "initial": initial}


def _by_global_expert(model, export: dict) -> dict:
    """The export's parameters: every expert rank's experts, under their global names
    (``deepspeed_experts.<e>``), as the export returns them at ep_size > 1."""
    from partita.moe.registry import global_expert_names

    return {g: export[g] for n, p in model.named_parameters() for g in global_expert_names(n, p)}


def _distinct_experts_without_sampling(model, ep: int) -> None:
    """Deterministic routing (no Gumbel noise) and experts that differ, by global expert index."""
    import os

    expert_rank = int(os.environ.get("RANK", "0")) % ep  # partita's layout: expert rank = data rank % ep
    with torch.no_grad():
        for i, block in enumerate(model.blocks):
            if not hasattr(block.mlp, "moe"):
                continue
            moe = block.mlp.moe
            moe.top2_2nd_expert_sampling = False
            first = expert_rank * moe.num_local_experts
            g = torch.Generator().manual_seed(100 + i)
            for name, _ in moe.experts.deepspeed_experts[0].named_parameters():
                params = moe.experts.expert_params(name)
                noise = torch.randn((moe.num_experts, *params[0].shape), generator=g) * 0.05
                for j, param in enumerate(params):
                    param.add_(noise[first + j])


@pytest.fixture(scope="module")
def spread_and_whole() -> tuple[list[dict], dict]:
    return run_distributed(_train, 2, 2, timeout=240), run_distributed(_train, 1, 1, timeout=240)[0]


def test_experts_over_two_ranks_start_equal_and_train(spread_and_whole) -> None:
    spread, whole = spread_and_whole
    for name, want in whole["initial"].items():  # the same model whatever ep_size (experts by global index)
        assert torch.equal(spread[0]["initial"][name], want), name
    # The first step's loss (before any update) is the global batch's.
    first = (spread[0]["losses"][0] + spread[1]["losses"][0]) / 2
    assert abs(first - whole["losses"][0]) < 1e-5
    mean_loss = [(a + b) / 2 for a, b in zip(spread[0]["losses"], spread[1]["losses"])]
    assert mean_loss[-1] < mean_loss[0]


def test_experts_over_two_ranks_train_as_on_one(spread_and_whole) -> None:
    spread, whole = spread_and_whole
    for name, want in whole["params"].items():
        got = spread[0]["params"][name]
        err = float((got - want).norm() / want.norm().clamp_min(1e-12))
        assert err < 1e-5, f"{name}: relative error {err:.2e}"
