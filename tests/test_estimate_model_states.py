"""partita.estimate's model states equal partita's real allocation byte for byte (parameters,
masters, optimizer states, gradient partitions, reduce buckets, pinned pools, swap files) at
every stage and offload placement, on 1 and 2 ranks; and the one-rank GPT total of model
states + activations is within 1% of the measured bytes."""

from __future__ import annotations

import os

import pytest
import torch

from partita.estimate import Setup, estimate_memory
from partita.estimate.activations import SAVED_KINDS
from partita.estimate.buffers import reduce_buckets
from partita.estimate.model_info import model_info
from tests._estimate_helpers import _ACT_BATCH, _ACT_SHAPE, _act_model, _batch, saved_tensor_bytes
from tests.harness import run_distributed


# ----------------------------------------------------------------------------- helpers


def _state_model():
    """partita's GPT at odd sizes (padding at world 2), with a frozen parameter and a buffer."""
    from partita.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=13, block_size=5, n_layer=2, n_head=3, n_embd=9))
    model.pos_emb.weight.requires_grad_(False)
    model.register_buffer("extra", torch.ones(7))
    return model


def _state_info():
    model = _state_model()
    return model_info(model, param_groups=model.optimizer_param_groups(0.1))


def _storage_bytes(tensors, skip: set[int] = frozenset()) -> tuple[int, set[int]]:
    """Bytes of the distinct storages of ``tensors`` (freed ZeRO-3 storages count 0)."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values()), set(seen)


def _chosen_fold(engine) -> dict:
    """The estimator's options for the one-rank gradient fold initialize chose ("auto": stream where
    it applies, else by the estimate): what runs is what is estimated."""
    fold = engine.config.zero_optimization.one_rank_gradient_fold
    return {"fold_gradients_at_end": fold in ("end", "stream"), "streamed_step": fold == "stream"}


def _grad_partition(group):
    # The fp32 gradient partition (named master.grad before ZeRO-Offload split it off).
    return group.grad_partition if hasattr(group, "grad_partition") else group.master.grad


def _config(stage: int, dtype: str, optimizer: str, gas: int, extra: dict | None = None) -> dict:
    """A config for one case; ``extra`` holds zero_optimization keys (and "aio" for the root)."""
    extra = dict(extra or {})
    opt = {"type": "AdamW", "params": {"lr": 1e-3}} if optimizer == "AdamW" else {
        "type": "SGD", "params": {"lr": 1e-2, "momentum": 0.9}}
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": gas,
        "optimizer": opt,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 200, "allgather_bucket_size": 150,
                              "stage3_param_persistence_threshold": 30},
        "steps_per_print": 1000,
    }
    if "aio" in extra:
        cfg["aio"] = extra.pop("aio")
    cfg["zero_optimization"].update(extra)
    if dtype != "fp32":
        cfg[dtype] = {"enabled": True}
    return cfg


def _pinned_bytes(engine) -> int:
    """Offload staging pool and NVMe state pool: buffers plus their page of alignment slack."""
    from partita.offload.buffer_pool import BUFFER_ALIGNMENT

    pools = {id(g.host_transfer.pool): g.host_transfer.pool for g in engine.optimizer.groups if g.host_transfer}
    swapper = getattr(engine.optimizer, "swapper", None)
    if swapper is not None:
        pools[id(swapper.pool)] = swapper.pool
    param_pool = getattr(getattr(engine.zero.gatherer, "storage", None), "pool", None)  # offload_param nvme
    if param_pool is not None:
        pools[id(param_pool)] = param_pool
    return sum(pool.total_bytes + pool.capacity * BUFFER_ALIGNMENT for pool in pools.values())


def _swap_file_bytes(nvme_path: str | None, rank: int) -> int:
    if nvme_path is None:
        return 0
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(nvme_path)
               if f"rank{rank}-" in root for name in names)


def _estimated(estimate) -> dict:
    def kind(k: str) -> int:
        return sum(x.nbytes for x in estimate.lines if x.kind == k)

    def items(*names: str) -> int:
        return sum(x.nbytes for x in estimate.lines if x.item.startswith(names))

    both = ("accelerator", "cpu")
    shards = {d: sum(x.nbytes for x in estimate.lines if x.category == "parameters" and "parameter shards" in x.item
                     and x.device == d) for d in ("accelerator", "cpu", "nvme")}
    return {
        "shards": shards,
        "parameters": sum(estimate.by_category(d)["parameters"] for d in both),
        "optimizer states": sum(estimate.by_category(d)["optimizer states"] for d in both),
        "grad_partition": kind("grad_partition") + items("fp32 gradient partition (offloaded)"),
        "full_grads": kind("full_grads"),
        "pinned": items("pinned staging buffers", "NVMe state buffers", "NVMe parameter buffers"),
        "swap_files": estimate.total("nvme"),
    }


def measure_model_states(cases: list[tuple[int, str, str, int, dict | None]], nvme_path: str | None) -> list[dict]:
    """Run one optimizer step per case on this rank; return measured and estimated bytes."""
    import partita

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    out = []
    for stage, dtype, optimizer, gas, extra in cases:
        cfg = _config(stage, dtype, optimizer, gas, extra)
        nvme = False
        for section in ("offload_optimizer", "offload_param"):
            if cfg["zero_optimization"].get(section, {}).get("device") == "nvme":
                cfg["zero_optimization"][section]["nvme_path"] = nvme_path
                nvme = True
        model = _state_model()
        groups = model.optimizer_param_groups(0.1)
        info = model_info(model, param_groups=groups)
        engine, _, _, _ = partita.initialize(model=model, model_parameters=groups, config=cfg)
        estimate = estimate_memory(info, Setup.from_config(cfg, world_size=world, **_chosen_fold(engine)))
        reducer = engine.zero.reducer
        held = [0]
        original_finish = reducer.finish_backward

        def finish_backward():
            # Full-size gradients are largest right before the reduction finishes.
            held[0] = max(held[0], _storage_bytes(p.grad for p in model.parameters() if p.grad is not None)[0])
            original_finish()

        reducer.finish_backward = finish_backward
        partition = 0
        g = torch.Generator().manual_seed(rank)
        for _ in range(gas):
            x = torch.randint(0, 13, (2, 5), generator=g)
            engine.backward(engine(x, x)[1])
            partition = sum(_grad_partition(grp).untyped_storage().nbytes() for grp in engine.optimizer.groups
                            if _grad_partition(grp) is not None)
            engine.step()
        engine.finish_pending_step()  # a delayed update: its states and upload copy exist once it lands
        opt = engine.optimizer
        # A stage-3 group whose master is on the device has no shard copy: gathers read the master.
        shards = [s for s, grp in zip(engine.zero.gatherer.shards, engine.optimizer.groups) if s is not grp.master] \
            if engine.zero.gatherer is not None else []
        # Each storage once, under the first category holding it: parameters, then the master.
        upload_copies = [grp.upload_copy for grp in opt.groups if grp.upload_copy is not None]  # delayed update
        params, counted = _storage_bytes(list(model.parameters()) + list(model.buffers()) + list(shards) + upload_copies)
        master, _ = _storage_bytes([grp.master for grp in opt.groups], skip=counted)
        state_tensors = [t for st in opt.inner.state.values() for t in st.values() if torch.is_tensor(t)]
        states, _ = _storage_bytes(state_tensors, skip=counted | {grp.master.untyped_storage().data_ptr()
                                                                  for grp in opt.groups})
        gatherer = engine.zero.gatherer
        shard_bytes = gatherer.shard_nbytes() if gatherer is not None else dict.fromkeys(("accelerator", "cpu", "nvme"), 0)
        swap_files = _swap_file_bytes(nvme_path if nvme else None, rank)
        pinned = _pinned_bytes(engine)
        if gatherer is not None:
            gatherer.close()  # later cases' swap files are counted alone
        if getattr(opt, "swapper", None) is not None:
            opt.swapper.close()
        out.append({
            "case": (stage, dtype, optimizer, gas, bool(extra)),
            "measured": {"shards": shard_bytes, "parameters": params, "optimizer states": master + states,
                         "grad_partition": partition, "full_grads": held[0], "pinned": pinned,
                         "swap_files": swap_files},
            "estimated": _estimated(estimate),
            "buckets": ([b.column for b in reduce_buckets(info, estimate.setup)],
                        [b.shard_numel for b in reducer._buckets]),
        })
    return out


_CASES = [
    (stage, dtype, optimizer, gas, None)
    for stage in (0, 1, 2, 3)
    for dtype in ("fp32", "bf16")
    for optimizer in ("AdamW", "SGD")
    for gas in ((1, 2) if stage <= 1 and dtype == "bf16" and optimizer == "AdamW" else (1,))
]
_OFFLOAD_CASES = [
    (2, "bf16", "AdamW", 1, {"offload_optimizer": {"device": "cpu", "buffer_count": 2}}),
    (1, "fp32", "AdamW", 1, {"offload_optimizer": {"device": "cpu", "buffer_count": 2}}),
    (3, "bf16", "AdamW", 1, {"offload_optimizer": {"device": "cpu", "buffer_count": 2, "ratio": 0.5}}),
    (1, "fp32", "SGD", 1, {"offload_optimizer": {"device": "cpu", "buffer_count": 2, "ratio": 0.3}}),
    (2, "bf16", "AdamW", 1, {"offload_optimizer": {"device": "nvme", "buffer_count": 2},
                             "sub_group_size": 1000, "aio": {"block_size": 4096}}),
]
# One rank with the delayed update: gradients go down during backward (none held at its end),
# and the update's upload copy lives in host memory.
_DELAYED_CASES = [
    (2, "bf16", "AdamW", 1, {"offload_optimizer": {"device": "cpu", "buffer_count": 2, "delayed_param_update": True}}),
]
# Where stage 3 keeps its shards (partita/offload/param_offload.py): on the accelerator also for a
# host master (a copy even in fp32), in host memory, or part in memory (max_in_cpu) and part in
# swap files. The persistence threshold is 30: the smallest parameters are never swapped.
_SHARD_CASES = [
    (3, "fp32", "AdamW", 1, {"offload_optimizer": {"device": "cpu", "buffer_count": 2}}),
    (3, "bf16", "AdamW", 1, {"offload_param": {"device": "cpu"}}),
    (3, "fp32", "AdamW", 1, {"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu", "buffer_count": 2}}),
    (3, "bf16", "AdamW", 1, {"offload_param": {"device": "nvme", "buffer_count": 2, "buffer_size": 2000, "max_in_cpu": 300},
                             "aio": {"block_size": 4096}}),
    (3, "fp32", "SGD", 1, {"offload_param": {"device": "nvme", "buffer_count": 3, "buffer_size": 1500, "max_in_cpu": 0},
                           "offload_optimizer": {"device": "cpu", "buffer_count": 2, "ratio": 0.5}, "aio": {"block_size": 8192}}),
    # gather_from_master: the host master is the only copy; half of it (ratio 0.5) stays on the device,
    # and that half keeps its bf16 host shard.
    (3, "bf16", "AdamW", 1, {"offload_param": {"device": "cpu", "gather_from_master": True},
                             "offload_optimizer": {"device": "cpu", "buffer_count": 2, "ratio": 0.5}}),
]


def measure_everything(cases: list, with_total: bool, nvme_path: str | None) -> dict:
    """One spawned run per world size (spawning dominates the test time): every case, and on
    one rank the GPT total of model states + activations."""
    return {"states": measure_model_states(cases, nvme_path), "total": measure_total() if with_total else None}


@pytest.fixture(scope="module")
def world_1() -> dict:
    return run_distributed(measure_everything, 1, _CASES + _OFFLOAD_CASES[:2] + _DELAYED_CASES, True, None)[0]


@pytest.fixture(scope="module")
def world_2(tmp_path_factory) -> list[dict]:
    nvme = tmp_path_factory.mktemp("nvme")
    return run_distributed(measure_everything, 2, _CASES + _OFFLOAD_CASES + _SHARD_CASES, False, str(nvme))


def _check_exact(results: list[dict]) -> None:
    for result in results:
        assert result["measured"] == result["estimated"], result["case"]
        estimated_buckets, real_buckets = result["buckets"]
        assert estimated_buckets == real_buckets, result["case"]


# ----------------------------------------------------------------------------- (1) exact model states


def test_model_states_exact_world_1(world_1):
    results = world_1["states"]
    _check_exact(results)
    by_case = {r["case"]: r["measured"] for r in results}
    trainable = _state_info().trainable_numel
    # fp32 with one shard: the parameters are views of the master (one fp32 copy, counted as
    # parameters); Adam adds 8 bytes per element and a 4-byte step per group (2 groups).
    fp32 = by_case[(0, "fp32", "AdamW", 1, False)]
    assert fp32["parameters"] == 4 * trainable + 4 * 5 * 9 + 4 * 7  # + frozen pos_emb + buffer
    assert fp32["optimizer states"] == 8 * trainable + 2 * 4
    assert by_case[(0, "bf16", "AdamW", 2, False)]["full_grads"] == 2 * trainable


def test_model_states_exact_world_2(world_2):
    results = [[r for r in rank["states"] if not r["case"][4]] for rank in world_2]
    for rank_results in results:
        _check_exact(rank_results)
    # Padding: at world 2 every odd-sized parameter gains one element per shard layout.
    stage2 = {r["case"]: r["measured"] for r in results[0]}[(2, "bf16", "AdamW", 1, False)]
    info = _state_info()
    unpadded = sum((p.numel + 1) // 2 for p in info.params())
    assert stage2["grad_partition"] == 4 * unpadded


def test_offload_model_states_exact(world_2):
    # ZeRO-Offload / -Infinity (partita/offload): master, gradient partition and states in host
    # memory (ratio < 1: part of each group stays on the device), pinned pools, NVMe swap files.
    for rank in world_2:
        offloaded = rank["states"][len(_CASES) : len(_CASES) + len(_OFFLOAD_CASES)]
        assert all(r["case"][4] for r in offloaded)
        _check_exact(offloaded)
        nvme = offloaded[-1]["measured"]
        assert nvme["swap_files"] == 6 * 4096 and nvme["pinned"] == 2 * (64 * 2**20 + 4096) + 2 * (4000 + 4096)


def test_stage3_shard_bytes_by_device_exact(world_2):
    # Every case (and every stage-3 case above) compares shard bytes by location with the estimate;
    # here, the figures by hand for this model (GPT n_embd 9, 2 layers, vocab 13; pos_emb frozen).
    info = _state_info()
    share = sum((p.numel + 1) // 2 for p in info.params())  # this rank's partition (world 2, padded)
    # Non-persistent shards (more than 30 elements), groups in order, layout order (reverse registration).
    swapped = [(p.numel + 1) // 2 for group in info.groups for p in sorted(group, key=lambda p: -p.order)
               if p.numel > 30]
    resident = 0
    for kept, numel in enumerate(swapped):
        if resident + numel > 300:
            break
        resident += numel
    for rank in world_2:
        results = rank["states"][len(_CASES) + len(_OFFLOAD_CASES) :]
        assert len(results) == len(_SHARD_CASES)
        _check_exact(results)
        host_master, cpu_bf16, cpu_fp32, nvme_bf16, nvme_fp32, from_master = [r["measured"]["shards"] for r in results]
        assert host_master == {"accelerator": 4 * share, "cpu": 0, "nvme": 0}
        assert cpu_bf16 == {"accelerator": 0, "cpu": 2 * share, "nvme": 0}
        assert cpu_fp32 == {"accelerator": 0, "cpu": 4 * share, "nvme": 0}
        # bf16, max_in_cpu 300: a prefix of the swapped shards in memory, one 4096-byte file each for the rest.
        assert 0 < kept < len(swapped)
        assert nvme_bf16 == {"accelerator": 0, "cpu": 2 * resident, "nvme": 4096 * (len(swapped) - kept)}
        # fp32, max_in_cpu 0: every non-persistent shard in its own 8192-byte-block file.
        assert nvme_fp32 == {"accelerator": 0, "cpu": 0, "nvme": sum(-(-4 * n // 8192) * 8192 for n in swapped)}
        assert results[4]["measured"]["pinned"] == 2 * (64 * 2**20 + 4096) + 3 * (4 * 1500 + 4096)
        assert 0 < from_master["cpu"] < 2 * share and from_master["accelerator"] == from_master["nvme"] == 0


# ----------------------------------------------------------------------------- GPT total on one rank


def measure_total() -> tuple[int, int]:
    """One bf16 ZeRO-2 step of the GPT on one rank: measured model states + saved activations,
    and the estimator's model states + saved activations."""
    import partita

    model = _act_model(torch.float32, None)
    groups = model.optimizer_param_groups(0.1)
    cfg = {"train_micro_batch_size_per_gpu": _ACT_BATCH, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 2},
           "steps_per_print": 1000}
    engine, _, _, _ = partita.initialize(model=model, model_parameters=groups, config=cfg)
    estimate = estimate_memory(_ACT_SHAPE, Setup.from_config(cfg, world_size=1, **_chosen_fold(engine)))
    idx, targets = _batch()
    saved = saved_tensor_bytes(engine, idx, targets)
    logits, loss = engine(idx, targets)
    grads = [0]
    original = engine.zero.reducer.finish_backward

    def finish():
        grads[0] = _storage_bytes(p.grad for p in model.parameters() if p.grad is not None)[0]
        original()

    engine.zero.reducer.finish_backward = finish
    engine.backward(loss)
    partition = sum(_grad_partition(g).untyped_storage().nbytes() for g in engine.optimizer.groups
                    if _grad_partition(g) is not None)  # none with one_rank_gradient_fold "stream"
    engine.step()
    opt = engine.optimizer
    params, counted = _storage_bytes(model.parameters())
    master, _ = _storage_bytes([g.master for g in opt.groups], skip=counted)
    states, _ = _storage_bytes([t for st in opt.inner.state.values() for t in st.values() if torch.is_tensor(t)])
    measured = params + master + states + partition + grads[0] + saved
    predicted = estimate.model_states("accelerator") + sum(x.nbytes for x in estimate.lines if x.kind in SAVED_KINDS)
    return measured, predicted


def test_total_within_ten_percent(world_1):
    measured, predicted = world_1["total"]
    assert abs(predicted - measured) <= 0.10 * measured, (measured, predicted)
    assert abs(predicted - measured) <= 0.01 * measured  # in fact within 1% at this size
