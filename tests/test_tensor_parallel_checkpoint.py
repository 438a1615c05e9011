"""Checkpoints and exports under tensor parallelism.

One 4-rank launch saves the tiny GPT at tensor 2 x data 2 (ZeRO-3) after 2 steps, checks the
exports against the unsharded model, trains 2 more steps (the uninterrupted run), and loads the
checkpoint at tensor 2 x data 2, tensor 1 x data 4 and tensor 4 x data 1, each training the same
2 steps; a 1-rank launch loads it without tensor parallelism. Every loaded engine saves again
right after the load, so the parent compares every saved fp32 master and momentum tensor of the
original and the re-saved checkpoints whole and bit for bit (exact resume of the optimizer).

Oracle for the continuation: the uninterrupted run. Same layout: bit-identical (the same sums
in the same order). Another tensor or data size: within 1e-6 relative, because the row-parallel
layers sum partial products across tensor ranks (and the gradients sum over another data size)
in another order than one matmul does; fp32 rounding differs, nothing else.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from partita.checkpoint import format as fmt
from partita.checkpoint.consolidate import consolidate
from partita.checkpoint.errors import CheckpointMismatchError
from partita.checkpoint.reshard import ShardReader
from partita.checkpoint.tensor_layout import assemble, check_block_wise, read_blocks, read_elements
from partita.tensor_parallel.layers import TensorShard
from partita.tensor_parallel.shard_ranges import local_slice
from tests.harness import run_distributed

LR = 0.1
STEPS = 4  # 2 before the save, 2 after
GLOBAL_BATCH = 4
SEQ = 8
LOADS = [(2, 3), (1, 1), (4, 0)]  # (tensor size, ZeRO stage) of the loads at world 4


def _gpt():
    from partita.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, block_size=SEQ, n_layer=2, n_head=4, n_embd=32))


def _config(tensor: int, stage: int) -> dict:
    return {
        "train_batch_size": GLOBAL_BATCH,
        "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 500, "allgather_bucket_size": 500},
        "tensor_parallel": {"autotp_size": tensor},
        "steps_per_print": 1000,
    }


def _engine(tensor: int, stage: int):
    import partita

    model = _gpt()
    engine, _, _, _ = partita.initialize(model=model, model_parameters=model.optimizer_param_groups(0.1),
                                         config=_config(tensor, stage))
    return engine, model


def _train(engine, steps: range) -> None:
    g = torch.Generator().manual_seed(1)
    xs = torch.randint(0, 64, (STEPS, GLOBAL_BATCH, SEQ), generator=g)
    ys = torch.roll(xs, -1, dims=-1)
    topo = engine.topology
    micro = engine.train_micro_batch_size_per_gpu()
    for step in steps:
        start = topo.data_rank * micro
        _, loss = engine(xs[step][start:start + micro], ys[step][start:start + micro])
        engine.backward(loss)
        engine.step()


def _params(engine, model) -> dict[str, torch.Tensor]:
    whole = engine.get_fp32_state_dict(rank0_only=False)
    return {name: whole[name] for name, _ in model.named_parameters()}


def _gathered_parameters(engine, model) -> dict:
    """GatheredParameters at tensor 2: whole copies, edits written back to shards and masters."""
    import torch.distributed as dist

    from partita.zero import GatheredParameters

    attn = model.blocks[0].attn
    before = engine.get_fp32_state_dict(rank0_only=False)
    listed = [attn.qkv.weight, attn.proj.weight, model.ln_f.weight]
    names = ["blocks.0.attn.qkv.weight", "blocks.0.attn.proj.weight", "ln_f.weight"]
    with GatheredParameters(listed) as read_only:
        seen = {n: read_only.whole(p).clone() for n, p in zip(names, listed)}
        read_only.whole(attn.qkv.weight).mul_(0.0)  # discarded: no modifier_rank
    unchanged = engine.get_fp32_state_dict(rank0_only=False)
    with GatheredParameters(listed, modifier_rank=0) as gathered:
        if dist.get_rank() == 0:  # DeepSpeed's idiom: one rank edits, every rank gets the edit
            gathered.whole(attn.qkv.weight).mul_(0.5)   # fused q/k/v, split along dim 0 in 3 chunks
            gathered.whole(attn.proj.weight).add_(1.0)  # row-parallel, split along dim 1
            model.ln_f.weight.data.fill_(2.0)           # replicated
    after = engine.get_fp32_state_dict(rank0_only=False)
    # The live shards compute with the edited weights (forward of the sharded model).
    x = torch.randint(0, 64, (1, SEQ), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        _, loss = model(x, torch.roll(x, -1, dims=-1))
    return {"before": before, "seen": seen, "unchanged": unchanged, "after": after, "loss": loss.item(), "x": x}


def world4(root: str) -> dict:
    import torch.distributed as dist

    out: dict = {}
    engine, model = _engine(2, 3)
    out["initial"] = engine.get_fp32_state_dict(rank0_only=False)
    _train(engine, range(0, 2))
    engine.save_checkpoint(root, tag="tp2x2")
    out["fp32_at_save"] = engine.get_fp32_state_dict(rank0_only=False)
    engine.save_16bit_model(root, "export.bin")
    engine.save_16bit_model(root, "export.safetensors")
    _train(engine, range(2, 4))
    out["uninterrupted"] = _params(engine, model)
    out["gathered"] = _gathered_parameters(engine, model)
    for tensor, stage in LOADS:
        engine, model = _engine(tensor, stage)
        engine.load_checkpoint(root, tag="tp2x2")
        engine.save_checkpoint(root, tag=f"resaved_t{tensor}")
        _train(engine, range(2, 4))
        out[f"t{tensor}"] = _params(engine, model)
    out["rank"] = dist.get_rank()
    return out


def world1(root: str) -> dict:
    engine, model = _engine(1, 2)
    engine.load_checkpoint(root, tag="tp2x2")
    engine.save_checkpoint(root, tag="resaved_t1_world1")
    _train(engine, range(2, 4))
    return {"t1_world1": _params(engine, model)}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _whole_state(tag_dir: Path) -> dict[str, torch.Tensor]:
    """Every saved master and per-element optimizer tensor, assembled whole."""
    meta = json.loads((tag_dir / fmt.META_FILE).read_text())
    keys = ["master"] + [f"state/{k}" for g in meta["optimizer"]["groups"] for k in g["partition_state"]]
    with ShardReader(tag_dir) as reader:
        return {f"{k}/{name}": assemble(reader, f"{k}/{name}", record, None)
                for name, record in meta["optimizer"]["params"].items() for k in dict.fromkeys(keys)}


def test_tensor_parallel_checkpoint_reshards_exactly_and_exports_whole(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    results = run_distributed(world4, 4, str(root), timeout=420)
    (single,) = run_distributed(world1, 1, str(root), timeout=240)
    ref_model = _gpt()
    reference = ref_model.state_dict()
    first = results[0]

    # ---- exports are whole tensors under the model's keys, on every rank
    for result in results:
        assert result["initial"].keys() == reference.keys()
        for key, value in reference.items():
            assert torch.equal(result["initial"][key], value), key  # the unsharded model's weights exactly
        for key in reference:
            assert torch.equal(result["fp32_at_save"][key], first["fp32_at_save"][key]), key
    at_save = first["fp32_at_save"]
    binary = torch.load(root / "export.bin", weights_only=True)
    assert binary.keys() == reference.keys()
    for key, value in binary.items():
        assert torch.equal(value, at_save[key]), key
    safetensors = load_file(str(root / "export.safetensors"))
    with safe_open(str(root / "export.safetensors"), framework="pt") as handle:
        tied = json.loads(handle.metadata()["partita_tied"])
    assert tied == {"lm_head.weight": "tok_emb.weight"}
    for key in reference:
        assert torch.equal(safetensors[tied.get(key, key)], at_save[key]), key

    # ---- offline consolidate of the tensor-parallel checkpoint: the whole weights
    meta = json.loads((root / "tp2x2" / fmt.META_FILE).read_text())
    assert meta["tensor_parallel_size"] == 2 and meta["optimizer"]["params"]["blocks.0.attn.qkv.weight"]["tensor"] == {
        "dim": 0, "size": 2, "chunks": 3}
    assert "blocks.0.attn.qkv.weight" not in meta["model"]["tensors"]  # whole only as master pieces
    index = json.loads(consolidate(root / "tp2x2", tmp_path / "hf").read_text())
    merged = {}
    for file in set(index["weight_map"].values()):
        merged.update(load_file(str(tmp_path / "hf" / file)))
    for key in reference:
        assert torch.equal(merged[index["metadata"]["tied_weights"].get(key, key)], at_save[key]), key

    # ---- replicated parameters are saved once (tensor rank 0's files), split ones per tensor rank
    ln = meta["optimizer"]["params"]["ln_f.weight"]
    assert {s["file"] for s in ln["shards"]} <= {fmt.rank_file(0), fmt.rank_file(2)}
    pieces = meta["optimizer"]["params"]["blocks.0.mlp.proj.weight"]["pieces"]
    assert [sorted({s["file"] for s in p["shards"]}) for p in pieces] == [
        [fmt.rank_file(0), fmt.rank_file(2)], [fmt.rank_file(1), fmt.rank_file(3)]]

    # ---- the optimizer state resumes exactly: re-saved right after each load, bit for bit
    original = _whole_state(root / "tp2x2")
    assert any(k.startswith("state/momentum_buffer/") for k in original)
    for tag in ("resaved_t2", "resaved_t1", "resaved_t4", "resaved_t1_world1"):
        again = _whole_state(root / tag)
        assert again.keys() == original.keys(), tag
        for key, value in original.items():
            assert torch.equal(again[key], value), (tag, key)

    # ---- continuing after the load equals the uninterrupted run
    uninterrupted = first["uninterrupted"]
    for name, value in uninterrupted.items():
        assert torch.equal(first["t2"][name], value), name  # same layout: bit-identical
    worst = {}
    for label, got in (("t1", first["t1"]), ("t4", first["t4"]), ("t1_world1", single["t1_world1"])):
        worst[label] = max(_rel(got[name], value) for name, value in uninterrupted.items())
        assert worst[label] < 1e-6, (label, worst[label])
    for result in results[1:]:  # every rank ends with the same whole model
        for label in ("t2", "t1", "t4"):
            for name in uninterrupted:
                assert torch.equal(result[label][name], first[label][name]), (label, name)

    # ---- GatheredParameters: whole values inside, edits written back to every rank's shards
    for result in results:
        g = result["gathered"]
        for name, value in g["seen"].items():
            assert torch.equal(value, g["before"][name]), name
        for name in g["before"]:
            assert torch.equal(g["unchanged"][name], g["before"][name]), name  # read-only: nothing kept
        edited = dict(g["before"])
        edited["blocks.0.attn.qkv.weight"] = g["before"]["blocks.0.attn.qkv.weight"] * 0.5
        edited["blocks.0.attn.proj.weight"] = g["before"]["blocks.0.attn.proj.weight"] + 1.0
        edited["ln_f.weight"] = torch.full_like(g["before"]["ln_f.weight"], 2.0)
        for name, value in edited.items():
            assert torch.equal(g["after"][name], value), name
    ref_model.load_state_dict(results[0]["gathered"]["after"])
    x = first["gathered"]["x"]
    with torch.no_grad():
        _, loss = ref_model(x, torch.roll(x, -1, dims=-1))
    for result in results:
        assert abs(result["gathered"]["loss"] - loss.item()) <= 1e-6 * abs(loss.item()), (result["gathered"]["loss"], loss)


# ---------------------------------------------------------------------------- the reading rules, offline


SPLITS = [(0, 1), (1, 1), (0, 3)]  # (dim, chunks): column-parallel, row-parallel, fused q/k/v


def _write_split(tag_dir: Path, whole: torch.Tensor, dim: int, chunks: int, size: int, zero: int) -> dict:
    """A checkpoint record of ``whole`` split over ``size`` tensor ranks, each local shard cut in
    ``zero`` ZeRO ranges (rank file per (tensor, zero) rank), as snapshot.py writes them."""
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    pieces = []
    for t in range(size):
        local = local_slice(whole, dim=dim, size=size, rank=t, chunks=chunks) if size > 1 else whole
        flat = local.reshape(-1)
        step = math.ceil(flat.numel() / zero)
        shards = []
        for z in range(zero):
            start, end = z * step, min((z + 1) * step, flat.numel())
            file = fmt.rank_file(t * zero + z)
            tensors.setdefault(file, {})["master/w"] = flat[start:end].clone()
            shards.append({"file": file, "start": start, "end": end})
        pieces.append({"rank": t, "shape": list(local.shape), "numel": flat.numel(), "shards": shards})
    tag_dir.mkdir(parents=True)
    for file, entries in tensors.items():
        save_file(entries, str(tag_dir / file))
    if size == 1:
        return {"shape": list(whole.shape), "numel": whole.numel(), "shards": pieces[0]["shards"]}
    return {"shape": list(whole.shape), "numel": whole.numel(), "tensor": {"dim": dim, "size": size, "chunks": chunks},
            "pieces": pieces}


@pytest.mark.parametrize("dim,chunks", SPLITS)
def test_any_tensor_size_reads_its_shard_of_any_saved_split(tmp_path: Path, dim: int, chunks: int) -> None:
    whole = torch.arange(24 * 12, dtype=torch.float32).reshape(24, 12)
    for saved in (1, 2, 4):
        record = _write_split(tmp_path / f"s{saved}", whole, dim, chunks, saved, zero=3)
        with ShardReader(tmp_path / f"s{saved}") as reader:
            assert torch.equal(assemble(reader, "master/w", record, None), whole)
            for size in (1, 2, 4):
                for rank in range(size):
                    shard = TensorShard(dim=dim, rank=rank, size=size, full_shape=tuple(whole.shape), chunks=chunks)
                    current = shard if size > 1 else None
                    expect = local_slice(whole, dim=dim, size=size, rank=rank, chunks=chunks).reshape(-1)
                    out = torch.empty(7)  # an odd ZeRO range of the local shard
                    read_elements(reader, "master/w", record, current, 5, 12, out)
                    assert torch.equal(out, expect[5:12]), (saved, size, rank)


def test_block_wise_state_moves_only_where_blocks_hold_the_same_elements(tmp_path: Path) -> None:
    block = 4
    whole = torch.arange(16 * 8, dtype=torch.float32).reshape(16, 8)  # local shards of 64 / 32 elements
    record = _write_split(tmp_path / "s2", whole, 0, 1, 2, zero=2)
    # Per-block values, saved over each shard's blocks: block k of a shard = its elements' sum.
    for piece in record["pieces"]:
        for s in piece["shards"]:
            path = tmp_path / "s2" / s["file"]
            entries = load_file(str(path))
            entries["state/absmax1/w"] = entries["master/w"].reshape(-1, block).sum(dim=1)
            save_file(entries, str(path))
    with ShardReader(tmp_path / "s2") as reader:
        for size in (1, 4):
            for rank in range(size):
                shard = TensorShard(dim=0, rank=rank, size=size, full_shape=(16, 8)) if size > 1 else None
                check_block_wise("w", record, shard, block)
                local = local_slice(whole, dim=0, size=size, rank=rank).reshape(-1)
                out = torch.empty(3)
                read_blocks(reader, "state/absmax1/w", record, shard, 1, 4, out, block)
                assert torch.equal(out, local.reshape(-1, block).sum(dim=1)[1:4]), (size, rank)
    # Split along dim 1 (row-parallel) at another size: the blocks would mix other elements.
    row = _write_split(tmp_path / "r2", whole, 1, 1, 2, zero=1)
    with pytest.raises(CheckpointMismatchError, match=r"saved at tensor-parallel size 2 \(split 2 ways along dimension 1\) "
                       r"and this run uses tensor-parallel size 4 .*load_optimizer_states=False"):
        check_block_wise("w", row, TensorShard(dim=1, rank=0, size=4, full_shape=(16, 8)), block)
    # Local shards of 48 elements are not whole blocks of 32.
    odd = _write_split(tmp_path / "o2", torch.zeros(12, 8), 0, 1, 2, zero=1)
    with pytest.raises(CheckpointMismatchError, match="blocks of 32 elements"):
        check_block_wise("w", odd, None, 32)
