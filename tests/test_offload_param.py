"""ZeRO-3 parameter offload (``zero_optimization.offload_param``) on CPU gloo ranks.

Every trainable parameter is sharded (persistence threshold 0). The oracle is the same stage-3
run without offload: the shards hold the same low-precision values wherever they live, so the
trained fp32 weights must be bit-identical; and single-process torch within 1e-5. With "nvme"
the first ``max_in_cpu`` elements stay in host memory and the rest are read from swap files
under pytest's temporary directories through a 2-buffer pool, so both paths of a gather run; the pool's
buffers hold less than the whole model, so refreshes are cut into several batches.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.harness import run_distributed
from tests.test_zero_parity import CLIP, GLOBAL_BATCH, LR, STEPS, _check_against_reference, _config
from tests.tiny_models import build_block_model, build_model, make_batches, param_groups, reference_train_model

BLOCK = 4096  # aio.block_size: every swap file is one block
BUFFER = 256  # offload_param.buffer_size: every unit's on-disk shards fit (at most 203 elements, TiedNet at world 1)
MAX_IN_CPU = 100  # the first parameters' shards stay in host memory, the rest go to disk
BUILDERS = {"blocks": build_block_model, "tied": build_model}


def _param(device: str, nvme_path: str, **extra) -> dict:
    if device == "cpu":
        return {"offload_param": {"device": "cpu", **extra}}
    return {"offload_param": {"device": "nvme", "nvme_path": nvme_path, "buffer_count": 2, "buffer_size": BUFFER,
                              "max_in_cpu": MAX_IN_CPU, **extra}}


def _z3(gas: int, *, param: str = "none", optimizer: bool = False, nvme_path: str = "", precision: str = "fp32",
        **extra) -> dict:
    # The flat fp32 gradient partition, as every offloaded run keeps it: at one rank "auto" would
    # take the streamed step, whose norm differs in its last bits (partita/zero/streamed_step.py).
    zero: dict = {"stage3_param_persistence_threshold": 0, "one_rank_gradient_fold": "early"}
    if param != "none":
        zero.update(_param(param, nvme_path, **extra))
    if optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "buffer_count": 2}
    cfg = _config(3, gas, precision, **zero)
    cfg["aio"] = {"block_size": BLOCK}
    return cfg


def _train(engine, first: int, last: int, *, batches: int = STEPS) -> list[float]:
    """Steps ``[first, last)`` of ``batches`` global batches (the torch reference draws ``STEPS``)."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    gas, micro = engine.gradient_accumulation_steps(), engine.train_micro_batch_size_per_gpu()
    xs, ys = make_batches(batches, GLOBAL_BATCH)
    norms = []
    for step in range(first, last):
        for m in range(gas):
            lo = (m * world + rank) * micro
            engine.backward(engine(xs[step][lo : lo + micro], ys[step][lo : lo + micro]))
            engine.step()
        norms.append(engine.get_global_grad_norm())
    return norms


def _full_params(engine, model) -> dict[str, torch.Tensor]:
    """Trained weights, every parameter gathered at once (what GatheredParameters does)."""
    gatherer = engine.zero.gatherer
    sharded = [p for p in model.parameters() if gatherer.is_sharded_param(p)]
    gatherer.gather(sharded)
    params = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    gatherer.release(sharded)
    return params


def _swap_report(gatherer) -> dict:
    """The swap files as they are on disk mid-training, then close and see them go."""
    storage = gatherer.storage
    report: dict = {"files": None}
    if gatherer.shard_location == "nvme":
        itemsize = storage.dtype.itemsize
        report["files"] = sorted(os.path.getsize(storage.store.file_path(k)) for k in storage.swap_files())
        report["expected_files"] = sorted(-(-n * itemsize // BLOCK) * BLOCK for n in storage.swap_files().values())
        report["on_disk_nbytes"] = sum(n * itemsize for n in storage.swap_files().values())
        report["listed"] = len(os.listdir(storage.swap_dir))
        report["bytes_written"] = storage.store.bytes_written
        report["bytes_read"] = storage.store.bytes_read
        report["pool"] = (storage.pool.capacity, storage.pool.numel, storage.pool.peak_in_use, storage.pool.in_use)
        report["resident_numel"] = sum(s.numel() for s in storage.shards)
        swap_dir = storage.swap_dir
        gatherer.close()
        report["removed"] = not os.path.exists(swap_dir)
    return report


def train_runs(runs: list[tuple[str, dict]]) -> list[dict]:
    import partita

    out = []
    for model_name, cfg in runs:
        model = BUILDERS[model_name]()
        engine, optimizer, _, _ = partita.initialize(model=model, model_parameters=param_groups(model), config=cfg)
        gatherer = engine.zero.gatherer
        norms = _train(engine, 0, STEPS)
        sharded = [p for p in model.parameters() if gatherer.is_sharded_param(p)]
        result = {
            "norms": norms, "steps": engine.global_steps, "skipped": engine.skipped_steps,
            "location": gatherer.shard_location, "nbytes": gatherer.shard_nbytes(),
            "freed": bool(sharded) and all(p.untyped_storage().nbytes() == 0 for p in sharded),
            "gathered_between_steps": gatherer.num_gathered(),
            "shards_alias_master": [s is g.master for s, g in zip(gatherer.shards, optimizer.groups)],
            "pinned_bytes": gatherer.storage.pinned_bytes, "prefetches": gatherer.prefetch_count,
            "params": _full_params(engine, model),
        }
        result["swap"] = _swap_report(gatherer)
        out.append(result)
    return out


# (gas, param device, offload_optimizer): every combination the brief asks for.
CASES = [(gas, param, opt) for gas in (1, 2) for param in ("cpu", "nvme") for opt in (False, True)]


def _runs(nvme_path: str) -> list[tuple[str, dict]]:
    runs = []
    for gas in (1, 2):
        runs.append(("blocks", _z3(gas)))  # the oracle
        runs.append(("blocks", _z3(gas, optimizer=True)))  # shards on the device, master on the host
        runs += [("blocks", _z3(gas, param=p, optimizer=o, nvme_path=nvme_path)) for g, p, o in CASES if g == gas]
    # bf16: the shards are cast from the fp32 master; on the host they must be cast identically.
    runs += [("blocks", _z3(2, precision="bf16")), ("blocks", _z3(2, param="cpu", precision="bf16")),
             ("blocks", _z3(2, param="nvme", optimizer=True, nvme_path=nvme_path, precision="bf16"))]
    # TiedNet: the parity model of tests/test_zero_parity.py (one unit: the root).
    runs += [("tied", _z3(2, param="nvme", optimizer=True, nvme_path=nvme_path))]
    # gather_from_master: no 16-bit host copy, gathers read (and cast) the host master itself.
    runs += [("blocks", _z3(2, param="cpu", optimizer=True, precision="bf16", gather_from_master=True)),
             ("blocks", _z3(2, param="cpu", optimizer=True, gather_from_master=True))]
    return runs


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _shard_numel(world: int) -> int:
    """This rank's shard of every trainable BlockNet parameter, padded (the partition)."""
    return sum(-(-p.numel() // world) for p in build_block_model().parameters() if p.requires_grad)


def everything(nvme_path: str, error_path: str | None, save_dir: str | None) -> dict:
    """One spawned run per world size (spawning dominates the time): the training runs, then
    the buffer_size error (world 1) or the checkpoint round trip (world 2)."""
    out = {"runs": train_runs(_runs(nvme_path))}
    if save_dir is not None:
        out["checkpoint"] = checkpoint_round_trip(nvme_path, save_dir)
    if error_path is not None:
        out["error"] = build_with_small_buffer(error_path)  # last: a failed initialize may leave state behind
    return out


@pytest.fixture(scope="module")
def world_1(tmp_path_factory) -> list[dict]:
    nvme, error = tmp_path_factory.mktemp("nvme1"), tmp_path_factory.mktemp("error")
    return run_distributed(everything, 1, str(nvme), str(error), None) + [{"nvme": str(nvme), "error_dir": str(error)}]


@pytest.fixture(scope="module")
def world_2(tmp_path_factory) -> list[dict]:
    nvme, ckpt = tmp_path_factory.mktemp("nvme2"), tmp_path_factory.mktemp("ckpt")
    return run_distributed(everything, 2, str(nvme), None, str(ckpt)) + [{"nvme": str(nvme)}]


@pytest.mark.parametrize("world_size", [1, 2])
def test_offload_param_trains_bit_identically_to_stage3(world_size: int, request) -> None:
    *per_rank, paths = request.getfixturevalue(f"world_{world_size}")
    per_rank = [rank["runs"] for rank in per_rank]
    ref, ref_norms = reference_train_model(build_block_model, num_steps=STEPS, global_batch=GLOBAL_BATCH, lr=LR,
                                           clip=CLIP)
    for results in per_rank:
        blocks = iter(results)
        for gas in (1, 2):
            oracle, host_master = next(blocks), next(blocks)
            cases = [(c, next(blocks)) for c in CASES if c[0] == gas]
            assert oracle["location"] == "accelerator" and oracle["shards_alias_master"] == [True, True]
            for name, want in ref.items():
                assert _rel(oracle["params"][name], want) < 1e-5, (gas, name)
            for got, want in zip(oracle["norms"], ref_norms):
                assert abs(got - want) / want < 1e-5
            # The fixed path: a host master (offload_optimizer) with its shards on the device.
            assert host_master["location"] == "accelerator" and host_master["shards_alias_master"] == [False, False]
            assert host_master["nbytes"] == {"accelerator": 4 * _shard_numel(world_size), "cpu": 0, "nvme": 0}
            for case, result in [((gas, "none", True), host_master)] + cases:
                where = f"{case}, world {world_size}"
                for name, want in oracle["params"].items():
                    assert torch.equal(result["params"][name], want), (where, name)
                assert result["norms"] == oracle["norms"], where
                assert result["steps"] == STEPS and result["skipped"] == 0, where
                assert result["freed"] and result["gathered_between_steps"] == 0, where
                # Prefetch fetches offloaded shards too, at world 1 as well (a host-to-device copy).
                assert (result["prefetches"] > 0) == (world_size == 2 or case[1] != "none"), where
            for (_, param, _), result in cases:
                where = f"{gas}, {param}, world {world_size}"
                assert result["location"] == param and result["pinned_bytes"] == 0, where  # no CUDA: nothing pinned
                # The claim: no shard is held where the parameters live.
                assert result["nbytes"]["accelerator"] == 0, where
                if param == "cpu":
                    assert result["nbytes"] == {"accelerator": 0, "cpu": 4 * _shard_numel(world_size), "nvme": 0}
                else:
                    _check_swap(result, world_size, where)
        bf16_oracle, bf16_cpu, bf16_nvme = next(blocks), next(blocks), next(blocks)
        for result in (bf16_cpu, bf16_nvme):
            for name, want in bf16_oracle["params"].items():
                assert torch.equal(result["params"][name], want), name
        assert bf16_cpu["nbytes"]["cpu"] == 2 * _shard_numel(world_size)
        _check_swap(bf16_nvme, world_size, "bf16")
        tied = next(blocks)
        _check_against_reference(tied, tol=1e-5)
        assert tied["swap"]["removed"]
        for result, want in ((next(blocks), bf16_oracle), (next(blocks), oracle)):  # gather_from_master
            for name, value in want["params"].items():
                assert torch.equal(result["params"][name], value), name
            assert result["norms"] == want["norms"] and result["freed"]
            assert result["shards_alias_master"] == [True, True]
            assert result["nbytes"] == {"accelerator": 0, "cpu": 0, "nvme": 0}  # the master's bytes are the optimizer's
        assert next(blocks, None) is None


    assert os.listdir(paths["nvme"]) == []  # every swap directory removed at close


def _check_swap(result: dict, world: int, where: str) -> None:
    swap, nbytes = result["swap"], result["nbytes"]
    itemsize = 2 if "bf16" in where else 4
    # The first parameters' shards (groups in order, layout order) within max_in_cpu stay in memory.
    assert 0 < swap["resident_numel"] <= MAX_IN_CPU, (where, swap)
    assert nbytes["cpu"] == itemsize * swap["resident_numel"], where
    # Every other shard: one file of whole aio blocks, alive during training, gone after close.
    assert swap["files"] == swap["expected_files"] and swap["listed"] == len(swap["files"]) > 0, (where, swap)
    assert nbytes["nvme"] == sum(swap["files"]), where
    assert swap["resident_numel"] * itemsize + swap["on_disk_nbytes"] == itemsize * _shard_numel(world), where
    # Every file written at start and after each of the STEPS optimizer steps, and at no other time.
    assert swap["bytes_written"] == (STEPS + 1) * swap["on_disk_nbytes"], (where, swap)
    assert swap["bytes_read"] >= swap["on_disk_nbytes"], where  # at least the final gather of everything
    # Without CUDA a buffer's copy is synchronous: it goes back to the pool at once.
    assert swap["pool"] == (2, BUFFER, 1, 0), (where, swap)
    assert swap["removed"], where


# ----------------------------------------------------------------------------- errors


def build_with_small_buffer(nvme_path: str) -> str:
    import partita

    model = build_block_model()
    cfg = _z3(1, param="nvme", nvme_path=nvme_path, buffer_size=50, max_in_cpu=0)
    try:
        partita.initialize(model=model, model_parameters=param_groups(model), config=cfg)
    except ValueError as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def test_a_unit_larger_than_buffer_size_is_refused(world_1) -> None:
    message, paths = world_1[0]["error"], world_1[1]
    # Block 2 (norm 14 + up 88 + down 84 + unused 6 elements): the largest unit, all on disk.
    assert message.startswith("ConfigError: zero_optimization.offload_param.buffer_size=50 elements is too small"), message
    assert "'blocks.2' (Block) has 192 elements" in message and "at least 192" in message, message
    assert "max_in_cpu (now 0)" in message, message
    assert os.listdir(paths["error_dir"]) == []  # nothing left behind


# ----------------------------------------------------------------------------- checkpoints


def checkpoint_round_trip(nvme_path: str, save_dir: str) -> dict:
    """Save after 2 steps with offload_param nvme (and optimizer offload), load into a run
    without any offload, one with the same offload and one gathering from the host master
    (gather_from_master), train 2 more steps; compare with an uninterrupted run."""
    import partita

    out = {}
    saved_cfg = _z3(1, param="nvme", optimizer=True, nvme_path=nvme_path)
    plain_cfg = _z3(1)
    for name, cfg in (("uninterrupted", plain_cfg), ("saved", saved_cfg)):
        model = build_block_model()
        engine, _, _, _ = partita.initialize(model=model, model_parameters=param_groups(model), config=cfg)
        _train(engine, 0, 2, batches=4)
        if name == "saved":
            engine.save_checkpoint(save_dir, tag="nvme")
        _train(engine, 2, 4, batches=4)
        out[name] = _full_params(engine, model)
        engine.zero.gatherer.close()
    from_master_cfg = _z3(1, param="cpu", optimizer=True, gather_from_master=True)
    for name, cfg in (("resumed_plain", plain_cfg), ("resumed_nvme", saved_cfg), ("resumed_from_master", from_master_cfg)):
        model = build_block_model()
        engine, _, _, _ = partita.initialize(model=model, model_parameters=param_groups(model), config=cfg)
        engine.load_checkpoint(save_dir, tag="nvme")
        assert engine.global_steps == 2
        _train(engine, 2, 4, batches=4)
        out[name] = _full_params(engine, model)
        engine.zero.gatherer.close()
    return out


def test_checkpoint_saved_with_offload_param_resumes_without_it(world_2) -> None:
    for rank in world_2[:-1]:
        out = rank["checkpoint"]
        for run in ("saved", "resumed_plain", "resumed_nvme", "resumed_from_master"):
            for name, want in out["uninterrupted"].items():
                assert torch.equal(out[run][name], want), (run, name)
