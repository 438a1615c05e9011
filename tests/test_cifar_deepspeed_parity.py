"""DeepSpeedExamples' CIFAR loop on partita equals DeepSpeed 0.19.8's, step by step, at ZeRO 0-3.

The reference numbers are DeepSpeed's own, recorded once by tests/fixtures/
make_cifar_deepspeed_losses.py (DeepSpeed is never a dependency) into
tests/fixtures/cifar_deepspeed_losses.json: tests/client_scripts/cifar_ds_style.py's ``main()``,
2 gloo ranks, fp32, DeepSpeed's "Adam" type at weight decay 3e-7, WarmupLR and gradient
clipping 1.0, 40 steps over two epochs. What had to agree for the losses to stay within fp32
rounding: the Warmup* schedules' lagging step counter (the first two steps at the minimum lr),
and the data order of ``initialize(training_data=...)``'s loader, which repeats the first
epoch's order until the client calls ``set_epoch`` (docs/_incoming/cifar_parity.md).
"""

from __future__ import annotations

import json

import pytest
import torch

from partita.data import ResumableDistributedSampler
from partita.optim import schedulers
from tests.fixtures.make_cifar_deepspeed_losses import (
    CIFAR_PARITY_ARGV,
    FIXTURE,
    SCHEDULE_GROUP_LRS,
    STEPS,
    WORLD_SIZE,
    schedule_trajectory,
    stage_losses,
)
from tests.harness import run_distributed

RTOL = 1e-6  # fp32 rounding: the two libraries' Adam kernels round differently (~2e-7 seen)


@pytest.fixture(scope="module")
def reference() -> dict:
    return json.loads(FIXTURE.read_text())


def test_fixture_records_what_the_test_runs(reference) -> None:
    assert reference["versions"]["deepspeed"] == "0.19.8"
    assert reference["argv"] == CIFAR_PARITY_ARGV and reference["world_size"] == WORLD_SIZE
    assert reference["schedule_group_lrs"] == list(SCHEDULE_GROUP_LRS)
    assert sorted(reference["losses"]) == ["0", "1", "2", "3"]
    assert all(len(losses) == STEPS for losses in reference["losses"].values())


def test_warmup_schedules_give_deepspeeds_lrs_bit_for_bit(reference) -> None:
    for case in reference["schedules"]:
        cls = getattr(schedulers, case["type"])
        ours = schedule_trajectory(cls, case["params"], len(case["lrs"]) - 1)
        assert ours == case["lrs"], case["type"]
    # The CIFAR run's schedule: DeepSpeed's first two optimizer steps both run at warmup_min_lr.
    cifar = reference["schedules"][0]["lrs"]
    assert cifar[0] == cifar[1] == [0.0, 0.0] and cifar[2][0] > 0.0


def test_initialize_loader_repeats_the_epoch_order_until_set_epoch() -> None:
    """DeepSpeed's loader (torch's DistributedSampler): the order changes at set_epoch only."""
    samplers = [ResumableDistributedSampler(range(20), num_replicas=2, rank=r, seed=0, advance_epochs=False)
                for r in range(2)]
    torch_order = torch.randperm(20, generator=torch.Generator().manual_seed(0)).tolist()
    first = [list(s) for s in samplers]
    assert first == [torch_order[0::2], torch_order[1::2]]
    assert [list(s) for s in samplers] == first and samplers[0].epoch == 0  # a second pass: the same order
    assert samplers[0].state_dict()["consumed"] == 0
    samplers[0].set_epoch(1)
    assert list(samplers[0]) == torch.randperm(20, generator=torch.Generator().manual_seed(1)).tolist()[0::2]
    advancing = ResumableDistributedSampler(range(20), num_replicas=2, rank=0, seed=0)
    assert list(advancing) == first[0] and list(advancing) != first[0]  # the default still reshuffles


def _loader_epochs() -> dict:
    import partita

    data = torch.utils.data.TensorDataset(torch.arange(12.0).unsqueeze(1), torch.zeros(12))
    config = {"train_batch_size": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    _, _, loader, _ = partita.initialize(model=torch.nn.Linear(1, 1), config=config, training_data=data)
    order = lambda: [int(x) for batch, _ in loader for x in batch.flatten()]  # noqa: E731
    first, second = order(), order()
    loader.data_sampler.set_epoch(1)  # DeepSpeed client code's spelling
    return {"alias": loader.data_sampler is loader.sampler, "first": first, "second": second, "third": order()}


def test_initialize_loader_keeps_deepspeeds_order_and_data_sampler_name() -> None:
    r = run_distributed(_loader_epochs, 1)[0]
    assert r["alias"]
    assert r["first"] == r["second"] == torch.randperm(12, generator=torch.Generator().manual_seed(0)).tolist()
    assert r["third"] == torch.randperm(12, generator=torch.Generator().manual_seed(1)).tolist()


def test_cifar_script_losses_equal_deepspeeds_at_every_stage(reference) -> None:
    ranks = run_distributed(stage_losses, WORLD_SIZE, "partita", [0, 1, 2, 3], CIFAR_PARITY_ARGV, timeout=400)
    assert ranks[0] == ranks[1]  # every rank logs the global mean
    for stage, theirs in reference["losses"].items():
        ours = ranks[0][stage]
        assert len(ours) == len(theirs) == STEPS
        worst = max(abs(a - b) / abs(b) for a, b in zip(ours, theirs))
        assert worst <= RTOL, f"stage {stage}: max relative loss difference {worst:.3e}"
