"""The host-memory check of a fixed offload at initialize (partita/offload/host_check.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import partita
from partita.config import PartitaConfig
from partita.config.base import ConfigError
from partita.offload import capacity
from partita.offload.capacity import TierCapacities
from partita.offload.host_check import check_host_capacity

GIB = 2**30
N_PARAMS = 1000 * 1000 + 1000 + 10 * 1000 + 10
# Host bytes of a stage-2 AdamW optimizer offload at one rank, besides 16 per (padded) element for the
# fp32 master, gradient and two moments: 4 staging buffers of 64 MiB plus their alignment page.
STAGING = 4 * (64 * 2**20 + 4096)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1000, 1000), nn.Linear(1000, 10))


def _config(**offload) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", **offload}},
    }


def _check(cfg: dict, *, cpu_bytes: int, device: str = "cuda") -> None:
    model = _model()
    check_host_capacity(
        PartitaConfig.model_validate(cfg), model, [{"params": list(model.parameters())}], world_size=1,
        device=torch.device(device),
        capacities=TierCapacities(80 * GIB, cpu_bytes, 0, sources=("given", "given host", "given disk")),
    )


def test_refusal_names_the_figures_and_the_fixes():
    with pytest.raises(ConfigError) as refused:
        _check(_config(), cpu_bytes=GIB // 5)
    text = str(refused.value)
    assert "zero_optimization offload needs at least 0.27 GiB of host memory on each rank, but 0.20 GiB is " \
           "available (given host)" in text
    assert "fp32 master weights (offloaded) 0.00" not in text  # under 0.01 GiB: not listed
    assert "pinned staging buffers (offload_optimizer) 0.25" in text
    for fix in ('offload_optimizer.device "auto"', 'offload_optimizer.device "nvme"', 'offload_param.device "nvme"',
                "8-bit optimizer", "sharded over 1 now", "check_host_memory to false"):
        assert fix in text


def test_boundary_is_the_estimate_of_partitas_host_buffers():
    from partita.estimate import estimate_memory
    from partita.estimate.inputs import Setup
    from partita.offload.auto_placement import model_info_for

    model = _model()
    cfg = PartitaConfig.model_validate(_config())
    estimate = estimate_memory(model_info_for(model, [{"params": list(model.parameters())}], None),
                               Setup.from_config(cfg, world_size=1, activation_bytes=0))
    needed = estimate.peak_cpu
    # master + gradient + two moments, 16 bytes per (padded) element, plus the step and the staging pool
    assert 16 * N_PARAMS + STAGING <= needed <= 16 * (N_PARAMS + 64) + STAGING + 8
    _check(_config(), cpu_bytes=needed)  # fits exactly
    with pytest.raises(ConfigError, match="offload needs at least"):
        _check(_config(), cpu_bytes=needed - 1)


def test_no_offload_switched_off_or_auto_is_not_checked():
    _check({**_config(), "zero_optimization": {"stage": 2}}, cpu_bytes=0)
    _check(_config(check_host_memory=False), cpu_bytes=0)
    # "auto" was planned to fit by resolve_tiered_placement before this check runs
    _check(_config(device="auto", tiers={"fractions": {"cpu": 1.0}}), cpu_bytes=0)


def test_nvme_offload_is_checked_too(tmp_path):
    # "nvme" keeps the fp32 master and gradient partition in host memory (the moments go to disk)
    with pytest.raises(ConfigError, match="offload needs at least"):
        _check(_config(device="nvme", nvme_path=str(tmp_path)), cpu_bytes=0)
    _check(_config(device="nvme", nvme_path=str(tmp_path)), cpu_bytes=80 * GIB)


def test_cpu_run_counts_model_and_offload_in_one_pool():
    # On a CPU-only run the accelerator is host memory: its working set and the offloaded state add up.
    model = _model()
    cfg = PartitaConfig.model_validate(_config())
    groups = [{"params": list(model.parameters())}]
    big = TierCapacities(80 * GIB, 0, 0, sources=("host MemAvailable", "0", "none"))
    check_host_capacity(cfg, model, groups, world_size=1, device=torch.device("cpu"), capacities=big)
    small = TierCapacities(GIB // 5, 0, 0, sources=("host MemAvailable (test)", "0", "none"))
    with pytest.raises(ConfigError, match=r"of this CPU run's memory .* available \(host MemAvailable \(test\)\)"):
        check_host_capacity(cfg, model, groups, world_size=1, device=torch.device("cpu"), capacities=small)


@pytest.fixture
def no_process_group_left():
    yield
    import torch.distributed as dist

    if dist.is_initialized():  # initialize made a one-rank group: later tests in this process expect none
        dist.destroy_process_group()


def test_initialize_refuses_before_allocating(monkeypatch, no_process_group_left):
    monkeypatch.setattr(capacity, "host_available_bytes", lambda: 100 * 2**20)  # a 100 MiB machine
    with pytest.raises(ConfigError, match=r"offload needs at least 0\.\d\d GiB .* but 0\.10 GiB is available"):
        partita.initialize(model=_model(), config=_config())
    engine, *_ = partita.initialize(model=_model(), config=_config(check_host_memory=False))
    engine.destroy()


def test_parameter_offload_refusal_offers_gather_from_master():
    model = nn.Linear(16384, 16384, bias=False, device="meta")  # 2^28 parameters, never allocated
    groups = [{"params": list(model.parameters())}]
    zero = {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}
    cfg = {**_config(), "bf16": {"enabled": True}, "zero_optimization": zero}
    small = TierCapacities(80 * GIB, GIB, 0, sources=("given", "given host", "given disk"))
    with pytest.raises(ConfigError) as refused:
        check_host_capacity(PartitaConfig.model_validate(cfg), model, groups, world_size=1,
                            device=torch.device("cuda"), capacities=small)
    # bf16 shards of 2^28 parameters: 0.50 GiB of the 16 + 2 bytes per parameter
    assert "Fixes: offload_param.gather_from_master true (no 16-bit parameter copy in host memory: 0.50 GiB " \
           "less), or offload_optimizer.device" in str(refused.value)
    zero["offload_param"]["gather_from_master"] = True
    with pytest.raises(ConfigError) as refused:
        check_host_capacity(PartitaConfig.model_validate(cfg), model, groups, world_size=1,
                            device=torch.device("cuda"), capacities=small)
    assert "gather_from_master true" not in str(refused.value)
    assert "needs at least 4.25 GiB of host memory" in str(refused.value)  # 16 bytes x 2^28 + 4 staging buffers
