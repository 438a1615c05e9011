"""Whole-parameter access and export under ZeRO: GatheredParameters, save_16bit_model, fp32 state dict."""

from __future__ import annotations

import torch

from tests.harness import run_distributed
from tests.tiny_models import build_block_model, param_groups, reference_train_model
from tests.test_zero3 import CLIP, GLOBAL_BATCH, LR, STEPS, _config


def _export_body(stage: int, out_dir: str) -> dict:
    import torch.distributed as dist
    from safetensors.torch import load_file

    import partita
    from partita.zero import GatheredParameters
    from tests.tiny_models import make_batches

    cfg = _config(1, 0)
    cfg["zero_optimization"]["stage"] = stage
    model = build_block_model()
    initial = {n: p.detach().clone() for n, p in build_block_model().named_parameters()}
    engine, _, _, _ = partita.initialize(model=model, model_parameters=param_groups(model), config=cfg)
    rank = dist.get_rank()
    weight = model.blocks[0].up.weight
    with GatheredParameters([weight]):
        read_ok = torch.equal(weight.detach(), initial["blocks.0.up.weight"])
    xs, ys = make_batches(STEPS, GLOBAL_BATCH)
    micro = engine.train_micro_batch_size_per_gpu()
    for step in range(STEPS):
        lo = rank * micro
        engine.backward(engine(xs[step][lo : lo + micro], ys[step][lo : lo + micro]))
        engine.step()
    fp32 = engine.get_fp32_state_dict()
    path = engine.save_16bit_model(out_dir, f"stage{stage}.safetensors")
    saved = load_file(str(path)) if rank == 0 else {}
    with GatheredParameters(list(model.parameters())):
        trained16 = {n: p.detach().clone() for n, p in model.named_parameters()}
    # Edit a weight on rank 1 only; modifier_rank=1 makes every rank adopt it, masters included.
    with GatheredParameters([weight], modifier_rank=1):
        if rank == 1:
            weight.data.fill_(0.25)
    after_edit = engine.get_fp32_state_dict(rank0_only=False)["blocks.0.up.weight"]
    with GatheredParameters(list(model.parameters())):
        full16 = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"read_ok": read_ok, "fp32": fp32, "saved": saved, "trained16": trained16, "full16": full16,
            "after_edit": after_edit}


def test_gathered_parameters_and_exports_at_stages_2_and_3(tmp_path) -> None:
    ref, _ = reference_train_model(build_block_model, num_steps=STEPS, global_batch=GLOBAL_BATCH, lr=LR, clip=CLIP)
    for stage in (2, 3):
        per_rank = run_distributed(_export_body, 2, stage, str(tmp_path))
        r0, r1 = per_rank
        assert r0["read_ok"] and r1["read_ok"]
        assert set(r0["fp32"]) >= set(ref) and r1["fp32"] == {}  # rank0_only
        for name, want in ref.items():
            got = r0["fp32"][name]
            assert float((got - want).norm() / want.norm()) < 1e-5, (stage, name)
        # The 16-bit file holds every parameter once (tied embedding/head under one name).
        assert "embed.weight" in r0["saved"] and "head.weight" not in r0["saved"]
        assert "blocks.0.gain" in r0["saved"]  # buffers too
        for name, tensor in r0["saved"].items():
            if name in r0["trained16"]:
                assert torch.equal(tensor, r0["trained16"][name].cpu()), (stage, name)
        for r in per_rank:
            assert torch.equal(r["after_edit"], torch.full_like(r["after_edit"], 0.25)), stage
            assert torch.equal(r["full16"]["blocks.0.up.weight"], torch.full((11, 7), 0.25)), stage
