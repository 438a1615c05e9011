"""Checkpoints written before the MoE layer took DeepSpeed's module layout (experts stacked as
``moe.experts.stacked.<name>``, rows of the global (num_experts, ...) tensor) still load.

tests/fixtures/moe_stacked_ckpt/ holds two such checkpoints, saved by partita at commit 81f90f0
(tests/fixtures/make_moe_stacked_ckpt.py) on 2 ranks at ZeRO-2, ep_size 1 and 2, of a residual
top-2 MoE model, with the old code's weights at the save and after the next step. The current
code loads them at ep_size 1 and 2 on 2 ranks (the weights exactly; the next step as the old
code took it), at ep_size 2 and 4 on 4 ranks at ZeRO-3 (exactly the state the current code
resaves from them: same next step bit for bit), in one process, and ``consolidate`` writes them
under today's names. A model whose experts disagree with the stacked entries is refused."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.fixtures import make_moe_stacked_ckpt as gen
from tests.harness import run_distributed

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "moe_stacked_ckpt"
CKPT = str(FIXTURE / "ckpt")
GATE = "moe.deepspeed_moe.gate.wg.weight"


class NewNet(nn.Module):
    """The generator's model in today's layout (weights come from the checkpoint)."""

    def __init__(self, ep_size: int, *, num_experts: int = gen.E, ffn: int = gen.FFN) -> None:
        super().__init__()
        from partita.moe import ExpertMLP, MoE

        self.inp = nn.Linear(gen.D, gen.D)
        self.moe = MoE(gen.D, ExpertMLP(gen.D, ffn), num_experts=num_experts, ep_size=ep_size, k=2, drop_tokens=False,
                       use_rts=False, top2_2nd_expert_sampling=False, use_residual=True)
        self.out = nn.Linear(gen.D, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h, l_aux, _ = self.moe(torch.tanh(self.inp(x)))
        return F.mse_loss(self.out(h), y) + gen.AUX * l_aux


def _today(old: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The old code's recorded weights under today's names (written out by hand, independently
    of partita/checkpoint/stacked_experts.py)."""
    out = {}
    for name, value in old.items():
        if name.startswith("moe.experts.stacked."):
            for g in range(value.shape[0]):
                out[f"moe.deepspeed_moe.experts.deepspeed_experts.{g}.{name.removeprefix('moe.experts.stacked.')}"] = value[g]
        elif name.startswith("moe.mlp.stacked."):
            out[f"moe.mlp.{name.removeprefix('moe.mlp.stacked.')}"] = value[0]
        elif name == "moe.gate.wg.weight":
            out[GATE] = value
        else:
            out[name] = value
    return out


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's parameters under their global names (gathered where ZeRO-3 shards them)."""
    from partita.moe.registry import checkpoint_name
    from partita.zero.gathered import GatheredParameters

    with GatheredParameters(list(model.parameters())):
        return {checkpoint_name(n, p): p.detach().float().clone() for n, p in model.named_parameters()}


def _load_and_step(load_dir: str, tag: str, ep: int, stage: int, batch: tuple | None, save_to: str | None = None) -> dict:
    import partita

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    model = NewNet(ep)
    engine, _, _, _ = partita.initialize(model=model, config=gen.config(world, stage))
    engine.load_checkpoint(load_dir, tag=tag)
    out = {"loaded": _params(model), "steps": engine.global_steps}
    if save_to is not None:
        engine.save_checkpoint(save_to, tag="resaved")
    xs, ys = batch if batch is not None else gen.batches(3)
    micro = xs[2].shape[0] // world
    mine = slice(rank * micro, (rank + 1) * micro)
    loss = engine(xs[2][mine], ys[2][mine])
    engine.backward(loss)
    engine.step()
    out["next"] = _params(model)
    return out


def two_ranks(resave_dir: str) -> dict:
    out = {}
    for saved_ep in (1, 2):
        for ep in (1, 2):
            resave = resave_dir if (saved_ep, ep) == (2, 2) else None
            out[(saved_ep, ep)] = _load_and_step(CKPT, f"ep{saved_ep}", ep, 2, None, save_to=resave)
    return out


def four_ranks(resave_dir: str) -> dict:
    # Each of the 4 ranks takes 1 row of the generator's batch; the same batch for both loads.
    out = {}
    for ep in (2, 4):
        out[ep] = {"old": _load_and_step(CKPT, "ep2", ep, 3, None),
                   "resaved": _load_and_step(resave_dir, "resaved", ep, 3, None)}
    return out


def one_process() -> dict:
    import partita
    from partita.checkpoint.errors import CheckpointMismatchError

    out = {"loaded": _load_and_step(CKPT, "ep2", 1, 0, None)["loaded"]}
    for kwargs in ({"num_experts": 8}, {"ffn": 6}):
        engine, _, _, _ = partita.initialize(model=NewNet(1, **kwargs), config=gen.config(1, 0))
        try:
            engine.load_checkpoint(CKPT, tag="ep2")
            out[str(kwargs)] = None
        except CheckpointMismatchError as error:
            out[str(kwargs)] = str(error)
    return out


def _assert_close(got: dict, want: dict, what: str, *, rel: float = 0.0) -> None:
    assert sorted(got) == sorted(want), f"{what}: {sorted(set(got) ^ set(want))}"
    for name, value in want.items():
        if rel == 0.0:
            assert torch.equal(got[name], value), f"{what} {name}: not the saved values"
        else:
            err = float((got[name] - value).norm() / value.norm())
            assert err < rel, f"{what} {name}: {err:.2e} from the old code's next step"


def _merged(per_rank: list[dict], *path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for result in per_rank:
        for key in path:
            result = result[key]
        out.update(result)
    return out


def test_old_checkpoints_load_at_ep1_and_ep2_and_resume_as_the_old_code(tmp_path) -> None:
    expected = torch.load(FIXTURE / "expected.pt")
    per_rank = run_distributed(two_ranks, 2, str(tmp_path / "resaved"), timeout=600)
    for saved_ep in (1, 2):
        saved, continued = _today(expected[f"ep{saved_ep}"]["saved"]), _today(expected[f"ep{saved_ep}"]["next"])
        assert not torch.equal(saved[GATE], continued[GATE])
        for ep in (1, 2):
            what = f"saved at ep {saved_ep}, loaded at ep {ep}"
            assert per_rank[0][(saved_ep, ep)]["steps"] == 2
            _assert_close(_merged(per_rank, (saved_ep, ep), "loaded"), saved, what)
            _assert_close(_merged(per_rank, (saved_ep, ep), "next"), continued, what + ", next step", rel=1e-5)
    # 4 ranks, ZeRO-3: the old checkpoint and the current code's resave of it are the same state.
    per_rank = run_distributed(four_ranks, 4, str(tmp_path / "resaved"), timeout=600)
    saved = _today(expected["ep2"]["saved"])
    for ep in (2, 4):
        _assert_close(_merged(per_rank, ep, "old", "loaded"), saved, f"4 ranks ep {ep}")
        _assert_close(_merged(per_rank, ep, "old", "next"), _merged(per_rank, ep, "resaved", "next"),
                      f"4 ranks ep {ep}: next step from the old checkpoint vs from its resave")


def test_old_checkpoint_in_one_process_and_mismatched_experts_refused() -> None:
    expected = torch.load(FIXTURE / "expected.pt")
    result = run_distributed(one_process, 1, timeout=300)[0]
    _assert_close(result["loaded"], _today(expected["ep2"]["saved"]), "one process")
    assert result["{'num_experts': 8}"] == (
        "the checkpoint stores 'moe.experts.stacked.fc1.weight' (the stacked expert layout of earlier partita) with "
        "shape [4, 8, 4], but this model's MoE layer 'moe' has 8 experts whose 'fc1.weight' has shape [8, 4] "
        "(stacked: [8, 8, 4]); build the model with the num_experts and expert module the checkpoint was trained with")
    assert "'fc1.weight' has shape [6, 4] (stacked: [4, 6, 4])" in result["{'ffn': 6}"]


def test_consolidate_writes_an_old_checkpoint_under_todays_names(tmp_path) -> None:
    from partita.checkpoint.consolidate import consolidate, load_consolidated

    expected = torch.load(FIXTURE / "expected.pt")
    for tag in ("ep1", "ep2"):
        consolidate(FIXTURE / "ckpt" / tag, tmp_path / tag)
        state = load_consolidated(tmp_path / tag)
        _assert_close(state, _today(expected[tag]["saved"]), f"consolidated {tag}")
        fresh = NewNet(1)
        fresh.load_state_dict(state, strict=True)


def test_upgrade_refuses_block_wise_state_and_leaves_other_checkpoints_alone() -> None:
    import copy
    import json

    from partita.checkpoint.stacked_experts import upgrade

    meta = json.loads((FIXTURE / "ckpt" / "ep2" / "meta.json").read_text())
    eight_bit = copy.deepcopy(meta)
    eight_bit["optimizer"]["groups"][1]["block_state"] = ["absmax1"]
    with pytest.raises(NotImplementedError, match="8-bit block-wise optimizer state.*load_optimizer_states=False"):
        upgrade(eight_bit)
    # A model whose own module is called experts.stacked (no MoE gate beside it) is not the old layout.
    no_gate = copy.deepcopy(meta)
    no_gate["model"]["keys"] = [k.replace("moe.gate.wg.weight", "moe.router.weight") for k in meta["model"]["keys"]]
    assert upgrade(no_gate) is None
    layout = upgrade(meta)
    record = layout.meta["optimizer"]["params"]["moe.deepspeed_moe.experts.deepspeed_experts.3.fc2.bias"]
    # fc2.bias (4 experts x 4): expert 3 is elements [12, 16), expert rank 1's piece [8, 16) at [0, 8) of its file.
    assert record["shape"] == [4] and record["numel"] == 4
    assert record["shards"] == [{"file": "rank00001.safetensors", "start": -4, "end": 4}]
    assert "moe.experts.stacked.fc2.bias" not in layout.meta["optimizer"]["params"]
