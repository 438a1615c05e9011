"""Tiered optimizer placement (``offload_optimizer.device "auto"``) on CPU.

On a CPU-only machine the "accelerator" tier is host memory too, but each tier is the real
path a GPU run takes: accelerator-tier groups keep their masters beside the model, host-tier
groups go through the offload transfer, NVMe-tier groups swap their moments to files under
pytest's tmp_path. The oracle is the same training without offload: with clipping inactive the
weights must be bit-identical for every split (the tier parts are padded to keep the uncut
group's SIMD lanes); with clipping active the global norm is a sum of per-part partial norms,
equal up to float rounding. Checkpoints move between placements in both directions and the
run continues bit-identically. The automatic split is decided from capacities the config gives
(``tiers.capacity_gib``), so it does not depend on the machine the test runs on.
"""

from __future__ import annotations

import re

import pytest
import torch

from partita.config import ConfigError, load_config
from partita.estimate import GPTShape, Setup
from partita.estimate.model_info import model_info
from partita.estimate.tiers import TierFitError, describe_split, plan_tiers
from partita.offload.auto_placement import normalized_offload
from partita.offload.capacity import GIB, TierCapacities
from partita.offload.config import OffloadOptimizerConfig
from partita.offload.tiers import SIMD_SPAN, split_by_tier, tier_parts
from tests.harness import run_distributed
from tests.test_zero_parity import _config, train_partita

SUB_GROUP = 64
TIER_NAMES = ("accelerator", "cpu", "nvme")


def _tiered(path: str, fractions: tuple[float, float, float] | None = None, **tiers) -> dict:
    spec = dict(tiers)
    if fractions is not None:
        spec["fractions"] = dict(zip(TIER_NAMES, fractions))
    return {"sub_group_size": SUB_GROUP, "offload_optimizer": {"device": "auto", "nvme_path": path, "tiers": spec}}


def _no_clip(cfg: dict) -> dict:
    return {**cfg, "gradient_clipping": 0.0}


# ----------------------------------------------------------------------------- the split


def test_split_fills_farthest_tier_first_and_keeps_the_ratio_rule() -> None:
    sizes = [91, 77, 77, 9]  # registration order
    items = list(range(len(sizes)))
    split = split_by_tier(items, order=lambda i: i, numel=lambda i: sizes[i], fractions=(0.4, 0.3, 0.3))
    # NVMe takes the earliest until 30% of 254 elements, host memory up to 60%, the rest stays.
    assert split == [("nvme", [0]), ("cpu", [1]), ("accelerator", [2, 3])]
    # One offload tier is the historical ratio rule: whole parameters until ratio x total.
    assert split_by_tier(items, order=lambda i: i, numel=lambda i: sizes[i], fractions=(0.5, 0.5, 0.0)) == [
        ("cpu", [0, 1]), ("accelerator", [2, 3])]
    assert split_by_tier(items, order=lambda i: i, numel=lambda i: sizes[i], fractions=(0.0, 0.0, 1.0)) == [
        ("nvme", [0, 1, 2, 3])]
    # Nothing meant for the accelerator: an empty parameter past the share goes to the nearest offload tier.
    with_empty = split_by_tier([0, 1], order=lambda i: i, numel=lambda i: (5, 0)[i], fractions=(0.0, 1.0, 0.0))
    assert with_empty == [("cpu", [0, 1])]


def test_tier_parts_keep_the_uncut_groups_simd_tail() -> None:
    shapes = [torch.Size([91]), torch.Size([7, 11]), torch.Size([11, 7]), torch.Size([3, 3])]
    parts = tier_parts(list(range(4)), order=lambda i: i, numel=lambda i: shapes[i].numel(), shape=lambda i: shapes[i],
                       fractions=(0.4, 0.3, 0.3), num_shards=1, alignment=1)
    whole = sum(s.numel() for s in shapes)
    lengths = {tier: sum(shapes[i].numel() for i in part) + sum(pad) for tier, part, pad in parts}
    pads = {tier: pad for tier, _, pad in parts}
    # The farthest part ends the group: leading zeros give it the whole group's length mod 64.
    assert pads["nvme"][1] == 0 and lengths["nvme"] % SIMD_SPAN == whole % SIMD_SPAN
    # The others end on a multiple of 64: none of their elements falls in a scalar tail.
    assert pads["cpu"][0] == pads["accelerator"][0] == 0
    assert lengths["cpu"] % SIMD_SPAN == 0 and lengths["accelerator"] % SIMD_SPAN == 0
    # Layout order within a part: reverse registration.
    assert [part for _, part, _ in parts] == [[0], [1], [3, 2]]


# ----------------------------------------------------------------------------- config


def _offload_cfg(offload: dict) -> OffloadOptimizerConfig:
    return load_config({"train_batch_size": 8, "zero_optimization": {"stage": 2, "offload_optimizer": offload}}
                       ).zero_optimization.offload_optimizer


def test_config_keys_are_validated() -> None:
    cfg = _offload_cfg({"device": "auto", "tiers": {"fractions": {"accelerator": 0.5, "cpu": 0.3, "nvme": 0.2},
                                                    "capacity_gib": {"cpu": 12}, "headroom": 0.05}})
    assert cfg.tier_fractions() == (0.5, 0.3, 0.2)
    assert _offload_cfg({"device": "cpu", "ratio": 0.25}).tier_fractions() == (0.75, 0.25, 0.0)
    assert _offload_cfg({"device": "nvme"}).tier_fractions() == (0.0, 0.0, 1.0)
    cases = {
        "offload_optimizer.tiers applies to device \"auto\" only (device is \"cpu\"); set device to \"auto\", or "
        "remove tiers": {"device": "cpu", "tiers": {}},
        "offload_optimizer.ratio=0.5 and tiers.fractions both fix the accelerator's share; give one of them":
            {"device": "auto", "ratio": 0.5, "tiers": {"fractions": {"accelerator": 1.0}}},
        "tier fractions accelerator=0.5 + cpu=0.0 + nvme=0.0 add up to 0.5, not 1; make them sum to 1 (e.g. "
        "{\"accelerator\": 0.5, \"cpu\": 0.3, \"nvme\": 0.2})": {"device": "auto", "tiers": {"fractions": {"accelerator": 0.5}}},
        "unknown key in 'zero_optimization.offload_optimizer.tiers'; did you mean 'fractions'?":
            {"device": "auto", "tiers": {"fractoins": {}}},
        "tiers.headroom": {"device": "auto", "tiers": {"headroom": 1.0}},
    }
    for message, offload in cases.items():
        with pytest.raises(ConfigError, match=re.escape(message)):
            _offload_cfg(offload)


def test_a_decided_split_becomes_the_simplest_device() -> None:
    auto = _offload_cfg({"device": "auto", "nvme_path": "/tmp", "buffer_count": 6})
    assert normalized_offload(auto, (1.0, 0.0, 0.0)).device == "none"
    cpu = normalized_offload(auto, (0.25, 0.75, 0.0))
    assert (cpu.device, cpu.ratio, cpu.buffer_count, cpu.tier_fractions()) == ("cpu", 0.75, 6, (0.25, 0.75, 0.0))
    nvme = normalized_offload(auto, (0.5, 0.0, 0.5))
    assert (nvme.device, nvme.ratio, nvme.nvme_path) == ("nvme", 0.5, "/tmp")
    mixed = normalized_offload(auto, (0.5, 0.25, 0.25))
    assert mixed.device == "auto" and mixed.tier_fractions() == (0.5, 0.25, 0.25)


# ----------------------------------------------------------------------------- the automatic split


SHAPE = GPTShape(d_model=64, n_layers=4, n_heads=4, vocab=512, seq_len=64)


def _plan(accelerator: float, cpu: float, nvme: float, **setup):
    info = model_info(SHAPE)
    # Small staging buffers and sub-groups: at this size partita's 64 MiB staging pool would be
    # most of the host's share, and the NVMe buffers would cost more than the elements they save.
    options = {"stage": 2, "micro_batch": 2, "offload_optimizer": "auto", "staging_bytes": 4096,
               "sub_group_size": 4096, "aio_block_size": 4096, **setup}
    return plan_tiers(info, Setup(**options), TierCapacities(int(accelerator), int(cpu), int(nvme)))


def test_auto_fills_the_accelerator_then_host_then_nvme() -> None:
    roomy = _plan(GIB, GIB, GIB)
    assert roomy.fractions == (1.0, 0.0, 0.0) and roomy.elements[1:] == (0, 0)
    full = roomy.needs[0]  # the whole optimizer state beside the working set
    working = _plan(GIB, GIB, GIB, offload_ratio=1.0 - 1e-12).needs[0]  # (nearly) nothing on the accelerator
    # Room for half of the state on the accelerator: it keeps as much as fits, host memory the rest.
    room = working + (full - working) // 2
    half = _plan(room, GIB, GIB)
    a, c, n = half.fractions
    assert 0.0 < a < 1.0 and n == 0.0 and c == pytest.approx(1.0 - a)
    assert half.needs[0] <= room
    # One more parameter on the accelerator would not fit: the next larger share is refused.
    bigger = describe_split(model_info(SHAPE), half.estimate.setup.replace(offload_tiers=(a + 0.05, c - 0.05, 0.0)),
                            half.capacities)
    assert bigger.needs[0] > room
    # Host memory too small for the rest: the remainder spills to NVMe, every tier within its capacity.
    spill = _plan(room, half.needs[1] * 0.8, GIB)
    a2, c2, n2 = spill.fractions
    assert a2 == a and c2 > 0.0 and n2 > 0.0
    assert all(need <= cap for need, cap in zip(spill.needs, spill.capacities.as_tuple())), spill.table()
    assert all(spill.elements), spill.elements
    # The machine's bound: usable bytes over model-state bytes per parameter: bf16 AdamW keeps 16 B
    # of optimizer state and 2 B of parameters per element, plus bf16 gradients where held whole.
    assert spill.bytes_per_param == pytest.approx(
        sum(spill.estimate.model_states(d) for d in TIER_NAMES) / sum(spill.elements))
    assert 18.0 <= spill.bytes_per_param <= 20.5
    assert spill.bound_params == int(spill.capacities.total / spill.bytes_per_param)
    assert "bound:" in spill.table() and "B per parameter" in spill.table()


def test_no_split_fits_names_every_tier_and_the_fix() -> None:
    working = _plan(GIB, GIB, GIB, offload_ratio=1.0 - 1e-12).needs[0]
    with pytest.raises(TierFitError) as raised:
        _plan(working // 2, GIB, GIB)
    message = str(raised.value)
    assert message.startswith(
        "offload_optimizer.device \"auto\": no split of the optimizer state over accelerator, host memory and NVMe "
        "fits this rank (headroom 0% kept free). Closest split (accelerator 0.000 / cpu 1.000 / nvme 0.000): "
        f"accelerator needs {working / GIB:.3g} GiB, {working // 2 / GIB:.3g} GiB usable (short); ")
    assert message.endswith(
        "The accelerator tier is short: the working set alone (parameters, gradients, activations, buffers) does "
        "not fit beside any optimizer state: use ZeRO stage 3 with offload_param, activation checkpointing, a "
        "smaller micro-batch, more ranks, or raise tiers.capacity_gib.accelerator if the measured figure is wrong")
    # Host memory holds the rest only with part of it on NVMe, and there is no disk.
    on_host = _plan(working, GIB, GIB)
    a = on_host.fractions[0]
    on_disk = describe_split(model_info(SHAPE), on_host.estimate.setup.replace(offload_tiers=(a, 0.0, 1.0 - a)),
                             on_host.capacities)
    assert on_disk.needs[1] < on_host.needs[1]
    with pytest.raises(TierFitError, match=r"nvme needs [0-9.e-]+ GiB, 0 GiB usable \(short\)\. The nvme tier is "
                                           r"short: the disk at nvme_path cannot hold the swapped moments"):
        _plan(working, (on_disk.needs[1] + on_host.needs[1]) // 2, 0)


def test_estimate_command_prints_the_split_and_the_bound(capsys, tmp_path) -> None:
    import json

    from partita.launcher.cli import main

    # The setup of _plan, as a config file, and capacities that make it spill to NVMe.
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}, "aio": {"block_size": 4096},
        "zero_optimization": {"stage": 2, "sub_group_size": 4096, "offload_optimizer": {"device": "auto"}},
    }))
    full = _plan(GIB, GIB, GIB).needs[0]
    working = _plan(GIB, GIB, GIB, offload_ratio=1.0 - 1e-12).needs[0]
    room = working + (full - working) // 2
    host = int(_plan(room, GIB, GIB).needs[1] * 0.8)
    spill = _plan(room, host, GIB)
    args = ["estimate", "--model", "gpt", "--d-model", "64", "--n-layers", "4", "--n-heads", "4", "--vocab", "512",
            "--seq-len", "64", "--config", str(config), "--staging-bytes", "4096", "--offload-optimizer", "auto",
            "--tier-capacity", f"accelerator={room},cpu={host},nvme=1GiB", "--tier-headroom", "0"]
    assert main(args) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()[:1] and line.split()[0] in TIER_NAMES}
    assert [float(rows[t][1]) for t in TIER_NAMES] == [round(f, 4) for f in spill.fractions], out
    assert [int(rows[t][2].replace(",", "")) for t in TIER_NAMES] == list(spill.elements)
    assert f"/ {spill.bytes_per_param:.2f} B per parameter = {spill.bound_params / 1e9:.2f} B parameters" in out
    args[-3] = f"accelerator={room},cpu=1KiB,nvme=1KiB"
    assert main(args) == 1
    assert "The cpu tier is short" in capsys.readouterr().err


# ----------------------------------------------------------------------------- training (one rank)


SPLITS = {"accelerator": (1.0, 0.0, 0.0), "host": (0.0, 1.0, 0.0), "nvme": (0.0, 0.0, 1.0),
          "mixed": (0.4, 0.3, 0.3), "host+nvme": (0.0, 0.5, 0.5)}


def _placements(configs: list[dict]) -> dict:
    """Train every config; report each run's ZeRO groups as (tier, elements)."""
    import partita.zero.api as api

    made = []
    original = api.ShardedOptimizer.__init__

    def spy(self, groups, *args, **kwargs):
        original(self, groups, *args, **kwargs)
        made.append(self)

    api.ShardedOptimizer.__init__ = spy
    results = train_partita(configs)
    tiers = []
    for optimizer in made:
        swapped = set(optimizer.swapper.swapped_groups) if optimizer.swapper is not None else set()
        tiers.append([("nvme" if g in swapped else "cpu" if group.offloaded else "accelerator",
                       sum(p.numel() for p in group.params)) for g, group in enumerate(optimizer.groups)])
        optimizer.close()
    return {"results": results, "tiers": tiers}


AUTO_ACCELERATOR_BYTES = 4500  # TiedNet's working set is ~2.6 KB, all of its state beside it ~6 KB


def AUTO_CONFIG(path: str) -> dict:
    tiers = {"capacity_gib": {"accelerator": AUTO_ACCELERATOR_BYTES / GIB, "cpu": 1.0, "nvme": 1.0}, "headroom": 0.0}
    return _no_clip(_config(2, 1, **_tiered(path, **tiers)))


def train_one_rank(path: str) -> dict:
    configs = []
    for stage in (1, 2, 3):
        configs.append(_no_clip(_config(stage, 1)))
        configs += [_no_clip(_config(stage, 1, **_tiered(path, f))) for f in SPLITS.values()]
    # Clipping active (the shared config's): per-part partial norms.
    configs += [_config(2, 2), _config(2, 2, **_tiered(path, SPLITS["mixed"]))]
    # Decided from the capacities the config gives: room for the working set and a little optimizer state.
    configs.append(AUTO_CONFIG(path))
    # The delayed update (one step late, on a background thread) over three tiers: the same math as
    # the delayed update with everything in host memory.
    delayed = {"delayed_param_update": True}
    configs.append(_no_clip(_config(2, 1, offload_optimizer={"device": "cpu", **delayed})))
    mixed = _tiered(path, SPLITS["mixed"])
    mixed["offload_optimizer"].update(delayed)
    configs.append(_no_clip(_config(2, 1, **mixed)))
    return _placements(configs)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> dict:
    return run_distributed(train_one_rank, 1, str(tmp_path_factory.mktemp("nvme")))[0]


def test_every_split_trains_bit_identically_to_no_offload(one_rank) -> None:
    results, tiers = one_rank["results"], one_rank["tiers"]
    per_stage = 1 + len(SPLITS)
    for s, stage in enumerate((1, 2, 3)):
        base = results[s * per_stage]
        for k, name in enumerate(SPLITS, start=1):
            run = results[s * per_stage + k]
            for param, want in base["params"].items():
                assert torch.equal(run["params"][param], want), f"stage {stage}, {name}: {param}"
            assert run["steps"] == base["steps"] and run["skipped"] == 0
        placed = {name: {t for t, _ in tiers[s * per_stage + k]} for k, name in enumerate(SPLITS, start=1)}
        assert placed == {"accelerator": {"accelerator"}, "host": {"cpu"}, "nvme": {"nvme"},
                          "mixed": {"accelerator", "cpu", "nvme"}, "host+nvme": {"cpu", "nvme"}}, placed
    # TiedNet's weights (embed 91, fc1 77, fc2 77, unused 9) and vectors (11, 7, 7, 7, 3), mixed split.
    assert tiers[per_stage + 4] == [("nvme", 91), ("cpu", 77), ("accelerator", 86),  # stage 2, mixed
                                    ("nvme", 11), ("cpu", 14), ("accelerator", 10)]


def test_clipping_active_agrees_up_to_the_norms_rounding(one_rank) -> None:
    base, mixed = one_rank["results"][-5], one_rank["results"][-4]
    for param, want in base["params"].items():
        assert torch.allclose(mixed["params"][param], want, rtol=1e-6, atol=1e-7), param
    assert mixed["norms"] == pytest.approx(base["norms"], rel=1e-6)


def test_auto_split_at_initialize_is_the_estimators(one_rank, tmp_path) -> None:
    from tests.tiny_models import build_model, param_groups

    model = build_model()
    cfg = load_config(AUTO_CONFIG(str(tmp_path)))
    info = model_info(model, param_groups=param_groups(model))
    plan = plan_tiers(info, Setup.from_config(cfg, world_size=1, activation_bytes=0),
                      TierCapacities(AUTO_ACCELERATOR_BYTES, GIB, GIB))
    decided = one_rank["tiers"][-3]
    per_tier = {t: sum(n for tier, n in decided if tier == t) for t in TIER_NAMES}
    # TiedNet: the NVMe buffers would cost more host memory than its elements save, so the
    # estimator keeps what does not fit on the accelerator in host memory.
    assert 0.0 < plan.fractions[0] < 1.0 and plan.fractions[2] == 0.0
    assert per_tier["accelerator"] > 0 and per_tier["cpu"] > 0 and per_tier["nvme"] == 0, decided
    from partita.estimate.groups import zero_groups

    predicted = [(g.tier, sum(p.numel for p in g.params)) for g in zero_groups(info, plan.estimate.setup)]
    assert decided == predicted
    base = one_rank["results"][1 + len(SPLITS)]  # stage 2, no offload, no clipping
    for param, want in base["params"].items():
        assert torch.equal(one_rank["results"][-3]["params"][param], want), param


def test_delayed_update_over_three_tiers_equals_the_delayed_host_update(one_rank) -> None:
    host, tiered = one_rank["results"][-2], one_rank["results"][-1]
    assert {t for t, _ in one_rank["tiers"][-1]} == {"accelerator", "cpu", "nvme"}
    for param, want in host["params"].items():
        assert torch.equal(tiered["params"][param], want), param
    assert tiered["steps"] == host["steps"]


# ----------------------------------------------------------------------------- checkpoints across placements


def round_trips(nvme: str, save_dir: str) -> dict:
    import torch.distributed as dist

    import partita
    from tests.tiny_models import build_model, make_batches, param_groups

    xs, ys = make_batches(4, 8)

    def engine_for(zero: dict):
        model = build_model()
        engine, _, _, _ = partita.initialize(model=model, model_parameters=param_groups(model),
                                             config=_no_clip(_config(2, 1, **zero)))
        return engine, model

    def train(engine, first: int, last: int) -> None:
        rank, micro = dist.get_rank(), engine.train_micro_batch_size_per_gpu()
        for step in range(first, last):
            lo = rank * micro
            engine.backward(engine(xs[step][lo: lo + micro], ys[step][lo: lo + micro]))
            engine.step()

    placements = {
        "none": {}, "cpu": {"offload_optimizer": {"device": "cpu"}},
        "nvme": {"sub_group_size": SUB_GROUP, "offload_optimizer": {"device": "nvme", "nvme_path": nvme}},
        "mixed": _tiered(nvme, SPLITS["mixed"]), "host+nvme": _tiered(nvme, SPLITS["host+nvme"]),
    }
    straight, model = engine_for({})
    train(straight, 0, 4)
    want = {n: p.detach().clone() for n, p in model.named_parameters()}
    straight.destroy()
    out = {}
    for saved, resumed in (("mixed", "none"), ("mixed", "cpu"), ("mixed", "nvme"), ("none", "mixed"),
                           ("nvme", "host+nvme"), ("host+nvme", "mixed")):
        first, _ = engine_for(placements[saved])
        train(first, 0, 2)
        first.save_checkpoint(f"{save_dir}/{saved}_to_{resumed}")
        first.destroy()
        second, model = engine_for(placements[resumed])
        second.load_checkpoint(f"{save_dir}/{saved}_to_{resumed}")
        train(second, 2, 4)
        out[f"{saved}->{resumed}"] = [n for n, p in model.named_parameters() if not torch.equal(p.detach(), want[n])]
        second.destroy()
    return out


def test_checkpoints_move_between_placements_and_continue_bit_identically(tmp_path) -> None:
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    out = run_distributed(round_trips, 2, str(nvme), str(tmp_path / "ckpt"))
    for rank_out in out:
        assert rank_out == {key: [] for key in rank_out} and len(rank_out) == 6, rank_out
