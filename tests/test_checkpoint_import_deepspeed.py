"""``partita checkpoint import-deepspeed``: DeepSpeed 0.19.8 checkpoints resume under partita.

The fixtures (tests/fixtures/deepspeed_ckpt, made by tests/fixtures/make_deepspeed_checkpoints.py
under DeepSpeed 0.19.8 on 2 gloo ranks) hold DeepSpeed's checkpoint after 3 steps at ZeRO 0-3
(and ZeRO 3 with sub-groups, tied and frozen parameters at ZeRO 2 and 3, bf16 at ZeRO 0 and 2)
and DeepSpeed's own resume from it: the parameters after 2 more steps, the losses and the lrs.
Imported, the fp32 checkpoints must resume under partita at 1 and 4 ranks (other ZeRO stages,
the same global batch) to DeepSpeed's parameters within 1e-5 relative. CI has no DeepSpeed.
"""

from __future__ import annotations

import json
import pickle
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from partita.checkpoint.cli import main as checkpoint_main
from partita.checkpoint.import_deepspeed import import_deepspeed
from partita.checkpoint.import_deepspeed_read import DeepSpeedImportError
from tests.fixtures.make_deepspeed_checkpoints import (BETAS, DS_ADAMW, EPS, GLOBAL_BATCH, LR, OPTIMIZERS, TAG, WARMUP,
                                                       WEIGHT_DECAY, TinyNet, make_optimizer, param_groups, rank_slice)
from tests.harness import run_distributed

FIXTURES = Path(__file__).parent / "fixtures" / "deepspeed_ckpt"
EXPECTED = json.loads((FIXTURES / "expected.json").read_text())
RUNS = EXPECTED["runs"]
STAGES = ("zero0", "zero1", "zero2", "zero3")
FP32 = (*STAGES, "zero3_subgroups", "zero2_tied_frozen", "zero3_tied_frozen", "zero2_ds_adamw", "zero1_sgd", "zero2_w4",
        "zero3_w4")
REFUSED = {"zero1_elastic"}  # test_elastic_checkpoint_is_not_implemented


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("imported")
    return {run: import_deepspeed(FIXTURES / run, root / run) for run in RUNS if run not in REFUSED}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


# ---------------------------------------------------------------------------- what is imported


@pytest.mark.parametrize("run", FP32)
def test_masters_and_weights_are_deepspeeds(imported, run):
    """zero_to_fp32's reconstruction: every parameter exactly DeepSpeed's after step 3."""
    rank = load_file(str(imported[run] / "rank00000.safetensors"))
    model = load_file(str(imported[run] / "model.safetensors"))
    meta = json.loads((imported[run] / "meta.json").read_text())
    saved = RUNS[run]["saved"]["params"]
    tied = run.endswith("tied_frozen")
    assert sorted(model) == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight", *(["mix1.weight"] if tied else []), "scale"]
    assert meta["model"]["aliases"] == ({"mix2.weight": "mix1.weight"} if tied else {})
    assert torch.equal(model["scale"], torch.tensor([1.0, 0.5, 2.0]))
    for name, values in saved.items():
        source = meta["model"]["aliases"].get(name, name)
        assert torch.equal(model[source].reshape(-1), torch.tensor(values)), name
        if tied and name == "fc1.bias":  # frozen: no master (at ZeRO 3 gathered from the ranks' fragments)
            assert f"master/{name}" not in rank and name not in meta["optimizer"]["params"]
        elif name != "mix2.weight":
            assert torch.equal(rank[f"master/{name}"], torch.tensor(values)), name


@pytest.mark.parametrize("run", ["zero2_bf16", "zero0_bf16"])
def test_bf16_masters_are_deepspeeds_fp32_masters(imported, run):
    """bf16: the model file holds the bf16 weights, the rank file DeepSpeed's fp32 masters (not the rounded weights)."""
    rank = load_file(str(imported[run] / "rank00000.safetensors"))
    model = load_file(str(imported[run] / "model.safetensors"))
    meta = json.loads((imported[run] / "meta.json").read_text())
    assert meta["precision"] == "bfloat16" and meta["loss_scaler"] is None
    assert model["fc1.weight"].dtype == torch.bfloat16 and model["scale"].dtype == torch.float32
    saved = RUNS[run]["saved"]
    for name, values in saved["params"].items():
        master = rank[f"master/{name}"]
        assert master.dtype == torch.float32
        assert torch.equal(master.bfloat16().float(), torch.tensor(values)), name  # DeepSpeed's bf16 weights
        assert torch.equal(model[name].reshape(-1).float(), torch.tensor(values)), name
        if "masters" in saved:  # ZeRO 1-3: DeepSpeed's own fp32 masters, exactly
            assert torch.equal(master, torch.tensor(saved["masters"][name])), name
    assert any(not torch.equal(rank[f"master/{n}"].bfloat16().float(), rank[f"master/{n}"]) for n in saved["params"])


def test_optimizer_state_agrees_across_stages(imported):
    """The same 3 steps at ZeRO 0-3 (2 and 4 ranks): Adam's moments rebuilt from seven layouts agree (fp32 rounding)."""
    others = ("zero3_subgroups", "zero2_w4", "zero3_w4")
    files = {s: load_file(str(imported[s] / "rank00000.safetensors")) for s in (*STAGES, *others)}
    keys = sorted(files["zero0"])
    assert [k for k in keys if k.startswith("state/exp_avg/")] == [
        "state/exp_avg/fc1.bias", "state/exp_avg/fc1.weight", "state/exp_avg/fc2.bias", "state/exp_avg/fc2.weight"]
    for stage in (*STAGES[1:], *others):
        assert sorted(files[stage]) == keys
        for key in keys:
            assert _rel(files[stage][key], files["zero0"][key]) < 1e-6, (stage, key)
    assert float(files["zero0"]["state/exp_avg_sq/fc2.bias"].min()) > 0  # really trained state


@pytest.mark.parametrize("stage", STAGES)
def test_meta_carries_counters_groups_scheduler_client_state(imported, stage):
    """Counters, groups and hyperparameters, the scheduler's position, client_state; DeepSpeed's origin."""
    meta = json.loads((imported[stage] / "meta.json").read_text())
    assert meta["counters"] == {"global_steps": 3, "global_samples": 24, "skipped_steps": 0, "micro_steps": 0}
    assert meta["optimizer"]["class"] == "torch.optim.adamw.AdamW"
    groups = meta["optimizer"]["groups"]
    assert [g["params"] for g in groups] == [["fc1.weight", "fc2.weight"], ["fc1.bias", "fc2.bias"]]
    assert [g["hyperparameters"]["weight_decay"] for g in groups] == [WEIGHT_DECAY, 0.0]
    assert groups[0]["hyperparameters"]["betas"] == {"__tuple__": list(BETAS)}
    assert groups[0]["partition_state"] == ["exp_avg", "exp_avg_sq"]
    assert meta["lr_scheduler"] == {"last_epoch": 3, "_step_count": 4}
    assert meta["client_state"] == {"epoch": 1, "note": "fixture"}
    assert meta["imported_from"]["zero_stage"] == int(stage[-1])
    assert meta["imported_from"]["data_parallel_size"] == 2
    assert meta["loss_scaler"] is None and meta["precision"] == "float32"
    step = load_file(str(imported[stage] / "state.safetensors"))
    assert {float(v) for v in step.values()} == {3.0}  # Adam's step, one per group


def test_optimizer_class_and_state_of_deepspeeds_adamw_and_torchs_sgd(imported):
    """DeepSpeed's own AdamW (FusedAdam: int step, list betas) imports as torch's AdamW state; SGD's momentum."""
    adamw = json.loads((imported["zero2_ds_adamw"] / "meta.json").read_text())["optimizer"]
    assert adamw["class"] == "torch.optim.adamw.AdamW"
    assert adamw["groups"][0]["hyperparameters"]["betas"] == {"__tuple__": list(BETAS)}
    assert adamw["groups"][0]["hyperparameters"]["bias_correction"] is True
    step = load_file(str(imported["zero2_ds_adamw"] / "state.safetensors"))
    assert [(v.dtype, float(v)) for v in step.values()] == [(torch.float32, 3.0)] * 2
    sgd = json.loads((imported["zero1_sgd"] / "meta.json").read_text())["optimizer"]
    assert sgd["class"] == "torch.optim.sgd.SGD"
    assert [g["partition_state"] for g in sgd["groups"]] == [["momentum_buffer"]] * 2
    assert [g["scalar_state"] for g in sgd["groups"]] == [{}, {}]
    rank = load_file(str(imported["zero1_sgd"] / "rank00000.safetensors"))
    assert rank["state/momentum_buffer/fc2.weight"].shape == (33,) and rank["state/momentum_buffer/fc2.weight"].abs().sum() > 0


@pytest.mark.parametrize("kind", sorted(EXPECTED["schedules"]))
def test_scheduler_position_continues_deepspeeds_schedule(kind):
    """DeepSpeed's state after 3 steps, imported into partita's schedule of the same config: the next
    5 learning rates are DeepSpeed's (recorded from deepspeed.runtime.lr_schedules itself)."""
    from partita.checkpoint.import_deepspeed import _scheduler_state
    from partita.optim.config import SchedulerConfig
    from partita.optim.schedulers import build_scheduler

    recorded = EXPECTED["schedules"][kind]
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    scheduler = build_scheduler(SchedulerConfig.model_validate({"type": kind, "params": recorded["params"]}), optimizer)
    state = _scheduler_state(recorded["state"], {"scheduler": {"type": kind}})
    assert state == {"last_epoch": 3, "_step_count": 4}
    scheduler.load_state_dict(state)
    lrs = []
    for _ in recorded["next_lrs"]:
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs == pytest.approx(recorded["next_lrs"], rel=1e-12, abs=1e-15)


# ---------------------------------------------------------------------------- resuming


def _resume(paths: list[str], tied: list[bool], kinds: list[str], stages: list[int], micro: int, accumulation: int,
            via_config: bool) -> list[dict]:
    """On every rank: per imported checkpoint, resume partita at ``stages[i]`` and train 2 steps;
    ``via_config``: by ``checkpoint.resume: "latest"`` in initialize, else by engine.load_checkpoint."""
    import partita

    out = []
    rank, world = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0, None
    for path, tie, kind, stage in zip(paths, tied, kinds, stages):
        torch.manual_seed(123)  # other weights than DeepSpeed's: the checkpoint must replace them
        model = TinyNet(tied=tie)
        optimizer = make_optimizer(model, kind)  # the same optimizer as DeepSpeed's run
        config = {
            "train_batch_size": GLOBAL_BATCH,
            "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": accumulation,
            "gradient_clipping": 0.0,
            "zero_optimization": {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})},
            "scheduler": {"type": "WarmupLR", "params": dict(WARMUP)},
            "steps_per_print": 1000,
        }
        if via_config:
            config["checkpoint"] = {"save_dir": path, "resume": "latest"}
        if optimizer is None:  # DeepSpeed's config section {"type": "AdamW"}: partita builds torch's AdamW
            config["optimizer"] = DS_ADAMW
        extra = {"optimizer": optimizer} if optimizer is not None else {"model_parameters": param_groups(model)}
        engine, _, _, _ = partita.initialize(model=model, config=config, **extra)
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        client_state = {"epoch": 1, "note": "fixture"} if via_config else engine.load_checkpoint(path)[1]
        record = {"client_state": client_state, "global_steps": [engine.global_steps], "lr": [], "loss": [], "params": []}
        for step in (4, 5):
            data = EXPECTED["data"][str(step)]
            x, y = rank_slice(torch.tensor(data["x"]), rank, world), rank_slice(torch.tensor(data["y"]), rank, world)
            record["lr"].append(engine.get_lr()[0])
            total = torch.zeros(())
            for m in range(accumulation):
                xs, ys = x[m * micro : (m + 1) * micro], y[m * micro : (m + 1) * micro]
                loss = torch.nn.functional.mse_loss(engine(xs), ys)
                engine.backward(loss)
                engine.step()
                total += loss.detach() / accumulation
            torch.distributed.all_reduce(total)
            record["loss"].append(float(total) / world)
            record["global_steps"].append(engine.global_steps)
            with partita.zero.GatheredParameters(list(model.parameters())):
                record["params"].append({n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)})
        out.append(record)
    return out


def _check_resumed(records: list[dict], where: str) -> None:
    assert len(records) == len(FP32)
    for stage, record in zip(FP32, records):
        want = RUNS[stage]["resumed"]
        assert record["client_state"] == {"epoch": 1, "note": "fixture"}, where
        assert record["global_steps"] == [3, 4, 5], where
        assert record["lr"] == pytest.approx([w["lr"] for w in want], rel=1e-12), (where, stage)
        assert record["loss"] == pytest.approx([w["loss"] for w in want], rel=1e-5), (where, stage)
        for step, (got, expected) in enumerate(zip(record["params"], want), 4):
            for name, values in expected["params"].items():
                err = _rel(got[name].reshape(-1), torch.tensor(values))
                assert err < 1e-5, (where, f"DeepSpeed stage {stage}", f"step {step}", name, err)


def _resume_args(imported: dict[str, Path], stages: list[int]) -> tuple:
    kinds = [OPTIMIZERS.get(r, "torch_adamw") for r in FP32]
    return [str(imported[r].parent) for r in FP32], [r.endswith("tied_frozen") for r in FP32], kinds, stages


def test_resume_on_four_ranks_equals_deepspeeds_resume(imported):
    """DeepSpeed's 2-rank checkpoints, resumed on 4 ranks (micro-batch 2) at other ZeRO stages, by the
    config's ``checkpoint.resume``."""
    records = run_distributed(_resume, 4, *_resume_args(imported, [3, 3, 1, 2, 1, 3, 0, 3, 2, 3, 1]), 2, 1, True, timeout=600)[0]
    _check_resumed(records, "world 4")


def test_resume_on_one_rank_equals_deepspeeds_resume(imported):
    """The same on 1 rank with 2 micro-batches of 4 accumulated, at ZeRO 0 and 3."""
    records = run_distributed(_resume, 1, *_resume_args(imported, [3, 0, 3, 0, 0, 3, 2, 0, 3, 0, 3]), 4, 2, False, timeout=600)[0]
    _check_resumed(records, "world 1")


# ---------------------------------------------------------------------------- names that differ


def _wrapped_resume(plain: str, renamed: str) -> dict:
    """World 1: a model whose keys carry a prefix refuses the plain import and takes the renamed one."""
    import partita
    from partita.checkpoint.errors import CheckpointError, CheckpointMismatchError

    model = torch.nn.Sequential(TinyNet())
    optimizer = torch.optim.AdamW(param_groups(model), lr=LR, betas=BETAS, eps=EPS)
    config = {"train_batch_size": GLOBAL_BATCH, "gradient_clipping": 0.0, "zero_optimization": {"stage": 1},
              "scheduler": {"type": "WarmupLR", "params": dict(WARMUP)}, "steps_per_print": 1000}
    engine, _, _, _ = partita.initialize(model=model, optimizer=optimizer, config=config)
    try:
        engine.load_checkpoint(plain)
        refused = None
    except CheckpointMismatchError as error:
        refused = str(error)
    try:  # DeepSpeed's own directory, not converted
        engine.load_checkpoint(str(FIXTURES / "zero2"))
        unconverted = None
    except CheckpointError as error:
        unconverted = str(error)
    engine.load_checkpoint(renamed)
    return {"refused": refused, "unconverted": unconverted, "steps": engine.global_steps,
            "weight": model[0].fc2.weight.detach().reshape(-1).clone(), "lr": engine.get_lr()[0]}


def test_mismatched_names_are_refused_and_rename_fixes_them(imported, tmp_path):
    renamed = import_deepspeed(FIXTURES / "zero2", tmp_path / "renamed", rename={"": "0."})
    meta = json.loads((renamed / "meta.json").read_text())
    assert sorted(meta["optimizer"]["params"]) == ["0.fc1.bias", "0.fc1.weight", "0.fc2.bias", "0.fc2.weight"]
    (result,) = run_distributed(_wrapped_resume, 1, str(imported["zero2"].parent), str(renamed.parent), timeout=300)
    assert result["refused"] == (
        "the checkpoint's model does not match this model: missing in the checkpoint: 0.scale, 0.fc1.weight, "
        "0.fc1.bias, 0.fc2.weight, 0.fc2.bias; not in this model: scale, fc1.weight, fc1.bias, fc2.weight, fc2.bias; "
        "pass load_module_strict=False to load the keys both have"
    )
    assert result["unconverted"] == (
        f"load_checkpoint did not start: rank 0: rank 0 could not list the checkpoints in {FIXTURES / 'zero2'}: "
        f"CheckpointError: {FIXTURES / 'zero2' / TAG} is a DeepSpeed checkpoint, not a partita one; convert it once "
        f"with `partita checkpoint import-deepspeed {FIXTURES / 'zero2'} OUT` and load OUT (it resumes at any world "
        "size and ZeRO stage)"
    )
    assert result["steps"] == 3
    assert torch.equal(result["weight"], torch.tensor(RUNS["zero2"]["saved"]["params"]["fc2.weight"]))
    assert result["lr"] == pytest.approx(RUNS["zero2"]["saved"]["lr_next"], rel=1e-12)


def test_model_file_and_optimizer_files_that_disagree_are_refused(tmp_path):
    """A model file whose parameter names are not the optimizer's (param_shapes): refused, naming them."""
    ds = _copy_fixture("zero1", tmp_path)
    path = ds / TAG / "mp_rank_00_model_states.pt"
    state = torch.load(path, weights_only=True)
    state["module"] = {("fc1.w" if k == "fc1.weight" else k): v for k, v in state["module"].items()}
    torch.save(state, path)
    with pytest.raises(DeepSpeedImportError) as error:
        import_deepspeed(ds, tmp_path / "out")
    assert str(error.value) == (
        "the optimizer holds parameters ['fc1.weight'] that the module's state_dict lacks; the model file and the "
        "optimizer files come from different models"
    )


def test_rename_that_merges_names_is_refused(tmp_path):
    with pytest.raises(DeepSpeedImportError) as error:
        import_deepspeed(FIXTURES / "zero1", tmp_path / "out", rename={"fc1.": "x.", "fc2.": "x."})
    assert str(error.value) == (
        "rename {'fc1.': 'x.', 'fc2.': 'x.'} maps several keys to ['x.bias', 'x.weight']; give prefixes that keep "
        "names distinct"
    )


# ---------------------------------------------------------------------------- tags and files


def _copy_fixture(run: str, root: Path) -> Path:
    target = root / f"ds_{run}"
    shutil.copytree(FIXTURES / run, target)
    return target


def test_latest_is_honoured_and_tag_picks_another(tmp_path):
    ds = _copy_fixture("zero1", tmp_path)
    shutil.copytree(ds / TAG, ds / "older")
    (ds / "latest").write_text("older")
    assert import_deepspeed(ds, tmp_path / "out").name == "older"
    assert (tmp_path / "out" / "latest").read_text().strip() == "older"
    out = import_deepspeed(ds, tmp_path / "out", tag=TAG, out_tag="picked")
    assert out.name == "picked" and (tmp_path / "out" / "latest").read_text().strip() == "picked"
    assert import_deepspeed(ds / TAG, tmp_path / "direct").name == TAG  # a tag directory itself


def test_missing_tag_and_missing_latest_are_refused(tmp_path):
    ds = _copy_fixture("zero2", tmp_path)
    with pytest.raises(DeepSpeedImportError) as error:
        import_deepspeed(ds, tmp_path / "out", tag="global_step9")
    assert str(error.value) == f"{ds} has no tag 'global_step9' (tags there: {TAG}); pass one of them with --tag"
    (ds / "latest").unlink()
    with pytest.raises(DeepSpeedImportError) as error:
        import_deepspeed(ds, tmp_path / "out")
    assert str(error.value) == f"{ds} has no 'latest' file and is not a tag directory; pass --tag ({TAG})"
    (ds / "latest").write_text("global_step7")
    with pytest.raises(DeepSpeedImportError) as error:
        import_deepspeed(ds, tmp_path / "out")
    assert str(error.value) == (
        f"{ds / 'latest'} names tag 'global_step7', which is not a directory in {ds}; pass an existing tag with --tag")
    with pytest.raises(DeepSpeedImportError) as error:
        import_deepspeed(tmp_path / "nowhere", tmp_path / "out")
    assert str(error.value) == f"{tmp_path / 'nowhere'} does not exist or is not a directory; pass DeepSpeed's save_dir"
    assert not (tmp_path / "out").exists()


def test_missing_rank_file_is_refused(tmp_path):
    ds = _copy_fixture("zero3", tmp_path)
    (ds / TAG / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(DeepSpeedImportError) as error:
        import_deepspeed(ds, tmp_path / "out")
    assert str(error.value) == (
        f"{ds / TAG} was saved by 2 data-parallel ranks but holds the optimizer files of ranks [0]; copy every rank's "
        "zero_pp_rank_<r>_mp_rank_00_optim_states.pt into the tag directory"
    )


def test_model_parallel_checkpoint_is_not_implemented(tmp_path):
    ds = _copy_fixture("zero1", tmp_path)
    shutil.copy(ds / TAG / "mp_rank_00_model_states.pt", ds / TAG / "mp_rank_01_model_states.pt")
    with pytest.raises(NotImplementedError) as error:
        import_deepspeed(ds, tmp_path / "out")
    assert str(error.value) == (
        f"{ds / TAG} is a tensor/model-parallel DeepSpeed checkpoint (model-parallel ranks [0, 1]); the importer reads "
        "checkpoints with one model-parallel rank (mp_rank_00) only. Convert it with DeepSpeed's ds_to_universal.py or "
        "zero_to_fp32.py into whole weights first"
    )


# ---------------------------------------------------------------------------- unpickling


class _RunsCode:
    """Unpickling this would run a shell command (the attack weights_only=True prevents)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def test_unknown_pickled_global_is_refused_by_name(tmp_path):
    import argparse

    ds = _copy_fixture("zero0", tmp_path)
    path = ds / TAG / "mp_rank_00_model_states.pt"
    state = torch.load(path, weights_only=True)
    torch.save({**state, "args": argparse.Namespace(lr=0.1)}, path)
    with pytest.raises(DeepSpeedImportError) as error:
        import_deepspeed(ds, tmp_path / "out")
    assert str(error.value) == (
        f"{path} holds the pickled global argparse.Namespace, which partita does not unpickle: the importer rebuilds "
        "only tensors, plain containers and DeepSpeed's LossScaler, DynamicLossScaler, ZeroStageEnum, "
        "fragment_address, so a file cannot run code. Save that object in a plain form (numbers, strings, lists, "
        "dicts, tensors), e.g. in the client_state passed to save_checkpoint, and save again"
    )
    marker = tmp_path / "ran"
    torch.save({**state, "payload": _RunsCode(marker)}, path)
    with pytest.raises(DeepSpeedImportError, match=r"holds the pickled global (posix|os)\.system, which partita"):
        import_deepspeed(ds, tmp_path / "out")
    assert not marker.exists()


def test_deepspeed_classes_load_as_inert_stand_ins():
    """The allow-listed DeepSpeed classes come back as stand-ins holding the pickled attributes."""
    from partita.checkpoint.import_deepspeed_read import FragmentAddress, LossScaler, ZeroStageEnum, safe_load

    state = safe_load(FIXTURES / "zero2" / TAG / "zero_pp_rank_1_mp_rank_00_optim_states.pt")["optimizer_state_dict"]
    assert type(state["loss_scaler"]) is LossScaler and vars(state["loss_scaler"]) == {"cur_scale": 1.0, "dynamic": False}
    assert state["zero_stage"] is ZeroStageEnum.gradients
    assert state["param_slice_mappings"][0]["fc2.weight"] == FragmentAddress(numel=33, start=21)
    assert state["group_paddings"] == [2, 2]


# ---------------------------------------------------------------------------- ZeRO 0's names


def test_stage0_names_follow_the_module_and_ambiguity_is_refused():
    from partita.checkpoint.import_deepspeed_state import stage0_names

    module = {"a": torch.zeros(3), "b": torch.zeros(3), "w": torch.zeros(2, 3)}
    state = {0: {"exp_avg": torch.zeros(2, 3)}, 1: {"exp_avg": torch.zeros(3)}, 2: {"exp_avg": torch.zeros(3)}}
    assert stage0_names(module, [], [{"params": [0]}, {"params": [1, 2]}], state) == [["w"], ["a", "b"]]
    with pytest.raises(DeepSpeedImportError) as error:
        stage0_names(module, [], [{"params": [1]}, {"params": [2]}], state)
    assert str(error.value) == (
        "a ZeRO-0 DeepSpeed checkpoint does not record which parameter each optimizer entry belongs to, and several "
        "assignments match the saved shapes (2 param groups of [1, 1] parameters over the module's 3); pass the names "
        "with import_deepspeed(..., stage0_param_names=[[names of group 0], ...]) or --param-names FILE (a JSON list "
        "of lists), in the order given to the optimizer"
    )


def test_stage0_param_names_given(tmp_path):
    names = [["fc1.weight", "fc2.weight"], ["fc1.bias", "fc2.bias"]]
    out = import_deepspeed(FIXTURES / "zero0", tmp_path / "out", stage0_param_names=names)
    rank = load_file(str(out / "rank00000.safetensors"))
    assert torch.equal(rank["master/fc2.bias"], torch.tensor(RUNS["zero0"]["saved"]["params"]["fc2.bias"]))
    with pytest.raises(DeepSpeedImportError) as error:
        import_deepspeed(FIXTURES / "zero0", tmp_path / "out", stage0_param_names=[["fc1.weight"], names[1]])
    assert str(error.value) == "stage0_param_names has [1, 2] names per group; the optimizer's groups hold [2, 2] parameters"


# ---------------------------------------------------------------------------- command line


def test_command_line(tmp_path, capsys):
    out = tmp_path / "out"
    assert checkpoint_main(["import-deepspeed", str(FIXTURES / "zero3"), str(out)]) == 0
    assert capsys.readouterr().out == (
        f"wrote {out / TAG} from DeepSpeed 0.19.8 ZeRO-3 (2 ranks), step 3, 4 parameters\n")
    assert checkpoint_main(["verify", str(out)]) == 0
    assert checkpoint_main(["consolidate", str(out), str(tmp_path / "whole")]) == 0  # DeepSpeed's zero_to_fp32, in effect
    whole = load_file(str(tmp_path / "whole" / "model-00001-of-00001.safetensors"))
    for name, values in RUNS["zero3"]["saved"]["params"].items():
        assert torch.equal(whole[name].reshape(-1), torch.tensor(values)), name
    capsys.readouterr()
    assert checkpoint_main(["import-deepspeed", str(FIXTURES / "zero3"), str(out), "--tag", "nope"]) == 2
    assert capsys.readouterr().err.endswith(
        f"partita checkpoint: error: {FIXTURES / 'zero3'} has no tag 'nope' (tags there: {TAG}); pass one of them "
        "with --tag\n")
    assert checkpoint_main(["import-deepspeed", str(FIXTURES / "zero1"), str(out), "--rename", "nothing"]) == 2
    assert "--rename 'nothing': expected OLD=NEW" in capsys.readouterr().err
    names = tmp_path / "names.json"
    names.write_text(json.dumps([["fc1.weight", "fc2.weight"], ["fc1.bias", "fc2.bias"]]))
    assert checkpoint_main(["import-deepspeed", str(FIXTURES / "zero0"), str(tmp_path / "z0"), "--param-names", str(names),
                            "--optimizer-class", "torch.optim.adam.Adam", "--rename", "fc=layer", "--out-tag", "x"]) == 0
    meta = json.loads((tmp_path / "z0" / "x" / "meta.json").read_text())
    assert meta["optimizer"]["class"] == "torch.optim.adam.Adam"
    assert [g["params"] for g in meta["optimizer"]["groups"]] == [["layer1.weight", "layer2.weight"],
                                                                  ["layer1.bias", "layer2.bias"]]
    names.write_text("[[oops")
    assert checkpoint_main(["import-deepspeed", str(FIXTURES / "zero0"), str(tmp_path / "z0"), "--param-names", str(names)]) == 2
    assert f"--param-names {names}: not JSON" in capsys.readouterr().err


# ---------------------------------------------------------------------------- fp16 and layouts not read


def test_fp16_loss_scale_maps_to_partitas_scaler():
    """DeepSpeed refuses fp16 on CPU, so no fixture: its DynamicLossScaler attributes (as pickled,
    runtime/fp16/loss_scaler.py) become partita's dynamic scaler state; a static scale its static one."""
    from partita.checkpoint.import_deepspeed import _loss_scaler
    from partita.checkpoint.import_deepspeed_read import DynamicLossScaler, LossScaler
    from partita.precision.loss_scaler import DynamicLossScaler as PartitaDynamic

    scaler = DynamicLossScaler()
    scaler.__dict__.update(cur_scale=64.0, cur_iter=9, last_overflow_iter=6, scale_factor=2.0, scale_window=2,
                           min_scale=1, delayed_shift=2, cur_hysteresis=1, consecutive_hysteresis=False, dynamic=True)
    fp16 = {"fp16": {"enabled": True}}
    state = _loss_scaler({"loss_scaler": scaler, "dynamic_loss_scale": True}, fp16)
    assert state == {"type": "dynamic", "scale": 64.0, "cur_hysteresis": 1, "cur_iter": 9, "last_overflow_iter": 6}
    static = LossScaler()
    static.__dict__.update(cur_scale=128.0, dynamic=False)
    assert _loss_scaler({"loss_scaler": static, "dynamic_loss_scale": False}, fp16) == {"type": "static", "scale": 128.0}
    # ZeRO 0's FP16 optimizer keeps the attributes at the top level of its state.
    assert _loss_scaler({"dynamic_loss_scale": True, "cur_scale": 32.0, "cur_iter": 4, "last_overflow_iter": -1}, fp16) == {
        "type": "dynamic", "scale": 32.0, "cur_hysteresis": 1, "cur_iter": 4, "last_overflow_iter": -1}
    assert _loss_scaler({"loss_scaler": static}, {}) is None  # fp32 and bf16 keep no scaler
    restored = PartitaDynamic(init_scale=2.0**16, scale_window=2, hysteresis=2)
    restored.load_state_dict(state)
    assert restored.state_dict() == state


def test_elastic_checkpoint_is_not_implemented(tmp_path):
    with pytest.raises(NotImplementedError) as error:
        import_deepspeed(FIXTURES / "zero1_elastic", tmp_path / "out")
    assert str(error.value) == (
        f"{FIXTURES / 'zero1_elastic' / TAG} was saved with zero_optimization.elastic_checkpoint, which keeps no "
        "param-group hyperparameters (lr, betas, weight decay of each group), so the optimizer state cannot be "
        "resumed exactly (DeepSpeed 0.19.8 itself cannot load it for torch optimizers); save with elastic_checkpoint "
        "false, or take the weights alone (DeepSpeed's zero_to_fp32.py, then load_module_only)"
    )
    assert not (tmp_path / "out").exists()


def test_bf16_optimizer_layout_at_zero0_is_not_implemented(tmp_path):
    ds = _copy_fixture("zero0_bf16", tmp_path)
    shutil.copy(FIXTURES / "zero2_bf16" / TAG / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", ds / TAG)
    with pytest.raises(NotImplementedError) as error:
        import_deepspeed(ds, tmp_path / "out")
    assert str(error.value) == (
        f"{ds / TAG} holds per-rank optimizer files at ZeRO 0 (bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt, ...): "
        "DeepSpeed's BF16_Optimizer, whose flat fp32 layout the importer does not read. Import a ZeRO 1-3 checkpoint "
        "of the run, or take the weights alone (DeepSpeed's zero_to_fp32.py, then load_module_only)"
    )


def _resume_bf16(path: str, stage: int, micro: int, accumulation: int) -> list[dict[str, torch.Tensor]]:
    """One rank: partita in bf16 resumes DeepSpeed's bf16 ZeRO-2 checkpoint; whole bf16 weights after steps 4, 5."""
    import partita

    torch.manual_seed(5)
    model = TinyNet()
    optimizer = torch.optim.AdamW(param_groups(model), lr=LR, betas=BETAS, eps=EPS)
    config = {"train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": micro,
              "gradient_accumulation_steps": accumulation, "gradient_clipping": 0.0, "bf16": {"enabled": True},
              "zero_optimization": {"stage": stage}, "scheduler": {"type": "WarmupLR", "params": dict(WARMUP)},
              "steps_per_print": 1000}
    engine, _, _, _ = partita.initialize(model=model, optimizer=optimizer, config=config)
    engine.load_checkpoint(path)
    out = []
    for step in (4, 5):
        data = EXPECTED["data"][str(step)]
        x, y = torch.tensor(data["x"]), torch.tensor(data["y"])
        for m in range(accumulation):
            xs, ys = x[m * micro : (m + 1) * micro], y[m * micro : (m + 1) * micro]
            engine.backward(torch.nn.functional.mse_loss(engine(xs.bfloat16()).float(), ys))
            engine.step()
        with partita.zero.GatheredParameters(list(model.parameters())):
            out.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return out


def test_bf16_resume_follows_deepspeeds_bf16_resume(imported):
    """bf16 at ZeRO 2 -> partita bf16 at ZeRO 3 on 1 rank: step 4's weights are DeepSpeed's bit for bit; step 5
    differs in at most 2 elements of a tensor by one bf16 rounding (the bf16 gradients' summation order)."""
    steps = run_distributed(_resume_bf16, 1, str(imported["zero2_bf16"].parent), 3, 4, 2, timeout=300)[0]
    want = RUNS["zero2_bf16"]["resumed"]
    for name, values in want[0]["params"].items():
        assert steps[0][name].dtype == torch.bfloat16
        assert torch.equal(steps[0][name].float().reshape(-1), torch.tensor(values)), name
    for name, values in want[1]["params"].items():
        got, expected = steps[1][name].float().reshape(-1), torch.tensor(values)
        assert int((got != expected).sum()) <= 2, name
        assert _rel(got, expected) < 1e-3, name


def test_zero0_fused_fp16_optimizer_layout(imported, tmp_path):
    """DeepSpeed's FP16_Optimizer (ZeRO 0, fused optimizers) keeps one flat fp32 tensor per group
    (``fp32_groups_flat``) where FP16_UnfusedOptimizer keeps ``fp32_groups``: the zero0_bf16 file
    rewritten in that layout imports to the same masters."""
    ds = _copy_fixture("zero0_bf16", tmp_path)
    path = ds / TAG / "mp_rank_00_model_states.pt"
    state = torch.load(path, weights_only=True)
    groups = state["optimizer"].pop("fp32_groups")
    state["optimizer"]["fp32_groups_flat"] = [torch.cat([t.reshape(-1) for t in group]) for group in groups]
    torch.save(state, path)
    flat = load_file(str(import_deepspeed(ds, tmp_path / "out") / "rank00000.safetensors"))
    whole = load_file(str(imported["zero0_bf16"] / "rank00000.safetensors"))
    assert sorted(flat) == sorted(whole)
    for key, value in flat.items():
        assert torch.equal(value, whole[key]), key
