"""partita.zero.Init: a model built sharded has the same weights as an unsharded build and
trains the same; no parameter keeps its full storage after construction."""

from __future__ import annotations

import torch

from tests.harness import run_distributed

GPT_SHAPE = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)


def _config(stage: int) -> dict:
    return {
        "train_batch_size": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0} if stage == 3
        else {"stage": stage},
        "steps_per_print": 1000,
    }


def _build_and_train(stage: int, use_init: bool) -> dict:
    import torch.distributed as dist

    import partita
    from partita.distributed.init import init_distributed
    from partita.models.gpt import GPT, GPTConfig
    from partita.zero import GatheredParameters, Init
    from partita.zero.init_context import init_shard_of

    init_distributed()
    torch.manual_seed(0)
    report: dict = {}
    if use_init:
        with Init(config_dict_or_path=_config(stage)):
            model = GPT(GPTConfig(**GPT_SHAPE))
        params = list(model.parameters())
        report["storage_bytes_after_build"] = sum(p.untyped_storage().nbytes() for p in params)
        report["shard_numel"] = sum(init_shard_of(p).numel() for p in params)
        report["apply_restored"] = nn_apply_is_plain()
    else:
        model = GPT(GPTConfig(**GPT_SHAPE))
    engine, _, _, _ = partita.initialize(model=model, config=_config(stage))
    with GatheredParameters(list(model.parameters())):
        report["initial"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    gen = torch.Generator().manual_seed(1)
    rank = dist.get_rank()
    for _ in range(3):
        x = torch.randint(0, 64, (4, 16), generator=gen)
        y = torch.randint(0, 64, (4, 16), generator=gen)
        _, loss = engine(x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2])
        engine.backward(loss)
        engine.step()
    with GatheredParameters(list(model.parameters())):
        report["trained"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return report


def nn_apply_is_plain() -> bool:
    from torch import nn

    return nn.Module.apply.__module__ == "torch.nn.modules.module"


def test_init_builds_sharded_models_that_match_unsharded_builds() -> None:
    for stage in (3, 2):
        plain = run_distributed(_build_and_train, 2, stage, False)
        sharded = run_distributed(_build_and_train, 2, stage, True)
        total = sum(t.numel() for t in plain[0]["initial"].values())  # tied weights listed once
        for rank in (0, 1):
            got = sharded[rank]
            assert got["storage_bytes_after_build"] == 0, stage  # nothing whole after construction
            assert got["shard_numel"] <= total // 2 + 16, (stage, got["shard_numel"], total)  # 1/2 (+ padding)
            assert got["apply_restored"]
            for name, want in plain[rank]["initial"].items():
                assert torch.equal(got["initial"][name], want), (stage, "initial", name)
            for name, want in plain[rank]["trained"].items():
                assert torch.equal(got["trained"][name], want), (stage, "trained", name)
