"""ZeRO++ hpZ (zero_hpz_partition_size, partita/zero/hpz.py): the backward's unit gathers come from
secondary copies inside groups of G ranks. The gathered weights are the same bytes as plain ZeRO-3's,
so every loss must be bit-identical; the collectives are checked at the moment they are issued
(forward or backward, whole ZeRO group or hpZ group) and in the comms logger's rows. One 4-rank
launch (G=2) and one 8-rank launch (G=4, resuming the 4-rank checkpoint) run every case."""

from __future__ import annotations

import logging
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from partita.config.base import ConfigError
from tests.harness import run_distributed

WIDTH, HIDDEN, CLASSES, STEPS, GLOBAL_BATCH = 64, 128, 10, 4, 16
SHARDED = 6 * WIDTH * HIDDEN  # the blocks' six weights; biases and the head stay whole (threshold 1000)
HPZ = "ZeRO-3 parameter all-gather within the hpZ group"
WORLD_GATHERS = ("ZeRO-3 parameter all-gather", "int8 ZeRO-3 parameter all-gather")


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.down = nn.Linear(HIDDEN, WIDTH)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(torch.tanh(self.up(h)))


class _Net(nn.Module):
    """Three blocks (ZeRO-3 units). With ``recompute`` the first two are activation-checkpointed as one
    region and the third alone: backward recomputes the region from its start, so the first block's
    forward runs inside backward before its own backward hook, and its gather is the recompute's."""

    def __init__(self, recompute: bool, frozen_middle: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(3))
        self.head = nn.Linear(WIDTH, CLASSES)
        self.recompute = recompute
        if frozen_middle:
            self.blocks[1].requires_grad_(False)  # gradients still flow through it to blocks[0]

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.recompute:
            x = checkpoint(lambda h: self.blocks[1](self.blocks[0](h)), x, use_reentrant=False)
            x = checkpoint(self.blocks[2], x, use_reentrant=False)
        else:
            for block in self.blocks:
                x = block(x)
        return F.cross_entropy(self.head(x).float(), y)


def _config(hpz: int, *, accumulation: int = 1, qwz: bool = False, offload: bool = False, reuse: int = 10**9) -> dict:
    # offload: the shards in host memory (offload_param) and the optimizer there too: gathers copy them up first.
    places = {"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}} if offload else {}
    return {
        "train_batch_size": GLOBAL_BATCH,
        "gradient_accumulation_steps": accumulation,
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-3}},
        "gradient_clipping": 0.5,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1000,
                              "reduce_bucket_size": 100_000, "zero_hpz_partition_size": hpz,
                              "zero_quantized_weights": qwz, "stage3_max_reuse_distance": reuse, **places},
        "comms_logger": {"enabled": True, "debug": True},
        "steps_per_print": 10_000,
    }


class _Issued:
    """Every parameter all-gather as it is issued: (purpose, group size, bytes, in backward), and
    which of them, inside backward, a unit's forward pre-hook issued (a recompute's gather) or a
    prefetch did."""

    def __init__(self, monkeypatch) -> None:
        from partita.distributed import collectives
        from partita.zero.units import in_backward_pass

        self.calls: list[tuple[str, int, int, bool]] = []
        self.recomputed: list[str] = []
        self.prefetched: list[str] = []
        real = collectives.all_gather_into_tensor

        def recording(output, input, *, group, purpose, async_op=False):
            import torch.distributed as dist

            if "parameter all-gather" in purpose:
                size = dist.get_world_size(group)
                self.calls.append((purpose, size, output.numel() * output.element_size(), in_backward_pass()))
                callers, frame = set(), sys._getframe(1)
                while frame is not None:
                    callers.add(frame.f_code.co_name)
                    frame = frame.f_back
                if in_backward_pass() and "_pre_forward" in callers:
                    self.recomputed.append(purpose)
                if in_backward_pass() and "_prefetch" in callers:
                    self.prefetched.append(purpose)
            return real(output, input, group=group, purpose=purpose, async_op=async_op)

        monkeypatch(collectives, "all_gather_into_tensor", recording)

    def bytes(self, purposes, *, backward: bool) -> int:
        return sum(n for purpose, _, n, bw in self.calls if purpose in purposes and bw is backward)


def _train(cfg: dict, *, recompute: bool = False, steps: range = range(STEPS), save: str | None = None,
           load: str | None = None, frozen_middle: bool = False) -> dict:
    import torch.distributed as dist

    import partita
    from partita.monitor.comms_logger import COMMS_LOGGER

    patches: list = []
    issued = _Issued(lambda obj, name, value: (patches.append((obj, name, getattr(obj, name))),
                                               setattr(obj, name, value)))
    try:
        torch.manual_seed(0)
        if frozen_middle:  # frozen parameters stay sharded only when built under zero.Init
            with partita.zero.Init(config_dict_or_path=cfg):
                model = _Net(recompute, frozen_middle=True)
        else:
            model = _Net(recompute)
        trained = [p for p in model.parameters() if p.requires_grad]
        engine, _, _, _ = partita.initialize(model=model, model_parameters=trained, config=cfg)
        if load is not None:
            engine.load_checkpoint(load, tag="t")
        COMMS_LOGGER.reset()
        issued.calls.clear()
        issued.recomputed.clear()
        issued.prefetched.clear()
        g = torch.Generator().manual_seed(3)
        xs = torch.randn(1, GLOBAL_BATCH, WIDTH, generator=g).expand(STEPS, -1, -1)  # one batch each step:
        ys = torch.randint(0, CLASSES, (1, GLOBAL_BATCH), generator=g).expand(STEPS, -1)  # the loss falls
        rank, world, micro = dist.get_rank(), dist.get_world_size(), engine.train_micro_batch_size_per_gpu()
        accumulation = engine.gradient_accumulation_steps()
        gatherer = engine.zero.gatherer
        losses, means, held = [], [], []
        for step in steps:
            total = torch.zeros(())
            for m in range(accumulation):
                lo = (m * world + rank) * micro
                loss = engine(xs[step][lo: lo + micro], ys[step][lo: lo + micro])
                held.append(gatherer.hpz.nbytes() if gatherer.hpz is not None else 0)  # between forward and backward
                engine.backward(loss)
                held.append(gatherer.hpz.nbytes() if gatherer.hpz is not None else 0)  # after: dropped
                engine.step()
                total += loss.detach().float() / accumulation
            losses.append(float(total))
            dist.all_reduce(total)
            means.append(float(total) / world)  # the global batch's loss, comparable across world sizes
            if save is not None and step == 1:
                engine.save_checkpoint(save, tag="t")
        rows = {(row.purpose, row.group_size): row.message_bytes * row.count for row in COMMS_LOGGER.summary().rows
                if row.purpose and "parameter all-gather" in row.purpose}
        out = {"losses": losses, "means": means, "held": held, "rows": rows,
               "world_fwd": issued.bytes(WORLD_GATHERS, backward=False),
               "world_bwd": issued.bytes(WORLD_GATHERS, backward=True),
               "group_fwd": issued.bytes((HPZ,), backward=False), "group_bwd": issued.bytes((HPZ,), backward=True),
               "group_sizes": sorted({size for purpose, size, _, _ in issued.calls if purpose == HPZ}),
               "recomputed": list(issued.recomputed), "prefetched": list(issued.prefetched)}
        # A gather asked for outside a unit (GatheredParameters, exports) is the exact world gather.
        from partita.zero.gathered import iter_fp32_master

        masters = {p: full.clone() for p, full in iter_fp32_master(engine.zero) if gatherer.is_sharded_param(p)}
        before = len(issued.calls)
        gatherer.gather(list(masters))
        exact = all(torch.equal(p.detach(), full.to(p.dtype)) for p, full in masters.items())
        gatherer.release(list(masters))
        out["outside"] = [(purpose, size) for purpose, size, _, _ in issued.calls[before:]]
        return {**out, "exact": exact}
    finally:
        for obj, name, value in reversed(patches):
            setattr(obj, name, value)


def _refused(cfg: dict) -> str:
    import partita

    model = _Net(False)
    try:
        partita.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    except ConfigError as error:
        return str(error)
    return "accepted"


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _four_ranks(save_dir: str) -> dict:
    warnings = _Warnings()
    logging.getLogger("partita").addHandler(warnings)
    out = {}
    for name, hpz in (("plain", 1), ("hpz", 2)):
        out[name] = _train(_config(hpz))
        out[f"{name}_recompute"] = _train(_config(hpz), recompute=True)
        out[f"{name}_ga2"] = _train(_config(hpz, accumulation=2), recompute=True,
                                    save=f"{save_dir}/{name}" if name == "hpz" else None)
        out[f"{name}_qwz"] = _train(_config(hpz, qwz=True))
        out[f"{name}_frozen"] = _train(_config(hpz), frozen_middle=True)
        # Shards in host memory, and every unit freed at the end of its forward (so backward prefetches).
        out[f"{name}_offload"] = _train(_config(hpz, offload=True, reuse=0))
    out["resumed"] = _train(_config(2, accumulation=2), recompute=True, steps=range(2, STEPS), load=f"{save_dir}/hpz")
    out["bad"] = _refused(_config(3))
    logging.getLogger("partita").removeHandler(warnings)
    out["warnings"] = [m for m in warnings.messages if "zero_hpz_partition_size" in m]
    return out


def _eight_ranks(save_dir: str) -> dict:
    # The 4-rank checkpoint (G=2) resumed on 8 ranks with G=4, next to plain ZeRO-3 resuming it.
    resume = {"steps": range(2, STEPS), "load": f"{save_dir}/hpz", "recompute": True}
    return {"hpz": _train(_config(4), steps=range(2)), "plain": _train(_config(1), steps=range(2)),
            "hpz_resumed": _train(_config(4, accumulation=2), **resume),
            "plain_resumed": _train(_config(1, accumulation=2), **resume),
            "bad": _refused(_config(3))}


@pytest.fixture(scope="module")
def save_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("hpz"))


@pytest.fixture(scope="module")
def four(save_dir) -> list[dict]:
    return run_distributed(_four_ranks, 4, save_dir)


@pytest.fixture(scope="module")
def eight(four, save_dir) -> list[dict]:  # after ``four``: it resumes that launch's checkpoint
    return run_distributed(_eight_ranks, 8, save_dir)


CASES = ("", "_recompute", "_ga2", "_qwz", "_frozen", "_offload")


def test_losses_are_bit_identical_to_plain_zero3(four) -> None:
    for rank in four:
        for case in CASES:
            plain, hpz = rank[f"plain{case}"]["losses"], rank[f"hpz{case}"]["losses"]
            assert hpz == plain, (case, hpz, plain)
        assert rank["plain"]["losses"][-1] < rank["plain"]["losses"][0]  # it trains: not two flat lines
        assert rank["plain_qwz"]["losses"] != rank["plain"]["losses"]  # qwZ really rounds (hpZ keeps its values)


def test_backward_gathers_stay_inside_the_group(four) -> None:
    for rank in four:
        for case in CASES:
            plain, hpz = rank[f"plain{case}"], rank[f"hpz{case}"]
            assert plain["world_bwd"] > 0 and plain["group_fwd"] == plain["group_bwd"] == 0, case
            assert hpz["world_bwd"] == 0, case  # no backward parameter byte over the whole ZeRO group
            assert hpz["world_fwd"] == plain["world_fwd"] > 0, case  # the forward's world gathers unchanged
            assert hpz["group_fwd"] == 0 and hpz["group_bwd"] > 0 and hpz["group_sizes"] == [2], case
        # Unquantized, the group gathers are the very gathers plain ZeRO-3 ran over the world in backward.
        for case in ("", "_recompute", "_ga2", "_frozen", "_offload"):
            assert rank[f"hpz{case}"]["group_bwd"] == rank[f"plain{case}"]["world_bwd"], case
        # The frozen middle block (sharded by zero.Init, no optimizer group) is re-gathered from its copies too.
        assert rank["hpz_frozen"]["group_bwd"] == rank["hpz"]["group_bwd"]
        # A checkpointed block is gathered (from the group) before its recompute, which runs on those
        # weights inside backward and gathers nothing more: the same group bytes as without recompute.
        assert rank["hpz_recompute"]["group_bwd"] == rank["hpz"]["group_bwd"]
        for case in ("_recompute", "_ga2"):  # the first block's gathers in backward are its recompute's
            assert rank[f"plain{case}"]["recomputed"] and set(rank[f"plain{case}"]["recomputed"]) == set(WORLD_GATHERS[:1])
            assert rank[f"hpz{case}"]["recomputed"] and set(rank[f"hpz{case}"]["recomputed"]) == {HPZ}
        assert not rank["hpz"]["recomputed"]
        # Backward prefetches (from the first step's recorded unit order; with every unit freed at the
        # end of its forward, each block's backward prefetches the next) come from the group as well.
        plain, hpz = rank["plain_offload"]["prefetched"], rank["hpz_offload"]["prefetched"]
        assert len(plain) == len(hpz) > 0 and set(plain) == set(WORLD_GATHERS[:1]) and set(hpz) == {HPZ}


def test_comms_logger_counts_the_group_gathers_in_their_own_row(four) -> None:
    for rank in four:
        rows = rank["hpz_ga2"]["rows"]
        assert rows[(HPZ, 2)] == rank["hpz_ga2"]["group_bwd"]
        assert rows[("ZeRO-3 parameter all-gather", 4)] == rank["hpz_ga2"]["world_fwd"]
        assert (HPZ, 2) not in rank["plain_ga2"]["rows"]


def test_secondary_copies_cost_numel_times_two_over_g_and_are_dropped_after_backward(four) -> None:
    for rank in four:
        held = rank["hpz_ga2"]["held"]
        assert held[0::2] == [SHARDED * 2 // 2] * (2 * STEPS)  # after each micro-batch's forward (bf16, G=2)
        assert held[1::2] == [0] * (2 * STEPS)  # each micro-batch's forward refreshes them
        assert set(rank["plain_ga2"]["held"]) == {0}


def test_gathers_outside_units_stay_exact_world_gathers(four) -> None:
    for rank in four:
        for case in ("hpz", "hpz_qwz"):
            assert rank[case]["exact"], case
            assert rank[case]["outside"] == [("ZeRO-3 parameter all-gather", 4)], case


def test_resume_continues_the_uninterrupted_run_exactly(four) -> None:
    for rank in four:
        assert rank["resumed"]["losses"] == rank["hpz_ga2"]["losses"][2:]


def test_bad_partition_size_is_refused(four, eight) -> None:
    for rank in four + eight:
        assert rank["bad"].startswith(
            "zero_optimization.zero_hpz_partition_size is 3, which does not divide the data-parallel size "), rank["bad"]
        assert "Set it to a divisor of" in rank["bad"] and "or to 1 to turn hpZ off" in rank["bad"]


def test_a_group_that_is_not_the_node_warns_once(four) -> None:
    # The harness runs every rank on one "node" (LOCAL_WORLD_SIZE 4); G=2 is not that, said once on rank 0.
    assert len(four[0]["warnings"]) == 1 and "LOCAL_WORLD_SIZE" in four[0]["warnings"][0]
    assert all(not rank["warnings"] for rank in four[1:])


def test_eight_ranks_groups_of_four_and_resume_at_another_world_size(four, eight) -> None:
    for rank in eight:
        assert rank["hpz"]["losses"] == rank["plain"]["losses"]
        assert rank["hpz"]["world_bwd"] == 0 and rank["hpz"]["group_sizes"] == [4]
        assert rank["hpz"]["group_bwd"] == rank["plain"]["world_bwd"] > 0
        assert rank["hpz"]["held"][0] == SHARDED * 2 // 4
        # Resharded from 4 ranks: exactly plain ZeRO-3's resumed run, and the global batch's loss
        # continues the 4-rank run (summed in another order over 8 ranks: close, not bitwise).
        assert rank["hpz_resumed"]["losses"] == rank["plain_resumed"]["losses"]
        expected = four[0]["hpz_ga2"]["means"][2:]
        assert rank["hpz_resumed"]["means"] == pytest.approx(expected, rel=2e-2), (rank["hpz_resumed"]["means"], expected)


def _load(zero: dict):
    from partita.config import load_config

    return load_config({"train_batch_size": 8, "zero_optimization": zero})


def test_config_key() -> None:
    assert _load({"stage": 3}).zero_optimization.zero_hpz_partition_size == 1
    assert _load({"stage": 3, "zero_hpz_partition_size": 8}).zero_optimization.zero_hpz_partition_size == 8
    with pytest.raises(ConfigError) as info:
        _load({"stage": 2, "zero_hpz_partition_size": 8})
    assert "zero_hpz_partition_size 8 (ZeRO++) work at ZeRO stage 3 only" in str(info.value)
    with pytest.raises(ConfigError) as info:
        _load({"stage": 3, "zero_hpz_partition_size": 0})
    assert "zero_optimization.zero_hpz_partition_size" in str(info.value)
