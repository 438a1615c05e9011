"""A dropped engine frees what it built: fp32 masters, optimizer states, ZeRO-3 shards.

Parameters hold their gradient hooks where Python's cycle collector cannot see them, and a global
record maps each parameter to its ZeRO state; both once kept every engine alive for the life of
the process (partita/utils/weak_hooks.py, partita/zero/gathered.py). A model kept after its
engine trains under a second one exactly as a fresh copy does.
"""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_distributed

STEPS = 3


def _config(stage: int) -> dict:
    return {"train_batch_size": 8, "gradient_clipping": 0.5, "steps_per_print": 1000,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 60, "allgather_bucket_size": 50}}


def _train(engine, model) -> dict[str, torch.Tensor]:
    import torch.distributed as dist

    from partita.zero import GatheredParameters
    from tests.tiny_models import make_batches

    rank, world = dist.get_rank(), dist.get_world_size()
    micro = engine.train_micro_batch_size_per_gpu()
    xs, ys = make_batches(STEPS, 8)
    for step in range(STEPS):
        lo = rank * micro
        engine.backward(engine(xs[step][lo : lo + micro], ys[step][lo : lo + micro]))
        engine.step()
    with GatheredParameters(list(model.parameters())):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def drop_engine(stage: int, drop_model: bool) -> dict:
    import gc
    import weakref

    import partita
    from tests.tiny_models import build_block_model

    model = build_block_model()
    engine, optimizer, _, _ = partita.initialize(model=model, config=_config(stage))
    _train(engine, model)
    released = {
        "engine": weakref.ref(engine),
        "optimizer": weakref.ref(optimizer),
        "master": weakref.ref(optimizer.groups[0].master),
        "states": [weakref.ref(t) for s in optimizer.inner.state.values() for t in s.values() if torch.is_tensor(t)],
    }
    del engine, optimizer
    if drop_model:
        del model
    gc.collect()
    alive = {k: (any(r() is not None for r in v) if isinstance(v, list) else v() is not None) for k, v in released.items()}
    out = {"alive": alive, "states": len(released["states"])}
    if not drop_model:
        # The kept model trains under a second engine exactly as a fresh copy of it does: the
        # first engine's hooks left on its parameters are inert.
        reused = {k: v.clone() for k, v in model.state_dict().items()}
        out["retrained"] = _train(partita.initialize(model=model, config=_config(stage))[0], model)
        fresh_model = build_block_model()
        fresh_model.load_state_dict(reused)
        out["fresh"] = _train(partita.initialize(model=fresh_model, config=_config(stage))[0], fresh_model)
    return out


# At ZeRO-3 the model's weights live in its engine's shards (its modules' hooks gather them), so
# a kept model keeps them: there the model is dropped too.
CASES = [(0, False), (2, False), (3, True)]


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize(("stage", "drop_model"), CASES)
def test_a_dropped_engine_frees_its_masters_and_optimizer_states(stage: int, drop_model: bool, world_size: int) -> None:
    for out in run_distributed(drop_engine, world_size, stage, drop_model):
        assert out["states"] > 0
        assert out["alive"] == {"engine": False, "optimizer": False, "master": False, "states": False}
        for name, want in out.get("fresh", {}).items():
            assert torch.equal(out["retrained"][name], want), name
