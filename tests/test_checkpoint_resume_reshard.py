"""Checkpoints: exact resume in fresh processes, resharding on load, damage detection and
fallback, refused client_state, rank-mismatch failures, and the `partita checkpoint` command.

Spawned runs are few and grouped (spawning is the cost): one world-2 run trains four
configurations straight through and saves along the way; a world-4 run, then a world-1 run
reshard (and save again in their layouts); a fresh world-2 run resumes each configuration and
loads the world-1 and world-4 checkpoints; the command-line checks run in the pytest process.
"""

from __future__ import annotations

import json
import shutil
import weakref
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from partita.checkpoint.cli import main as checkpoint_main
from partita.checkpoint.reshard import ShardReader
from tests._checkpoint_runs import (CLIENT_STATE, K, N, RUNS, ReshardJob, _config, reshard_runs, resumed_runs,
                                    straight_runs, world_one_checks)
from tests.harness import run_distributed
from tests.tiny_models import build_block_model


# ---------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("ckpt")
    return root, run_distributed(straight_runs, 2, str(root))


def _assert_same(a, b, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def _assert_close(got: dict, want: dict, where: str, tol: float = 1e-6) -> None:
    for name, w in want.items():
        err = float((got[name] - w).norm() / w.norm().clamp_min(1e-12))
        assert err < tol, (where, name, err)


# The reshard chain: each job loads a step-K checkpoint, some save it again right away in their
# own layout (``w4s1``: world 4, stage 1), and train to N. Together the loads cross worlds
# 1 <-> 2 <-> 4 (and 4 -> 1) and stages 0 <-> 1 <-> 2 <-> 3 in both directions.
WORLD4_JOBS: list[ReshardJob] = [
    ("z2 w2s2>w4s1", "z2_fp32", _config(1), "z2_fp32", "z2_w4s1"),
    ("z3 w2s3>w4s2", "z3_fp32", _config(2), "z3_fp32", "z3_w4s2"),
]
WORLD1_JOBS: list[ReshardJob] = [
    ("z2 w2s2>w1s0", "z2_fp32", _config(0), "z2_fp32", "z2_w1s0"),
    ("z3 w2s3>w1s3", "z3_fp32", _config(3), "z3_fp32", None),
    ("z2 w4s1>w1s0", "z2_fp32", _config(0), "z2_w4s1", None),
    ("z3 w4s2>w1s3", "z3_fp32", _config(3), "z3_w4s2", None),
]
WORLD2_JOBS: list[ReshardJob] = [
    ("z2 w1s0>w2s1", "z2_fp32", _config(1), "z2_w1s0", None),
    ("z2 w4s1>w2s2", "z2_fp32", _config(2), "z2_w4s1", None),
]


@pytest.fixture(scope="module")
def world4(saved) -> list[dict]:
    root, _ = saved
    return run_distributed(reshard_runs, 4, str(root), WORLD4_JOBS)


@pytest.fixture(scope="module")
def world1(saved, world4) -> dict:
    root, _ = saved
    (out,) = run_distributed(world_one_checks, 1, str(root), WORLD1_JOBS)  # reads world 4's checkpoints
    return out


@pytest.fixture(scope="module")
def resumed(saved, world1) -> list[dict]:
    root, _ = saved
    return run_distributed(resumed_runs, 2, str(root), WORLD2_JOBS)  # reads worlds 1 and 4's checkpoints


def test_resume_in_fresh_processes_is_bit_identical(saved, resumed) -> None:
    _, straight = saved
    for rank in range(2):
        for name in RUNS:
            # Parameters, fp32 masters, Adam moments and step, lr, loss scale, counters, and the
            # next random numbers of every generator: all equal to the uninterrupted run's.
            _assert_same(resumed[rank][name]["final"], straight[rank][name]["final"], f"rank{rank}.{name}.final")
            _assert_same(resumed[rank][name]["state"], straight[rank][name]["state"], f"rank{rank}.{name}.state")
            _assert_same(resumed[rank][name]["client_state"], CLIENT_STATE, f"{name}.client_state")
    assert straight[0]["z1_fp16"]["state"]["loss_scale"] != 2.0**8  # the fp16 run's scale moved


def test_mismatched_alone_or_stuck_ranks_fail_fast_naming_the_ranks(resumed) -> None:
    errors = resumed[0]["errors"]
    assert "different tags" in errors["tags"] and "'t0'" in errors["tags"] and "'t1'" in errors["tags"]
    assert "different tags" in resumed[1]["errors"]["tags"]
    assert "rank(s) [1] of 2 did not call save_checkpoint within 1.5 s" in errors["alone_save"]
    assert "rank(s) [1] of 2 did not call load_checkpoint within 1.5 s" in errors["alone_load"]
    assert not any(key.startswith("alone") for key in resumed[1]["errors"])
    assert "rank(s) [1] did not finish writing their checkpoint files within 1 s" in errors["stuck"]
    assert "rank 0 did not finish committing the checkpoint within 1 s" in resumed[1]["errors"]["stuck"]
    for rank in range(2):  # after rank 0's lone calls failed, both ranks still checkpoint together
        assert resumed[rank]["together"].endswith("together/global_step0"), resumed[rank]["together"]


def test_reshard_across_world_sizes_and_stages(saved, world4, world1, resumed) -> None:
    _, straight = saved
    results = [(WORLD4_JOBS, world4[0]), (WORLD1_JOBS, world1["reshard"]), (WORLD2_JOBS, resumed[0]["reshard"])]
    for jobs, got in results:
        for key, name, *_ in jobs:
            _assert_close(got[key], straight[0][name]["final"], key)


def test_world1_damage_fallback_and_refusals(world1) -> None:
    out = world1
    path, step, warnings = out["fallback"]
    assert path.endswith(f"damaged/global_step{K}") and step == K
    assert any(f"global_step{N}/rank00001.safetensors: sha256 differs" in w for w in warnings), warnings
    assert any("falling back" in w for w in warnings)
    assert "rank00001.safetensors: sha256 differs from the manifest" in out["corrupt"]
    assert f"global_step{K}/model.safetensors" in out["none_left"] and "truncated" in out["none_left"]
    assert "client_state['bad'] is a builtins.set" in out["refused"]
    assert "plain directory name" in out["bad_tag"]
    (straight_8bit, resumed_8bit) = out["eight_bit"]
    assert straight_8bit[1]["optim"][0]["state1"].dtype == torch.uint8
    _assert_same(resumed_8bit, straight_8bit, "eight_bit")


def test_partial_loads_latest_and_async_save(saved, world1) -> None:
    _, straight = saved
    want = straight[0]["z2_fp32"]
    params, steps, optim_states, scheduler_step, client_state = world1["module_only"]
    _assert_same(params, want["at_k"], "module_only")
    assert (steps, optim_states, scheduler_step) == (0, 0, 0)
    _assert_same(client_state, CLIENT_STATE, "module_only client_state")

    params, steps, optim_states, scheduler_step, lr = world1["no_optimizer"]
    _assert_same(params, want["final"], "no_optimizer")
    assert (steps, optim_states, scheduler_step, lr) == (N, 0, N, want["state"]["lr"])

    steps, adam_steps, scheduler_step, lr = world1["no_scheduler"]
    # The scheduler starts over; the lr is the optimizer's saved one until its next step (DeepSpeed's behaviour).
    assert (steps, adam_steps, scheduler_step, lr) == (N, [float(N), float(N)], 0, want["state"]["lr"])

    assert world1["pinned"] == ("first", "first")

    events, tags = world1["async"]
    assert events.index("returned a1") < events.index("done a1.partial") < events.index("write a2.partial"), events
    assert events[-2:] == ["done a2.partial", "waited"], events
    assert tags == ["a1", "a2", "latest"]


def test_checkpoint_command_inspect_verify_consolidate(saved, tmp_path, capsys, monkeypatch) -> None:
    root, straight = saved
    ckpt = root / "z3_fp32"
    assert checkpoint_main(["inspect", str(ckpt)]) == 0
    listing = capsys.readouterr().out
    assert f"global_step{N}" in listing and "latest" in listing and "stage 3" in listing and "world 2" in listing

    assert checkpoint_main(["verify", str(ckpt)]) == 0
    verified = capsys.readouterr().out
    assert f"global_step{K}: ok" in verified and "verify: " in verified and "(100%)" in verified  # progress
    broken = tmp_path / "broken"
    shutil.copytree(ckpt, broken)
    (broken / f"global_step{K}" / "meta.json").write_text("{}")
    assert checkpoint_main(["verify", str(broken), "--tag", f"global_step{K}"]) == 1
    assert "meta.json" in capsys.readouterr().out

    # Streaming: when consolidate reads a tensor, no tensor it read before is still alive (the
    # peak is about one parameter, not an output shard or the model).
    alive: list[weakref.ref] = []
    overlaps: list[int] = []

    def tracked(read):
        def wrapper(self, *args, **kwargs):
            overlaps.append(sum(ref() is not None for ref in alive))
            tensor = read(self, *args, **kwargs)
            alive.append(weakref.ref(tensor if tensor._base is None else tensor._base))  # views keep their base
            return tensor

        return wrapper

    monkeypatch.setattr(ShardReader, "read_full", tracked(ShardReader.read_full))
    monkeypatch.setattr(ShardReader, "tensor", tracked(ShardReader.tensor))
    out = tmp_path / "hf"
    assert checkpoint_main(["consolidate", str(ckpt), str(out), "--tag", f"global_step{K}", "--max-shard-size", "2KB"]) == 0
    monkeypatch.undo()
    assert len(overlaps) > 10 and not any(overlaps), overlaps
    progress_lines = capsys.readouterr().out
    assert f"consolidate: {len(overlaps)}/{len(overlaps)} (100%)" in progress_lines, progress_lines
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    loaded = {}
    for name in files:
        with safe_open(str(out / name), "pt") as f:
            assert f.metadata()["format"] == "pt"
            loaded.update({k: f.get_tensor(k) for k in f.keys()})
    want = straight[0]["z3_fp32"]["at_k"]
    assert index["metadata"]["tied_weights"] == {"head.weight": "embed.weight"}
    assert set(loaded) | {"head.weight"} == set(build_block_model().state_dict())
    for name, tensor in want.items():
        if name != "head.weight":
            assert torch.equal(loaded[name], tensor), name  # fp32 masters, exact
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in loaded.values())

    assert checkpoint_main(["consolidate", str(ckpt), str(tmp_path / "bf16"), "--dtype", "bf16"]) == 0
    with safe_open(str(tmp_path / "bf16" / "model-00001-of-00001.safetensors"), "pt") as f:
        assert f.get_tensor("embed.weight").dtype == torch.bfloat16
        assert f.get_tensor("blocks.0.gain").dtype == torch.bfloat16
