"""``stage3_one_rank_resident`` around the training step: checkpoints, offload_states, generation.

One process, partita's reference GPT (fp32 and bf16; norms and biases persistent, the rest sharded), ZeRO-3 with and without
the key (zero/one_rank_gather.py [Note: resident parameters]):

- a checkpoint saved by the resident engine after 2 steps is the ZeRO-3 checkpoint of the default
  engine (same files, same tensors); it loads into a 2-rank ZeRO-3 engine, whose whole weights then
  equal the saved ones, and back into a resident engine, whose next step equals the uninterrupted
  run's (the load replaces the masters: the resident weights follow);
- offload_states() / reload_states() between steps (every kind) then training goes on bitwise;
- engine.generate gives the tokens of the unsharded model with the trained weights, with the key and without.
- with the optimizer in host memory (delayed update) the bf16 parameters are the device's bf16 shards
  (no memory beyond the default's) and train bitwise as the default does.
"""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_distributed

SHAPE = {"vocab_size": 64, "block_size": 32, "n_layer": 2, "n_head": 4, "n_embd": 32}


def _config(resident: bool, bf16: bool) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "bf16": {"enabled": bf16}, "gradient_clipping": 1.0, "steps_per_print": 10**6,
            # Norms and biases (n_embd elements or fewer) persistent, the rest sharded.
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": SHAPE["n_embd"],
                                  "stage3_one_rank_resident": resident}}


def _engine(resident: bool, bf16: bool):
    import partita
    from partita.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    engine, _, _, _ = partita.initialize(model=GPT(GPTConfig(**SHAPE)), config=_config(resident, bf16))
    return engine


def _batch(step: int) -> torch.Tensor:
    return torch.randint(0, SHAPE["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(step))


def _step(engine, step: int) -> float:
    x = _batch(step)
    loss = engine(x, x)[1]
    engine.backward(loss)
    engine.step()
    return loss.item()


def _whole(engine) -> dict[str, torch.Tensor]:
    from partita.zero import GatheredParameters

    with GatheredParameters(list(engine.module.parameters())):
        return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}


def _files(directory: str) -> dict[str, dict]:
    import os

    out = {}
    for root, _, names in os.walk(directory):
        for name in names:
            if name.endswith(".pt"):
                path = os.path.join(root, name)
                out[os.path.relpath(path, directory)] = torch.load(path, map_location="cpu", weights_only=False)
    return out


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return True  # other leaves (paths, versions, config echoes): not compared


def _one_rank(directory: str, bf16: bool) -> dict:
    from partita.models.gpt import GPT, GPTConfig

    out: dict = {}
    for resident in (False, True):
        engine = _engine(resident, bf16)
        out[f"losses_{resident}"] = [_step(engine, s) for s in range(2)]
        engine.save_checkpoint(f"{directory}/{resident}", tag="two")
        out[f"saved_{resident}"] = _whole(engine)
        # offload_states / reload_states between steps, then the run goes on.
        if resident:
            engine.offload_states()
            engine.reload_states()
        out[f"third_{resident}"] = _step(engine, 2)
        out[f"after_third_{resident}"] = _whole(engine)
        ids = _batch(9)[:, :4]
        out[f"generated_{resident}"] = engine.generate(ids, 6).tolist()
        engine.destroy()
    out["files_equal"] = _same(_files(f"{directory}/False"), _files(f"{directory}/True"))
    plain = GPT(GPTConfig(**SHAPE)).to(torch.bfloat16 if bf16 else torch.float32)  # the trained weights, unsharded
    with torch.no_grad():
        for name, param in plain.named_parameters():
            param.copy_(out["after_third_False"][name])
    out["want_generated"] = plain.generate(_batch(9)[:, :4], 6).tolist()
    # Loaded back into a resident engine: its next step is the uninterrupted run's.
    engine = _engine(True, bf16)
    engine.load_checkpoint(f"{directory}/True", tag="two")
    out["loaded_whole"] = _whole(engine)
    out["loaded_third"] = _step(engine, 2)
    out["loaded_after_third"] = _whole(engine)
    return out


def _two_ranks(directory: str, bf16: bool) -> dict:
    engine = _engine(False, bf16)
    engine.load_checkpoint(f"{directory}/True", tag="two")
    return _whole(engine)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_resident_checkpoints_offload_and_generation(tmp_path, bf16: bool) -> None:
    got = run_distributed(_one_rank, 1, str(tmp_path), bf16, timeout=300)[0]
    assert got["losses_True"] == got["losses_False"]
    assert got["files_equal"]
    for name, value in got["saved_False"].items():
        assert torch.equal(got["saved_True"][name], value), name
        assert torch.equal(got["loaded_whole"][name], value), name
        assert torch.equal(got["after_third_True"][name], got["after_third_False"][name]), name  # offload + reload
        assert torch.equal(got["loaded_after_third"][name], got["after_third_False"][name]), name
    assert got["third_True"] == got["third_False"] == got["loaded_third"]
    assert got["generated_True"] == got["generated_False"] == got["want_generated"]
    for rank_whole in run_distributed(_two_ranks, 2, str(tmp_path), bf16, timeout=300):
        for name, value in got["saved_True"].items():
            assert torch.equal(rank_whole[name], value), name


def _offloaded(resident: bool) -> dict:
    """bf16, optimizer in host memory with the delayed update: the device keeps a bf16 shard per group."""
    import partita
    from partita.models.gpt import GPT, GPTConfig

    config = _config(resident, True)
    config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "delayed_param_update": True}
    torch.manual_seed(0)
    engine, _, _, _ = partita.initialize(model=GPT(GPTConfig(**SHAPE)), config=config)
    losses = [_step(engine, s) for s in range(3)]
    engine.finish_pending_step()
    gatherer = engine.zero.gatherer
    shards = [s.untyped_storage().data_ptr() for s in gatherer.shards]
    shared = [p.untyped_storage().data_ptr() in shards for p in gatherer.resident]
    return {"losses": losses, "whole": _whole(engine), "shared": shared}


def _offloaded_both() -> dict:
    return {resident: _offloaded(resident) for resident in (False, True)}


def test_resident_over_a_host_master_shares_the_device_shard() -> None:
    got = run_distributed(_offloaded_both, 1, timeout=300)[0]
    default, resident = got[False], got[True]
    assert default["shared"] == [] and len(resident["shared"]) > 8
    assert all(resident["shared"])  # the bf16 parameters are the device shards: no extra memory
    assert resident["losses"] == default["losses"]
    for name, value in default["whole"].items():
        assert torch.equal(resident["whole"][name], value), name
