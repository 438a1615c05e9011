"""Checkpoints store experts by global expert index (``deepspeed_experts.<global index>``, the
names they have at ep_size 1): saved at ep 2 (x expert-data 2), they load at ep 4, at ep 1 on 4
ranks, and at ep 1 in a single process, exactly; the next step (which reads the restored Adam
moments) equals the uninterrupted ep 2 run; consolidation exports every expert under its global
name."""

from __future__ import annotations

import os

import torch

from tests.harness import run_distributed
from tests.test_moe_reference import EXPERTS, MoENet, make_data, stacked_view

E = 4
MICRO = 2


def _config(world: int, stage: int) -> dict:
    return {
        "train_batch_size": MICRO * world,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 200, "allgather_bucket_size": 150,
                              "stage3_param_persistence_threshold": 10},
        "steps_per_print": 1000,
    }


def _params(model) -> dict[str, torch.Tensor]:
    from partita.zero.gathered import GatheredParameters

    with GatheredParameters(list(model.parameters())):
        return stacked_view({n: p.detach().float().clone() for n, p in model.named_parameters()})


def _step(engine, rank: int, world: int, step: int) -> None:
    xs, ys = make_data(3, MICRO * world)
    loss = engine(xs[step][rank * MICRO : (rank + 1) * MICRO], ys[step][rank * MICRO : (rank + 1) * MICRO])
    engine.backward(loss)
    engine.step()


def save_and_reshard(save_dir: str) -> dict:
    import partita

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = {}
    model = MoENet(num_experts=E, ep_size=2, k=2, drop_tokens=False, expert_rank=rank % 2)
    engine, _, _, _ = partita.initialize(model=model, config=_config(world, 2))
    # GatheredParameters(modifier_rank=0): rank 0's edit reaches every copy of the dense weights
    # and of rank 0's own experts (expert rank 0), and leaves the other expert rank's experts alone.
    from partita.zero.gathered import GatheredParameters

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with GatheredParameters(list(model.parameters()), modifier_rank=0):
        if rank == 0:
            for p in model.parameters():
                p.data.mul_(2.0)
    out["modified"] = {n: torch.equal(p.detach(), 2.0 * before[n]) for n, p in model.named_parameters()}
    out["unchanged"] = {n: torch.equal(p.detach(), before[n]) for n, p in model.named_parameters()}
    for step in range(2):
        _step(engine, rank, world, step)
    engine.save_checkpoint(save_dir, tag="ep2")
    export = engine.get_fp32_state_dict(rank0_only=False)  # every expert rank's experts, under their global names
    assert sorted(k for k in export if k.startswith(EXPERTS)) == sorted(
        f"{EXPERTS}{e}.{leaf}" for e in range(E) for leaf in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"))
    out["ep2"] = {"experts": model.moe.local_expert_indices, "saved": _params(model), "export": stacked_view(export)}
    _step(engine, rank, world, 2)
    out["ep2"]["next"] = _params(model)
    for ep, stage in ((4, 1), (1, 3)):
        fresh = MoENet(num_experts=E, ep_size=ep, k=2, drop_tokens=False, expert_rank=rank % ep)
        engine, _, _, _ = partita.initialize(model=fresh, config=_config(world, stage))
        engine.load_checkpoint(save_dir, tag="ep2")
        out[f"ep{ep}"] = {"experts": fresh.moe.local_expert_indices, "saved": _params(fresh)}
        _step(engine, rank, world, 2)
        out[f"ep{ep}"]["next"] = _params(fresh)
    return out


def load_single(save_dir: str) -> dict:
    import partita

    model = MoENet(num_experts=E, ep_size=1, k=2, drop_tokens=False)
    engine, _, _, _ = partita.initialize(model=model, config=_config(1, 0))
    engine.load_checkpoint(save_dir, tag="ep2")
    return _params(model)


def _global(per_rank: list[dict], run: str, key: str) -> dict[str, torch.Tensor]:
    """Every parameter of ``run`` with experts assembled by global index from the ranks' rows."""
    whole: dict[str, torch.Tensor] = {}
    for result in per_rank:
        for name, value in result[run][key].items():
            if name.startswith("moe.experts"):
                whole.setdefault(name, torch.full((E, *value.shape[1:]), float("nan")))[result[run]["experts"]] = value
            else:
                whole[name] = value
    return whole


def test_reshard_ep2_to_ep4_ep1_and_one_process(tmp_path) -> None:
    per_rank = run_distributed(save_and_reshard, 4, str(tmp_path), timeout=600)
    for rank, result in enumerate(per_rank):
        for name in result["modified"]:
            expert = name.startswith(EXPERTS)
            want = result["unchanged" if expert and rank % 2 == 1 else "modified"][name]
            assert want, f"rank {rank} {name}: GatheredParameters edit reached the wrong copies"
    saved = _global(per_rank, "ep2", "saved")
    assert not any(torch.isnan(v).any() for v in saved.values())
    continued = _global(per_rank, "ep2", "next")
    for run in ("ep4", "ep1"):
        loaded = _global(per_rank, run, "saved")
        for name in saved:
            assert torch.equal(loaded[name], saved[name]), f"{run} {name}: not the saved weights"
        resumed = _global(per_rank, run, "next")
        for name in saved:
            err = float((resumed[name] - continued[name]).norm() / continued[name].norm())
            assert err < 1e-5, f"{run} {name}: next step differs from the uninterrupted run ({err:.2e})"
    single = run_distributed(load_single, 1, str(tmp_path))[0]
    for name in saved:
        assert torch.equal(single[name], saved[name]), f"one process {name}"
    for result in per_rank:  # the fp32 export gathers the experts of every expert rank
        for name in saved:
            assert torch.equal(result["ep2"]["export"][name], saved[name]), f"get_fp32_state_dict {name}"
    # `partita checkpoint consolidate` exports every expert, by global index.
    from safetensors.torch import load_file

    from partita.checkpoint.consolidate import consolidate

    consolidate(tmp_path / "ep2", tmp_path / "hf")
    exported = {}
    for file in (tmp_path / "hf").glob("*.safetensors"):
        exported.update(load_file(str(file)))
    assert f"{EXPERTS}3.fc2.bias" in exported  # global names, as at ep_size 1
    exported = stacked_view(exported)
    for name in saved:
        assert torch.equal(exported[name], saved[name]), f"consolidated {name}"
