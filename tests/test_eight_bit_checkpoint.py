"""8-bit (block-wise) optimizer state in checkpoints: saved at world 2 / ZeRO-2, loaded at
world 1 / stage 0, world 4 / stage 1 and world 2 / stage 3 with the same codes, scales and
moments, and continued bit-identically; a block-size mismatch is refused.

Bit-identical continuation across world sizes needs gradients that do not depend on the
order of the cross-rank sums: the model's loss is linear in its parameters with small
integer inputs, so every gradient is a short dyadic fraction and all sums are exact. What
remains to differ between layouts is the optimizer state's cut, which is what is tested.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from partita.checkpoint.state_layout import classify_state
from partita.optim.eight_bit import BLOCK_SIZE
from tests._checkpoint_runs import full_params
from tests.harness import run_distributed

K, N, GLOBAL_BATCH = 3, 5, 8
# Odd sizes: partial last blocks, parameters spanning 1-4 blocks, shards that are all padding.
PART_SHAPES = [[(37, 11), (5,)], [(1000,), (17, 33)], [(600,)]]
USED = sum(math.prod(s) for part in PART_SHAPES for s in part)


class Part(nn.Module):
    """Parameters whose loss is ``sum(p * x)``: the gradient is the (integer) input."""

    def __init__(self, shapes: list[tuple[int, ...]], g: torch.Generator) -> None:
        super().__init__()
        self.weights = nn.ParameterList([nn.Parameter(torch.randn(s, generator=g)) for s in shapes])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        total, i = 0, 0
        for p in self.weights:
            total = total + (p.reshape(-1) * x[:, i : i + p.numel()]).sum(-1)
            i += p.numel()
        return total


class LinearNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.parts = nn.ModuleList([Part(shapes, g) for shapes in PART_SHAPES])
        self.unused = nn.Parameter(torch.randn(300, generator=g))  # trainable, never gets a gradient

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        total, i = 0, 0
        for part in self.parts:
            n = sum(p.numel() for p in part.weights)
            total = total + part(x[:, i : i + n])
            i += n
        return total.mean()


def _config(stage: int) -> dict:
    zero = {"stage": stage, "reduce_bucket_size": 1500, "allgather_bucket_size": 1200}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 100  # the 5-element parameter stays whole
    return {
        "train_batch_size": GLOBAL_BATCH,
        "optimizer": {"type": "AdamW8bit", "params": {"lr": 1e-2, "betas": [0.9, 0.95]}},
        "gradient_clipping": 0.0,  # a clipped norm would depend on the summation order
        "zero_optimization": zero,
        "steps_per_print": 1000,
        "checkpoint": {"handshake_timeout_seconds": 20},
    }


# ---------------------------------------------------------------------------- on every rank


def _build(stage: int):
    import partita

    model = LinearNet()
    decay = [p for part in model.parts for p in part.weights if p.dim() == 2] + [model.unused]
    no_decay = [p for part in model.parts for p in part.weights if p.dim() == 1]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    engine, _, _, _ = partita.initialize(model=model, model_parameters=groups, config=_config(stage))
    return engine


def _train(engine, steps: range) -> None:
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    micro = GLOBAL_BATCH // world
    data = torch.randint(-3, 4, (N, GLOBAL_BATCH, USED), generator=torch.Generator().manual_seed(1)).float()
    for step in steps:
        engine.backward(engine(data[step, rank * micro : (rank + 1) * micro]))
        engine.step()


def _param_states(engine) -> dict[str, dict]:
    """Per parameter element range this rank owns: the dequantised moments, the codes and the
    scales of its blocks (bitsandbytes' own dequantisation)."""
    import bitsandbytes.functional as F

    from partita.checkpoint.snapshot import param_names

    names = param_names(engine.module)
    out = {}
    for group in engine.optimizer.groups:
        state = engine.optimizer.inner.state[group.master]
        for param, spec, (start, end) in group.owned_slices():
            if end <= start:
                continue
            lo = spec.partition_offset
            stop = lo + math.ceil((end - start) / BLOCK_SIZE) * BLOCK_SIZE
            blocks = slice(lo // BLOCK_SIZE, stop // BLOCK_SIZE)
            record = {"start": start}
            for moment, n in (("exp_avg", 1), ("exp_avg_sq", 2)):
                codes, absmax = state[f"state{n}"][lo:stop], state[f"absmax{n}"][blocks]
                values = F.dequantize_blockwise(codes, absmax=absmax, code=state[f"qmap{n}"], blocksize=BLOCK_SIZE)
                record[moment] = values[: end - start].clone()
                record[f"codes{n}"] = codes[: end - start].clone()
                record[f"absmax{n}"] = absmax.clone()
            out[names[param]] = record
    return out


def _partitions(engine) -> list[dict[str, torch.Tensor]]:
    """The whole partitions (padding included): master and every state tensor."""
    out = []
    for group in engine.optimizer.groups:
        state = engine.optimizer.inner.state[group.master]
        real = torch.zeros(group.master.numel(), dtype=torch.bool)
        for _, spec, (start, end) in group.owned_slices():
            real[spec.partition_offset : spec.partition_offset + end - start] = True
        out.append({"master": group.master.clone(), "step": state["step"], "real": real,
                    **{k: v.clone() for k, v in state.items() if torch.is_tensor(v)}})  # fmt: skip
    return out


def _load(root: str, stage: int):
    engine = _build(stage)
    engine.load_checkpoint(root, tag=f"global_step{K}")
    loaded = {"states": _param_states(engine), "partitions": _partitions(engine), "steps": engine.global_steps}
    _train(engine, range(K, N))
    return {**loaded, "final": full_params(engine, as_float=False)}


def save_then_reload_at_stage3(root: str) -> dict:
    """World 2: the uninterrupted stage-2 run (saving at step K), then a stage-3 engine loads it."""
    engine = _build(2)
    _train(engine, range(K))
    saved = {"states": _param_states(engine), "partitions": _partitions(engine), "at_k": full_params(engine, as_float=False)}
    engine.save_checkpoint(root)
    _train(engine, range(K, N))
    straight = {**saved, "final": full_params(engine, as_float=False)}
    return {"straight": straight, "stage3": _load(root, 3)}


def load_at(root: str, stage: int) -> dict:
    return _load(root, stage)


def load_at_world1_then_block_size_mismatch(root: str) -> dict:
    from partita.checkpoint.errors import CheckpointMismatchError
    from partita.checkpoint.safetensors_io import file_sha256

    out = _load(root, 0)
    # A checkpoint whose 8-bit state was quantised in blocks of 128 (meta.json and manifest
    # rewritten consistently, so only the block size is wrong).
    other = Path(root).parent / "block128"
    shutil.copytree(root, other)
    tag = other / f"global_step{K}"
    meta = json.loads((tag / "meta.json").read_text())
    for group in meta["optimizer"]["groups"]:
        group["block_size"] = 128
    (tag / "meta.json").write_text(json.dumps(meta))
    manifest = json.loads((tag / "manifest.json").read_text())
    manifest["files"]["meta.json"] = {"size": (tag / "meta.json").stat().st_size, "sha256": file_sha256(tag / "meta.json")}
    (tag / "manifest.json").write_text(json.dumps(manifest))
    try:
        _build(0).load_checkpoint(str(other), tag=f"global_step{K}")
    except CheckpointMismatchError as error:
        out["mismatch"] = str(error)
    return out


# ---------------------------------------------------------------------------- tests


def _assemble(per_rank: list[dict[str, dict]]) -> dict[str, dict[str, torch.Tensor]]:
    """Full-parameter moments and codes from every rank's pieces (in element order)."""
    pieces: dict[str, list[dict]] = {}
    for states in per_rank:
        for name, record in states.items():
            pieces.setdefault(name, []).append(record)
    out = {}
    for name, records in pieces.items():
        records.sort(key=lambda r: r["start"])
        out[name] = {k: torch.cat([r[k] for r in records]) for k in records[0] if k != "start"}
    return out


@pytest.fixture(scope="module")
def world2(tmp_path_factory) -> tuple[str, list[dict]]:
    root = str(tmp_path_factory.mktemp("eight_bit") / "ckpt")
    return root, run_distributed(save_then_reload_at_stage3, 2, root, timeout=120)


def _check(loaded: list[dict], straight: list[dict], where: str) -> None:
    want = _assemble([r["states"] for r in straight])
    got = _assemble([r["states"] for r in loaded])
    assert got.keys() == want.keys() and len(want) == 6, where  # every parameter, the unused one too
    for name in want:
        for key in want[name]:
            # Codes, block scales and the dequantised moments: exactly the saved ones.
            assert torch.equal(got[name][key], want[name][key]), (where, name, key)
    assert all(r["steps"] == K for r in loaded)
    for name, value in straight[0]["final"].items():
        # N - K more steps: bit-identical to the run that never stopped.
        assert torch.equal(loaded[0]["final"][name], value), (where, name)
        moved = not torch.equal(value, straight[0]["at_k"][name])
        assert moved == (name != "unused"), (where, name)  # the steps did something (not to the unused one)


def test_state_layout_recognises_8bit_keys_even_when_shapes_coincide() -> None:
    from partita.config import load_config
    from partita.optim.factory import build_optimizer

    master = torch.zeros(256, requires_grad=True)  # the shape of the code tables too
    master.grad = torch.ones(256)
    config = load_config({"optimizer": {"type": "AdamW8bit"}}).optimizer
    optimizer = build_optimizer(config, [{"params": [master]}], device_type="cpu")
    optimizer.step()
    kinds = classify_state(optimizer.state[master], master)
    assert kinds.element == ("state1", "state2") and kinds.block == ("absmax1", "absmax2")
    assert sorted(kinds.replicated) == ["qmap1", "qmap2", "step"] and kinds.local == ()
    assert kinds.block_size == BLOCK_SIZE and kinds.dtypes == {
        "state1": "uint8", "state2": "uint8", "absmax1": "float32", "absmax2": "float32"}  # fmt: skip


def test_world2_stage2_to_world2_stage3_restores_whole_partitions(world2) -> None:
    _, results = world2
    straight = [r["straight"] for r in results]
    loaded = [r["stage3"] for r in results]
    _check(loaded, straight, "world2 stage3")
    # Same number of shards: the whole partitions come back, padding included (the padding in
    # a parameter's last block has nonzero codes and master weights: bitsandbytes quantises a
    # zero moment to a small nonzero code).
    for rank in range(2):
        for got, want in zip(loaded[rank]["partitions"], straight[rank]["partitions"]):
            assert got.keys() == want.keys()
            for key in want:
                assert (torch.equal(got[key], want[key]) if key != "step" else got[key] == want[key]), (rank, key)
    for g in range(2):
        partitions = [straight[rank]["partitions"][g] for rank in range(2)]
        for key in ("master", "state1", "state2"):
            assert any((p[key][~p["real"]] != 0).any() for p in partitions), (g, key)


def test_world2_stage2_to_world1_stage0_and_block_size_mismatch(world2) -> None:
    root, results = world2
    (got,) = run_distributed(load_at_world1_then_block_size_mismatch, 1, root, timeout=120)
    _check([got], [r["straight"] for r in results], "world1 stage0")
    message = got["mismatch"]
    assert "blocks of 128 elements" in message and "blocks of 256" in message and "load_optimizer_states=False" in message


def test_world2_stage2_to_world4_stage1(world2) -> None:
    root, results = world2
    got = run_distributed(load_at, 4, root, 1, timeout=120)
    _check(got, [r["straight"] for r in results], "world4 stage1")
    # At world 4 the 600-element parameter's fourth shard is all padding: no state was saved
    # for it and the rank holds zeros there.
    assert sum("parts.2.weights.0" in r["states"] for r in got) == 3
