"""The per-step scale precompute of the FP8 all-gather (partita/zero/fp8_gather.py, [Note: per-step
scales]) on 2 gloo ranks: one all-reduce for every FP8 weight instead of one per gather (counted by
the comms logger), and the wire bytes, scales and rebuilt weights bit-identical to the per-gather path."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.harness import run_distributed

pytest.importorskip("torchao.float8")

SHAPES = [(64, 32), (32, 64), (48, 16)]  # three FP8 weights; 48 x 16 = 768 elements
UNITS = [[0, 1], [2]]  # two units: weights 0 and 1 gathered together, weight 2 alone
ORDER = [0, 1, 1, 0]  # a step gathers each unit in its forward and again in its backward


def _shards(rank: int, world: int) -> tuple[list[torch.nn.Parameter], list[torch.Tensor]]:
    """The weights (bf16, the same on every rank) and this rank's zero-padded flat shard of each."""
    torch.manual_seed(0)
    weights = [torch.nn.Parameter((torch.randn(shape) * (i + 1)).to(torch.bfloat16)) for i, shape in enumerate(SHAPES)]
    shards = []
    for w in weights:
        flat = w.detach().reshape(-1)
        per = -(-flat.numel() // world)
        padded = torch.cat([flat, flat.new_zeros(per * world - flat.numel())])
        shards.append(padded[rank * per : (rank + 1) * per].clone())
    return weights, shards


def _step(weights, shards, *, precompute: bool | str, masters=None) -> dict:
    """One step's unit gathers (ORDER), with or without the precompute; records the all-reduces."""
    import torch.distributed as dist

    from partita.distributed import collectives
    from partita.monitor.comms_logger import COMMS_LOGGER
    from partita.zero.fp8_gather import forget_fp8_scales, precompute_fp8_scales, precomputed_fp8_scales, start_fp8_all_gather

    forget_fp8_scales(weights)
    COMMS_LOGGER.reset()
    COMMS_LOGGER.enabled = True
    if precompute is True:  # after the optimizer step: one collective for all three weights
        precompute_fp8_scales(list(zip(weights, shards)), group=None)
    if precompute == "from master":  # the gather casts the fp32 master: the amax of the cast shard
        forget_fp8_scales(weights)
        precompute_fp8_scales(list(zip(weights, masters)), group=None, dtype=torch.bfloat16)
    wires, rebuilt, scales = [], [], []
    for unit in ORDER:
        members = UNITS[unit]
        local = torch.cat([shards[i] for i in members])
        spans, column = [], 0
        for i in members:
            spans.append((column, shards[i].numel()))
            column += shards[i].numel()
        stored = precomputed_fp8_scales([weights[i] for i in members]) if precompute else None
        work, wire, decoder = start_fp8_all_gather(local, spans, size=dist.get_world_size(), group=None,
                                                   purpose="test", scales=stored)
        collectives.wait(work, purpose="test")  # through partita's wait: the comms logger sees it complete
        wires.append(wire.clone())
        rebuilt.append(decoder.dequantize(wire))
        scales.append(decoder.scales.clone())
    COMMS_LOGGER.enabled = False
    records = COMMS_LOGGER.records()
    return {"wires": wires, "rebuilt": rebuilt, "scales": scales,
            "all_reduces": [r.purpose for r in records if r.op == "all_reduce"],
            "gathered_bytes": sum(r.message_bytes for r in records if r.op == "all_gather_into_tensor")}


def _on_rank() -> dict:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    weights, shards = _shards(dist.get_rank(), dist.get_world_size())
    # fp32 "masters" whose bf16 cast is the shard, with values bf16 does not hold (the cast rounds)
    masters = [s.float() + s.float() * 2**-12 for s in shards]
    assert all(torch.equal(m.to(torch.bfloat16), s) for m, s in zip(masters, shards))
    assert not all(torch.equal(m, s.float()) for m, s in zip(masters, shards))
    out = {"per_gather": _step(weights, shards, precompute=False), "precomputed": _step(weights, shards, precompute=True),
           "from_master": _step(weights, shards, precompute="from master", masters=masters)}
    from partita.zero.fp8_gather import forget_fp8_scales, precompute_fp8_scales, precomputed_fp8_scales, start_fp8_all_gather

    out["stored"] = precomputed_fp8_scales(weights)  # left by the last precomputed step
    precompute_fp8_scales(list(zip(weights, masters)), group=None)  # no dtype: the fp32 amax, another scale
    out["fp32_scales"] = precomputed_fp8_scales(weights)
    forget_fp8_scales(weights)
    out["after_forget"] = precomputed_fp8_scales(weights)
    out["refresh"] = _refresh_cases(weights, shards, masters)
    try:
        start_fp8_all_gather(shards[0], [(0, shards[0].numel())], size=2, group=None, purpose="test",
                             scales=torch.ones(2))
    except ValueError as error:
        out["bad_scales"] = str(error)
    out["expected"] = [_expected(w) for w in weights]
    out["weights"] = [w.detach().clone() for w in weights]
    dist.destroy_process_group()
    return out


def _refresh_cases(weights, shards, masters) -> dict:
    """refresh_fp8_scales, the gatherer's hook: only marked weights, from the shard views it is handed;
    forgotten when the shards are off the device or in several dtypes."""
    from partita.monitor.comms_logger import COMMS_LOGGER
    from partita.zero.fp8_gather import (
        _MARK, forget_fp8_scales, precomputed_fp8_scales, refresh_fp8_scales, refresh_gatherer_fp8_scales,
    )

    plain = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))  # not marked: never gets a scale
    for w in weights:
        setattr(w, _MARK, True)
    index = {id(w): i for i, w in enumerate(weights)}
    out = {}
    COMMS_LOGGER.reset()
    COMMS_LOGGER.enabled = True
    refresh_fp8_scales([plain, *weights], lambda p: (masters[index[id(p)]], torch.bfloat16), group=None)
    out["scales"] = precomputed_fp8_scales(weights)
    out["plain"] = precomputed_fp8_scales([plain])
    out["all_reduces"] = [r.purpose for r in COMMS_LOGGER.records() if r.op == "all_reduce"]
    refresh_fp8_scales(weights, None, group=None)  # offloaded shards
    out["offloaded"] = precomputed_fp8_scales(weights)
    refresh_fp8_scales(weights, lambda p: (shards[index[id(p)]], torch.bfloat16), group=None)
    refresh_fp8_scales(weights, lambda p: (shards[index[id(p)]], torch.bfloat16 if p is weights[0] else torch.float16),
                       group=None)
    out["mixed"] = precomputed_fp8_scales(weights)
    # The gatherer's layout: a bf16 group whose device shard is the fp32 master (the gather casts it), and
    # a group gathered over another process group (experts): only the first group's weights get scales.
    forget_fp8_scales(weights)
    spec = [SimpleNamespace(partition_offset=0, shard_numel=m.numel()) for m in masters]
    other = SimpleNamespace(comm=SimpleNamespace(process_group=object()), model_dtype=torch.bfloat16)
    layout = {"where": {w: (i if i < 2 else 2, spec[i]) for i, w in enumerate(weights)},
              "groups": [SimpleNamespace(comm=SimpleNamespace(process_group=None), model_dtype=torch.bfloat16)] * 2 + [other],
              "storage": SimpleNamespace(location="accelerator", shards=masters)}
    refresh_gatherer_fp8_scales(**layout, group=None, world_size=2)
    out["gatherer"] = [precomputed_fp8_scales([w]) for w in weights]
    forget_fp8_scales(weights)
    refresh_gatherer_fp8_scales(**layout, group=None, world_size=1)
    out["one_rank"] = precomputed_fp8_scales(weights[:2])
    COMMS_LOGGER.enabled = False
    out["calls"] = len([r for r in COMMS_LOGGER.records() if r.op == "all_reduce"])
    for w in weights:
        delattr(w, _MARK)
    forget_fp8_scales(weights)
    return out


def _expected(weight: torch.Tensor) -> torch.Tensor:
    """The whole weight cast to FP8 in one process with torchao's tensorwise scale, rebuilt in bf16."""
    from torchao.float8.float8_utils import amax_to_scale, to_fp8_saturated

    scale = amax_to_scale(weight.detach().abs().max().to(torch.float32), torch.float8_e4m3fn)
    return (to_fp8_saturated(weight.detach().float() * scale, torch.float8_e4m3fn).float() / scale).to(weight.dtype)


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_distributed(_on_rank, 2)


def test_one_all_reduce_per_step_instead_of_one_per_gather(ranks) -> None:
    for rank in ranks:
        assert len(rank["per_gather"]["all_reduces"]) == len(ORDER)  # 4: every unit gather all-reduces
        assert rank["per_gather"]["all_reduces"] == ["fp8 amax test"] * len(ORDER)
        assert rank["precomputed"]["all_reduces"] == ["fp8 amax precompute (every FP8-gathered weight)"]
        # The wire itself is unchanged: the same FP8 bytes gathered.
        assert rank["precomputed"]["gathered_bytes"] == rank["per_gather"]["gathered_bytes"] > 0


@pytest.mark.parametrize("path", ["precomputed", "from_master"])
def test_precomputed_gathers_are_bit_identical_to_per_gather(ranks, path) -> None:
    # from_master: the scales computed from fp32 masters rounded to bf16, as a gather that casts the master sends.
    for rank in ranks:
        per, pre = rank["per_gather"], rank[path]
        for a, b in zip(per["scales"], pre["scales"]):
            assert torch.equal(a, b)
        for a, b in zip(per["wires"], pre["wires"]):
            assert torch.equal(a, b)
        for a, b in zip(per["rebuilt"], pre["rebuilt"]):
            assert torch.equal(a, b)


def test_precomputed_gather_rebuilds_the_single_process_fp8_cast(ranks) -> None:
    # Unit 0's gather of weights 0 and 1: rows are ranks, each weight's shards side by side.
    for rank in ranks:
        rows = rank["precomputed"]["rebuilt"][0]
        column = 0
        for i in UNITS[0]:
            numel = SHAPES[i][0] * SHAPES[i][1]
            per = -(-numel // 2)
            whole = rows[:, column : column + per].reshape(-1)[:numel].view(SHAPES[i])
            assert torch.equal(whole, rank["expected"][i]), i
            assert not torch.equal(whole, rank["weights"][i])  # the FP8 cast did round
            column += per


def test_forget_and_bad_scales(ranks) -> None:
    for rank in ranks:
        assert rank["stored"] is not None and rank["stored"].shape == (len(SHAPES),)
        assert torch.equal(rank["stored"], torch.cat(rank["precomputed"]["scales"][:2]))  # units 0 and 1
        assert rank["after_forget"] is None
        assert not torch.equal(rank["fp32_scales"], rank["stored"])  # why precompute_fp8_scales takes dtype
        assert rank["bad_scales"] == (
            "start_fp8_all_gather got (2,) scales for 1 weights; pass one precomputed scale per span "
            "(precomputed_fp8_scales of the gathered weights, in span order), or None")


def test_refresh_hook(ranks) -> None:
    for rank in ranks:
        refresh = rank["refresh"]
        # Marked weights only, one all-reduce, the per-gather path's scales (from the masters, rounded to bf16).
        assert refresh["all_reduces"] == ["fp8 amax precompute (every FP8-gathered weight)"]
        assert torch.equal(refresh["scales"], torch.cat(rank["per_gather"]["scales"][:2]))
        assert refresh["plain"] is None
        assert refresh["offloaded"] is None  # shards off the device: forgotten, no collective
        assert refresh["mixed"] is None  # several dtypes: forgotten, no collective
        assert refresh["calls"] == 3  # the first refresh, the bf16 one before the mixed case, the gatherer's
        per_weight = torch.cat(rank["per_gather"]["scales"][:2])
        assert [s is not None and torch.equal(s, per_weight[i : i + 1]) for i, s in enumerate(refresh["gatherer"][:2])] == [True, True]
        assert refresh["gatherer"][2] is None  # gathered over another process group
        assert refresh["one_rank"] is None  # one rank: nothing gathered, nothing precomputed
