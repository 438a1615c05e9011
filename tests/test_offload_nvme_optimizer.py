"""ZeRO-Infinity optimizer offload to NVMe (``offload_optimizer.device: "nvme"``) on CPU gloo ranks.

The states live in swap files under pytest's tmp_path and are stepped in sub-groups of 64
elements, so every group is several sub-groups and pipelined reads/writes really overlap. The
oracle is the same run with ``device: "cpu"``: same kernels on the same values, so the weights
must be bit-identical; and the torch reference of tests/test_zero_parity.py within 1e-5.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.harness import run_distributed
from tests.test_zero_parity import GLOBAL_BATCH, STEPS, _check_against_reference, _config, train_partita

SUB_GROUP = 64
BLOCK = 4096  # aio.block_size: files are whole blocks
BUFFERS = 4  # AdamW keeps 2 states per parameter: 2 buffers per sub-group, 4 with a pipeline


def _nvme(path: str, *, read: bool = False, write: bool = False, buffers: int = BUFFERS, **extra) -> dict:
    return {
        "sub_group_size": SUB_GROUP,
        "offload_optimizer": {
            "device": "nvme", "nvme_path": path, "buffer_count": buffers, "pipeline_read": read, "pipeline_write": write,
            **extra,
        },
    }


def _cpu(**extra) -> dict:
    return {"sub_group_size": SUB_GROUP, "offload_optimizer": {"device": "cpu", **extra}}


def _with_aio(cfg: dict) -> dict:
    return {**cfg, "aio": {"block_size": BLOCK}}


def _spy_swappers() -> list:
    """Keep every swapper built (which also keeps its files until closed)."""
    from partita.offload import nvme_optimizer

    built = []
    original = nvme_optimizer.SwappedOptimizerStates.__init__

    def spy(self, *args, **kwargs):
        original(self, *args, **kwargs)
        built.append(self)

    nvme_optimizer.SwappedOptimizerStates.__init__ = spy
    return built


def _swap_report(swapper) -> dict:
    """Files and pool of one swapper, then close it and see the files go."""
    files = {name: os.path.getsize(os.path.join(swapper.swap_dir, name)) for name in os.listdir(swapper.swap_dir)}
    expected, state_nbytes = [], 0
    for g in swapper.swapped_groups:
        numel = swapper.groups[g].master.numel()
        state_nbytes += 2 * numel * 4  # exp_avg, exp_avg_sq in fp32
        for lo in range(0, numel, SUB_GROUP):
            nbytes = min(SUB_GROUP, numel - lo) * 4
            expected += [-(-nbytes // BLOCK) * BLOCK] * 2
    swapper.drain()  # the last step's deferred writes (pipeline_write) and the prefetch after them
    last, totals = swapper.last_step, swapper.totals
    report = {
        "ranges": len(expected) // 2,
        "last_step": (last.bytes_read, last.bytes_written, last.ranges, last.prefetched, last.steps, last.deferred),
        "totals": (totals.bytes_read, totals.bytes_written, totals.ranges, totals.steps),
        # Reads the end of the last step started for a next step (pipeline_read's prefetch).
        "prefetched_bytes": sum(slot.read_bytes for slot in swapper._prefetched),
        "sizes": sorted(files.values()),
        "expected_sizes": sorted(expected),
        "state_nbytes": state_nbytes,
        "capacity": swapper.pool.capacity,
        "peak": swapper.pool.peak_in_use,
        "in_use": swapper.pool.in_use,
        "pool_bytes": swapper.pool.total_bytes,
    }
    swap_dir = swapper.swap_dir
    swapper.close()  # waits for the prefetched reads: the store's counters are final
    report["bytes_read"], report["bytes_written"] = swapper.store.bytes_read, swapper.store.bytes_written
    report["removed"] = not os.path.exists(swap_dir)
    return report


def train_and_report(configs: list[dict]) -> dict:
    built = _spy_swappers()
    results = train_partita(configs)
    return {"results": results, "swaps": [_swap_report(s) for s in built]}


# stage, gas, pipeline_read, pipeline_write: every stage with gas 1 and 2, every pipeline setting.
CASES = [(1, 1, False, False), (2, 2, True, False), (3, 1, False, True), (1, 2, True, True), (2, 1, True, True), (3, 2, False, False)]


@pytest.mark.parametrize("world_size", [1, 2])
def test_nvme_offload_equals_cpu_offload_and_torch(world_size: int, tmp_path) -> None:
    configs = []
    for stage, gas, read, write in CASES:
        configs += [_config(stage, gas, **_cpu()), _with_aio(_config(stage, gas, **_nvme(str(tmp_path), read=read, write=write)))]
    per_rank = run_distributed(train_and_report, world_size, configs)
    for rank_out in per_rank:
        results = rank_out["results"]
        assert len(rank_out["swaps"]) == len(CASES)
        for i, ((stage, gas, read, write), swap) in enumerate(zip(CASES, rank_out["swaps"])):
            cpu, nvme = results[2 * i], results[2 * i + 1]
            where = f"stage {stage}, gas {gas}, pipeline_read {read}, pipeline_write {write}, world {world_size}"
            for name, want in cpu["params"].items():
                assert torch.equal(nvme["params"][name], want), f"{where}: {name}"
            assert nvme["norms"] == cpu["norms"], where
            _check_against_reference(nvme, tol=1e-5)
            assert nvme["state_numel"] == 0, where  # no optimizer state in memory between steps
            # One file per state tensor per sub-group, each its bytes rounded up to aio.block_size.
            assert swap["sizes"] == swap["expected_sizes"] and len(swap["sizes"]) > 4, (where, swap)
            # The pool is buffer_count buffers of one sub-group and never grows: 2 states of one
            # sub-group at a time without a read-ahead, 2 sub-groups with one.
            assert swap["capacity"] == BUFFERS and swap["pool_bytes"] == BUFFERS * SUB_GROUP * 4, where
            if write:  # a write-behind holds buffers until its write lands: timing decides
                assert 2 <= swap["peak"] <= BUFFERS, (where, swap)
            else:
                assert swap["peak"] == (4 if read else 2), (where, swap)
            # pipeline_read: the end of a step starts reading the next step's first ranges into
            # the free buffers (2 ranges of 2 states here) and keeps them until that step.
            assert swap["in_use"] == (4 if read else 0), where
            # Every step writes all states; every step but the first (states created by torch) reads them.
            state = swap["state_nbytes"]
            assert swap["last_step"][:5] == (state, state, swap["ranges"], 2 if read else 0, 1), (where, swap)
            # pipeline_write: the last ranges' writes land after the step returns (1 or 2 of them).
            assert (1 <= swap["last_step"][5] <= 2) if write else swap["last_step"][5] == 0, (where, swap)
            assert swap["totals"] == ((STEPS - 1) * state, STEPS * state, STEPS * swap["ranges"], STEPS), (where, swap)
            assert swap["prefetched_bytes"] == (4 * SUB_GROUP * 4 if read else 0), (where, swap)
            assert swap["bytes_written"] == STEPS * state, (where, swap)
            assert swap["bytes_read"] == (STEPS - 1) * state + swap["prefetched_bytes"], (where, swap)
            assert swap["removed"], where


# ----------------------------------------------------------------------------- checkpoints

TOTAL_STEPS = 4


def _engine(cfg: dict):
    import partita
    from tests.tiny_models import build_model, param_groups

    model = build_model()
    engine, _, _, _ = partita.initialize(model=model, model_parameters=param_groups(model), config=cfg)
    return engine


def _train(engine, first: int, last: int) -> None:
    import torch.distributed as dist

    from tests.tiny_models import make_batches

    rank, world = dist.get_rank(), dist.get_world_size()
    micro = engine.train_micro_batch_size_per_gpu()
    xs, ys = make_batches(TOTAL_STEPS, GLOBAL_BATCH)
    for step in range(first, last):
        for m in range(engine.gradient_accumulation_steps()):
            lo = (m * world + rank) * micro
            engine.backward(engine(xs[step][lo : lo + micro], ys[step][lo : lo + micro]))
            engine.step()


def _params(engine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def checkpoint_round_trips(nvme_path: str, save_dir: str) -> dict:
    """Uninterrupted runs, and runs resumed after 2 steps across devices (nvme <-> cpu)."""
    nvme = _with_aio(_config(2, 2, **_nvme(nvme_path, read=True, write=True)))
    cpu = _config(2, 2, **_cpu())
    out = {}
    for name, cfg in (("cpu", cpu), ("nvme", nvme)):
        engine = _engine(cfg)
        _train(engine, 0, 2)
        engine.save_checkpoint(save_dir, tag=f"from_{name}")
        _train(engine, 2, TOTAL_STEPS)  # saving must not disturb the run
        out[f"uninterrupted_{name}"] = _params(engine)
    for saved, resumed, cfg in (("nvme", "cpu", cpu), ("cpu", "nvme", nvme), ("nvme", "nvme", nvme)):
        engine = _engine(cfg)
        engine.load_checkpoint(save_dir, tag=f"from_{saved}")
        assert engine.global_steps == 2
        _train(engine, 2, TOTAL_STEPS)
        out[f"{saved}_to_{resumed}"] = _params(engine)
        if resumed == "nvme":
            assert not engine.optimizer.inner.state  # loaded states went to the swap files
    # A load into an engine that has trained on: the step-3 states its prefetch (pipeline_read)
    # holds, and the writes its last step left in flight, must not leak into the resumed run.
    engine = _engine(nvme)
    _train(engine, 0, 3)
    assert engine.optimizer.swapper._prefetched  # the next step's first sub-groups are read ahead
    engine.load_checkpoint(save_dir, tag="from_nvme")
    _train(engine, 2, TOTAL_STEPS)
    out["nvme_reloaded"] = _params(engine)
    return out


def test_checkpoint_moves_between_nvme_and_cpu_offload(tmp_path) -> None:
    nvme_path = tmp_path / "nvme"
    nvme_path.mkdir()
    per_rank = run_distributed(checkpoint_round_trips, 2, str(nvme_path), str(tmp_path / "ckpt"))
    for out in per_rank:
        want = out["uninterrupted_cpu"]
        for run in ("uninterrupted_nvme", "nvme_to_cpu", "cpu_to_nvme", "nvme_to_nvme", "nvme_reloaded"):
            for name, ref in want.items():
                assert torch.equal(out[run][name], ref), f"{run}: {name}"
    assert os.listdir(nvme_path) == []  # every swap directory removed


# ----------------------------------------------------------------------------- other optimizers, errors


class _MyAdamW(torch.optim.AdamW):
    """A subclass: partita cannot know that its step is element-wise."""


class SometimesNet(torch.nn.Module):
    """``extra`` gets a gradient only in some steps: its optimizer states must survive the others."""

    def __init__(self) -> None:
        super().__init__()
        from tests.tiny_models import VOCAB, WIDTH

        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.extra = torch.nn.Linear(WIDTH, WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor, use_extra: bool) -> torch.Tensor:
        h = self.embed(idx)
        if use_extra:
            h = h + self.extra(h)
        logits = self.head(torch.tanh(h))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _train_sometimes(cfg: dict) -> dict[str, torch.Tensor]:
    import partita
    from tests.tiny_models import make_batches

    model = SometimesNet()
    engine, _, _, _ = partita.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    xs, ys = make_batches(TOTAL_STEPS, GLOBAL_BATCH)
    for step, use_extra in enumerate((True, False, False, True)):
        engine.backward(engine(xs[step], ys[step], use_extra=use_extra))
        engine.step()
    return _params(engine)


def other_cases(nvme_path: str) -> dict:
    import partita
    from partita.config import ConfigError
    from partita.offload.errors import NvmeConfigError, NvmeSwapError
    from tests.tiny_models import build_model, param_groups

    out: dict = {}
    # Optimizers whose states are created differently (SGD: momentum = first gradient, with
    # dampening that differs from a zero start), a scheduler, and the delayed update.
    sgd = {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9, "dampening": 0.1}}
    lion = {"type": "Lion", "params": {"lr": 1e-3, "weight_decay": 0.1}}
    warmup = {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3, "warmup_max_lr": 0.02}}}
    # name: (root config keys, offload_optimizer keys, precision)
    variants = {
        "sgd": ({"optimizer": sgd}, {}, "fp32"),
        "lion": ({"optimizer": lion}, {}, "fp32"),
        "scheduler": (warmup, {}, "fp32"),
        "delayed": ({}, {"delayed_param_update": True}, "fp32"),
        "ratio": ({}, {"ratio": 0.5}, "fp32"),  # only part of each group offloaded (and swapped)
        "bf16": ({}, {}, "bf16"),
    }
    configs = []
    for name, (extra, offload, precision) in variants.items():
        configs += [
            {**_config(2, 2, precision, **_cpu(**offload)), **extra},
            _with_aio({**_config(2, 2, precision, **_nvme(nvme_path, read=True, **offload)), **extra}),
        ]
    results = train_partita(configs)
    out["pairs"] = {name: (results[2 * i]["params"], results[2 * i + 1]["params"]) for i, name in enumerate(variants)}
    out["pairs"]["sometimes_used"] = tuple(
        _train_sometimes(_config(2, 1, **where)) for where in (_cpu(), _nvme(nvme_path, read=True, write=True))
    )

    def refused(cfg: dict, optimizer=None) -> tuple[str, str]:
        model = build_model()
        try:
            partita.initialize(model=model, model_parameters=param_groups(model), config=cfg, optimizer=optimizer)
        except (NotImplementedError, ValueError) as error:
            return type(error).__name__, str(error)
        return "", "no error"

    plain = _config(2, 1)
    del plain["optimizer"]
    out["subclass"] = refused({**plain, "zero_optimization": {**plain["zero_optimization"], **_nvme(nvme_path)}},
                              optimizer=lambda groups: _MyAdamW(groups, lr=1e-2))
    out["too_few_buffers"] = refused(_config(2, 1, **_nvme(nvme_path, buffers=1)))
    out["pipeline_buffers"] = refused(_config(2, 1, **_nvme(nvme_path, write=True, buffers=3)))
    out["missing_path"] = refused(_config(2, 1, **_nvme(os.path.join(nvme_path, "missing"))))
    out["missing_is_config_error"] = issubclass(NvmeConfigError, ConfigError)

    # The step log's line and metrics carry the window's NVMe traffic per step.
    engine = _engine({**_with_aio(_config(2, 1, **_nvme(nvme_path, read=True))), "steps_per_print": 2})
    _train(engine, 0, 2)
    swapper = engine.optimizer.swapper
    state_bytes = sum(2 * 4 * swapper.groups[g].master.numel() for g in swapper.swapped_groups)
    out["log"] = (engine._step_log.last_metrics, engine._step_log.last_line, state_bytes)
    engine.destroy()

    # A swap file truncated between steps: the next step names it; the buffers are back in the pool.
    engine = _engine(_with_aio(_config(2, 1, **_nvme(nvme_path, read=True, write=True))))
    _train(engine, 0, 1)
    swapper = engine.optimizer.swapper
    swapper.drain()  # the step's last writes have landed: the truncation is not overwritten
    # A range the prefetch has not read yet (one it has may be read before the truncation lands).
    prefetched = {id(slot.unit) for slot in swapper._prefetched}
    unit = next(u for u in swapper._ranges[0] if id(u) not in prefetched)
    victim = swapper.store.file_path(unit.swap_keys["exp_avg_sq"])
    os.truncate(victim, 100)
    try:
        _train(engine, 1, 2)
        out["truncated"] = ("", "no error")
    except NvmeSwapError as error:
        out["truncated"] = (type(error).__name__, str(error))
    out["victim"] = victim
    out["in_use_after_error"] = swapper.pool.in_use
    return out


def test_other_optimizers_and_errors(tmp_path) -> None:
    out = run_distributed(other_cases, 1, str(tmp_path))[0]
    for name, (cpu, nvme) in out["pairs"].items():
        for key, want in cpu.items():
            assert torch.equal(nvme[key], want), f"{name}: {key}"
    kind, message = out["subclass"]
    assert kind == "NotImplementedError" and "_MyAdamW" in message and 'device to "cpu"' in message, message
    kind, message = out["too_few_buffers"]
    assert kind == "ConfigError" and "buffer_count=1" in message and "at least 2" in message, message
    kind, message = out["pipeline_buffers"]
    assert kind == "ConfigError" and "buffer_count=3" in message and "pipeline_write" in message and "at least 4" in message
    kind, message = out["missing_path"]
    assert kind == "NvmeConfigError" and "does not exist" in message and "nvme_path" in message, message
    assert out["missing_is_config_error"]
    metrics, line, state_bytes = out["log"]
    # Two steps in the window: the first creates the states (writes only), the second reads them.
    assert metrics["nvme_read_gib"] * 2**30 == state_bytes / 2 and metrics["nvme_write_gib"] * 2**30 == state_bytes
    assert metrics["nvme_swap_s"] > 0 and 0 < metrics["nvme_busy_s"], metrics
    assert f" nvme_read_gib={metrics['nvme_read_gib']:.3f} nvme_write_gib=" in line, line
    kind, message = out["truncated"]
    assert kind == "NvmeSwapError" and out["victim"] in message and "wrong size" in message, message
    assert out["in_use_after_error"] == 0
