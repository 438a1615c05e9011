"""``partita tune``: a real search on a tiny GPT with 2 processes, and the tuner's rules on fake trials."""

from __future__ import annotations

import csv
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from partita.autotune import tuner as tuner_module
from partita.autotune.config import AutotuningConfig
from partita.autotune.runner import TrialOutcome, _last_error, run_trial
from partita.autotune.space import TrialPoint, micro_batch_candidates, points
from partita.autotune.trial_env import OVERRIDE_ENV, REPORT_ENV, STEPS_ENV, TrialReporter, apply_config_override
from partita.autotune.tuner import TuneOptions, best_record, tune
from partita.config import ConfigError, load_config
from partita.launcher.cli import main
from tests.test_launcher import child_env, partita_command

SCRIPT = Path(__file__).resolve().parent / "autotune_scripts" / "tiny_gpt_train.py"
TINY_GPT_PARAMS = 28_032  # GPTConfig(vocab 64, block 16, 2 layers, 2 heads, width 32), tied head counted once
BASE = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


# ----------------------------------------------------------------------------- the real search

def test_tune_tiny_gpt_two_processes_prunes_records_failures_and_keeps_the_fastest(tmp_path: Path) -> None:
    config = {**BASE, "autotuning": {
        "enabled": True, "start_profile_step": 2, "end_profile_step": 3, "results_dir": str(tmp_path / "results"),
        "exps_dir": str(tmp_path / "exps"), "arg_mappings": {"train_micro_batch_size_per_gpu": "--batch-flag"},
        "tuner_num_trials": 3}}
    config_path = tmp_path / "ds.json"
    config_path.write_text(json.dumps(config))
    # Stage 3's estimate (560,644 B per rank for this model on 2 ranks) is above the 530,000 B
    # given, stages 1 and 2 (504,580 B) are below: stage 3 is pruned without a launch. Three
    # trials run (tuner_num_trials), the third of them after a deliberate crash; the fourth is skipped.
    result = subprocess.run(
        [*partita_command(), "tune", str(SCRIPT), "--config", str(config_path), "--nproc", "2", "--stages", "1,2,3",
         "--micro-batches", "2,4", "--checkpointing", "none", "--offload", "none",
         "--model-params", str(TINY_GPT_PARAMS), "--gpu-memory", "530000", "--headroom", "0",
         "--", str(config_path), "--crash-at", "1:4"],
        env=child_env(), capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    with open(tmp_path / "results" / "trials.csv") as f:
        rows = {row["trial"]: row for row in csv.DictReader(f)}
    assert {name: row["status"] for name, row in rows.items()} == {
        "z3_mb2_ckpt-none_off-none": "pruned", "z3_mb4_ckpt-none_off-none": "pruned",
        "z1_mb2_ckpt-none_off-none": "ok", "z1_mb4_ckpt-none_off-none": "failed",
        "z2_mb2_ckpt-none_off-none": "ok", "z2_mb4_ckpt-none_off-none": "skipped"}
    assert rows["z3_mb2_ckpt-none_off-none"]["note"] == "estimated 0.000522 GiB per rank > 0.000494 GiB available"
    assert rows["z1_mb4_ckpt-none_off-none"]["note"] == (
        "exit 1: RuntimeError: deliberate crash at stage:micro-batch 1:4")
    assert rows["z2_mb4_ckpt-none_off-none"]["note"] == "tuner_num_trials 3 reached"
    finished = [row for row in rows.values() if row["status"] == "ok"]
    for row in finished:
        assert float(row["tokens_per_sec"]) > 0 and float(row["peak_memory_gib"]) > 0
        # samples/s x 16 tokens per sample = tokens/s; one step is the global batch (mb x 2 ranks).
        assert float(row["tokens_per_sec"]) == pytest.approx(16 * float(row["samples_per_sec"]), rel=1e-4)
        assert float(row["step_seconds"]) == pytest.approx(4 / float(row["samples_per_sec"]), rel=1e-4)
    fastest = max(finished, key=lambda row: float(row["samples_per_sec"]))
    best = json.loads((tmp_path / "results" / "best_config.json").read_text())
    stage = int(fastest["zero_stage"])
    assert best == {**config, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                    "train_batch_size": 4, "zero_optimization": {
                        "stage": stage, "offload_optimizer": {"device": "none"}, "offload_param": {"device": "none"}}}
    assert f"best (throughput): {fastest['trial']} -> {tmp_path / 'results' / 'best_config.json'}" in result.stdout
    for name in rows:
        launched = rows[name]["status"] not in ("pruned", "skipped")
        assert (name in result.stdout) and ((tmp_path / "exps" / name).exists() == launched)
    trial = json.loads((tmp_path / "exps" / "z1_mb2_ckpt-none_off-none" / "config.json").read_text())
    assert trial["steps_per_print"] == 3 and trial["throughput"] == {"warmup_steps": 1}


# ----------------------------------------------------------------------------- the tuner on fake trials

def options(**changes: Any) -> TuneOptions:
    section = changes.pop("autotuning", {})
    values = dict(script=str(SCRIPT), script_args=(), base_config=BASE, autotuning=AutotuningConfig(**section),
                  nproc=2, stages=(1,), micro_batches=(2,), checkpointing=("none",), offload=("none",))
    values.update(changes)
    return TuneOptions(**values)


class FakeTrials:
    """Stands in for run_trial: samples/s from a table by trial name, parameters reported."""

    def __init__(self, samples: dict[str, float | None]) -> None:
        self.samples = samples
        self.calls: list[tuple[str, list[str]]] = []

    def __call__(self, *, folder: Path, config: dict, script_args: list[str], **_: Any) -> TrialOutcome:
        folder.mkdir(parents=True, exist_ok=True)
        self.calls.append((folder.name, script_args))
        value = self.samples[folder.name]
        if value is None:
            return TrialOutcome("oom", 1.0, error="torch.OutOfMemoryError: x")
        return TrialOutcome("ok", 1.0, {"avg_samples_per_sec": value, "avg_tokens_per_sec": 16 * value,
                                        "memory_peak_gib": 1.0, "parameters": TINY_GPT_PARAMS})


def run_fake(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, samples: dict[str, float | None], **changes: Any):
    fake = FakeTrials(samples)
    monkeypatch.setattr(tuner_module, "run_trial", fake)
    records = tune(options(**changes), exps_dir=tmp_path / "exps", csv_path=tmp_path / "trials.csv")
    return records, fake


def test_the_first_trials_parameter_count_prunes_the_rest(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    records, fake = run_fake(monkeypatch, tmp_path, {"z1_mb2_ckpt-none_off-none": 10.0},
                             stages=(1, 3), memory_budget_bytes=530_000.0)
    assert [(r.point.name, r.status) for r in records] == [
        ("z1_mb2_ckpt-none_off-none", "ok"), ("z3_mb2_ckpt-none_off-none", "pruned")]
    assert records[1].estimated_bytes == 560_644 and len(fake.calls) == 1


def test_early_stopping_and_the_trial_limit(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    names = [f"z1_mb{mb}_ckpt-none_off-none" for mb in (1, 2, 4, 8, 16)]
    # Failures before the first finished trial do not count; after it, two without improvement stop.
    records, _ = run_fake(monkeypatch, tmp_path, dict(zip(names, [None, 9.0, 8.0, None, 20.0])),
                          micro_batches=(1, 2, 4, 8, 16), autotuning={"tuner_early_stopping": 2})
    assert [r.status for r in records] == ["oom", "ok", "ok", "oom", "skipped"]
    assert records[4].note == "early stop: 2 trials in a row without improvement (tuner_early_stopping)"
    names = names[:4]
    records, _ = run_fake(monkeypatch, tmp_path, dict(zip(names, [1.0, 2.0, 3.0, 4.0])), micro_batches=(1, 2, 4, 8),
                          autotuning={"tuner_num_trials": 2})
    assert [r.status for r in records] == ["ok", "ok", "skipped", "skipped"]
    assert best_record(records, "throughput").point.micro_batch == 2
    with open(tmp_path / "trials.csv") as f:
        assert [row["status"] for row in csv.DictReader(f)] == ["ok", "ok", "skipped", "skipped"]


def test_tune_command_writes_where_its_flags_say(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                capsys: pytest.CaptureFixture) -> None:
    config = tmp_path / "ds.json"
    config.write_text(json.dumps(BASE))
    monkeypatch.setattr(tuner_module, "run_trial", FakeTrials({"z1_mb2_ckpt-none_off-none": 3.0,
                                                               "z2_mb2_ckpt-none_off-none": 7.0}))
    assert main(["tune", str(SCRIPT), "--config", str(config), "--stages", "1,2", "--micro-batches", "2",
                 "--checkpointing", "none", "--offload", "none", "--out", str(tmp_path / "best.json"),
                 "--csv", str(tmp_path / "t.csv"), "--exps-dir", str(tmp_path / "x"), "--", "--data", "d"]) == 0
    assert json.loads((tmp_path / "best.json").read_text())["zero_optimization"]["stage"] == 2
    assert (tmp_path / "t.csv").read_text().count("\n") == 3 and (tmp_path / "x" / "z2_mb2_ckpt-none_off-none").is_dir()
    out = capsys.readouterr().out
    lines = [line.split() for line in out.splitlines()]
    header = lines.index(["trial", "status", "tokens/s", "samples/s", "peak", "GiB", "est.", "GiB", "note"])
    assert [line[:4] for line in lines[header + 1:header + 3]] == [
        ["z1_mb2_ckpt-none_off-none", "ok", "48", "3"], ["z2_mb2_ckpt-none_off-none", "ok", "112", "7"]]
    assert f"best (throughput): z2_mb2_ckpt-none_off-none -> {tmp_path / 'best.json'}" in out


def test_batch_bounds_random_order_and_arg_mappings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    samples = {p.name: float(p.micro_batch) for p in points(stages=(1, 2), micro_batches=(1, 2, 4),
                                                             checkpointing=("none",), offload=("none",),
                                                             gradient_accumulation_steps=1, world_size=2)}
    section = {"tuner_type": "random", "max_train_batch_size": 4, "min_train_batch_size": 4,
               "arg_mappings": {"train_micro_batch_size_per_gpu": "--mb", "zero_optimization.stage": "--zero"}}
    records, fake = run_fake(monkeypatch, tmp_path, samples, stages=(1, 2), micro_batches=(1, 2, 4), autotuning=section)
    refused = {r.point.name: r.note for r in records if r.status == "pruned"}
    assert refused == {name: f"global batch {2 * mb} outside [4, 4] (min/max_train_batch_size)"
                       for name, mb in (("z1_mb1_ckpt-none_off-none", 1), ("z1_mb4_ckpt-none_off-none", 4),
                                        ("z2_mb1_ckpt-none_off-none", 1), ("z2_mb4_ckpt-none_off-none", 4))}
    assert sorted(fake.calls) == [("z1_mb2_ckpt-none_off-none", ["--mb", "2", "--zero", "1"]),
                                  ("z2_mb2_ckpt-none_off-none", ["--mb", "2", "--zero", "2"])]


def test_micro_batch_sizes_kept_per_group(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert micro_batch_candidates(3, 20) == [3, 4, 8, 16, 20]
    samples = {f"z1_mb{mb}_ckpt-none_off-none": float(mb) for mb in (1, 2, 4, 8)}
    section = {"max_train_micro_batch_size_per_gpu": 8, "num_tuning_micro_batch_sizes": 2}
    # No memory limit: nothing says the large ones fit, so the smallest run.
    records, _ = run_fake(monkeypatch, tmp_path, samples, micro_batches=None, autotuning=section)
    assert [r.point.micro_batch for r in records] == [1, 2]
    # A limit and a known model: the largest that fit.
    records, _ = run_fake(monkeypatch, tmp_path, samples, micro_batches=None, autotuning=section,
                          model=TINY_GPT_PARAMS, memory_budget_bytes=1e9)
    assert [r.point.micro_batch for r in records] == [4, 8]


def test_overwrite_false_reuses_recorded_trials(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    samples = {"z1_mb2_ckpt-none_off-none": 5.0}
    run_fake(monkeypatch, tmp_path, samples)
    records, fake = run_fake(monkeypatch, tmp_path, samples, autotuning={"overwrite": False})
    assert fake.calls == [] and records[0].status == "ok" and records[0].metrics["avg_samples_per_sec"] == 5.0
    assert records[0].note == "(result reused: overwrite false)"


def test_metrics_rank_as_deepspeed_says() -> None:
    point = TrialPoint(1, 2, "none", "none", 1, 2)
    fast = tuner_module._record(point, TrialOutcome("ok", 1, {"avg_samples_per_sec": 8.0, "tflops_per_device": 1.0}),
                                None, reused=False)
    slow = tuner_module._record(TrialPoint(2, 2, "none", "none", 1, 2),
                                TrialOutcome("ok", 1, {"avg_samples_per_sec": 4.0, "tflops_per_device": 2.0}),
                                None, reused=False)
    assert fast.metrics["step_seconds"] == 0.5 and slow.metrics["step_seconds"] == 1.0
    assert best_record([slow, fast], "throughput") is fast and best_record([slow, fast], "latency") is fast
    assert best_record([fast, slow], "flops") is slow
    assert best_record([tuner_module.TrialRecord(point, "oom")], "throughput") is None


# ----------------------------------------------------------------------------- trial configs and hooks

def test_trial_configs_replace_whole_sections() -> None:
    base = {**BASE, "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "nvme", "nvme_path": "/x"}},
            "activation_checkpointing": {"policy": "every_k", "k": 2, "block_types": ["Block"]},
            "checkpoint": {"save_dir": "/ckpt", "resume": "latest", "async_save": True},
            "tensorboard": {"enabled": True, "output_path": "tb"}}
    tuned = TrialPoint(3, 4, "every", "cpu+param", 2, 2).tuned_config(base)
    assert tuned["zero_optimization"] == {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                          "offload_param": {"device": "cpu"}}
    assert tuned["activation_checkpointing"] == {"block_types": ["Block"], "policy": "every"}
    assert (tuned["train_micro_batch_size_per_gpu"], tuned["gradient_accumulation_steps"], tuned["train_batch_size"]) == (4, 2, 16)
    assert TrialPoint(1, 1, "none", "none", 1, 2).tuned_config(base)["activation_checkpointing"] == {}
    trial = TrialPoint(2, 2, "selective", "cpu", 1, 2).trial_config(base, steps=5, warmup_steps=2)
    assert trial["checkpoint"] == {"async_save": True} and trial["tensorboard"] == {"enabled": False}
    assert trial["steps_per_print"] == 5 and trial["throughput"] == {"warmup_steps": 2}
    load_config(trial)  # every trial config is one initialize() accepts
    with pytest.raises(ValueError, match=r"no valid trial in stages \[0\] x offload \['cpu'\]"):
        points(stages=(0,), micro_batches=(1,), checkpointing=("none",), offload=("cpu",),
               gradient_accumulation_steps=1, world_size=1)


def test_config_override_and_reporter_hooks(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(OVERRIDE_ENV, raising=False)
    assert apply_config_override(BASE) is BASE
    override = tmp_path / "trial.json"
    override.write_text(json.dumps({"train_micro_batch_size_per_gpu": 8}))
    monkeypatch.setenv(OVERRIDE_ENV, str(override))
    assert apply_config_override("whatever.json") == {"train_micro_batch_size_per_gpu": 8}
    monkeypatch.setenv(STEPS_ENV, "0")
    monkeypatch.setenv(REPORT_ENV, str(tmp_path / "r.json"))
    with pytest.raises(ValueError, match=r"PARTITA_TRIAL_STEPS='0' must be a positive integer"):
        TrialReporter.from_env()
    monkeypatch.delenv(STEPS_ENV)
    assert TrialReporter.from_env() is None


def test_a_trial_that_runs_out_of_memory_is_recorded_as_oom(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = tmp_path / "oom.py"  # no torch import in the workers: a cheap launch
    # Only rank 0 prints: two ranks writing the same line to one pipe at once can interleave it
    # ("...GiBtorch.OutOfMemoryError: ...", seen once in CI), which is not what this test is about.
    script.write_text("import os, sys\nif os.environ.get('RANK', '0') == '0':\n"
                      "    print('torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB', file=sys.stderr)\n"
                      "sys.exit(1)\n")
    for name, value in child_env().items():
        monkeypatch.setenv(name, value)
    outcome = run_trial(folder=tmp_path / "t", config=BASE, script=str(script), script_args=[], nproc=2, steps=3)
    assert (outcome.status, outcome.error) == ("oom", "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
    assert json.loads((tmp_path / "t" / "config.json").read_text()) == BASE
    assert outcome.result == {"oom_requested_bytes": 2 * 2**30}  # the one figure that message prints


# What torch 2.x printed for the tune trial that ran out of memory (GPT-2 124M, micro-batch 128, one H200).
_TORCH_OOM = ("[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 24.56 GiB. GPU 0 has a total "
              "capacity of 139.81 GiB of which 1.05 GiB is free. Including non-PyTorch memory, this process has "
              "138.75 GiB memory in use. Of the allocated memory 98.60 GiB is allocated by PyTorch, and 15.70 GiB is "
              "reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
              "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")


def test_oom_figures_are_kept_in_the_record() -> None:
    """The allocator's figures of an out-of-memory trial (what fragmentation cost) land in the record's
    metrics and lead its note; older torch's "capacty" and "0 bytes" parse too; no message: none."""
    from partita.autotune.runner import TrialOutcome, oom_figures
    from partita.autotune.space import TrialPoint
    from partita.autotune.tuner import _record

    gib = 2**30
    figures = oom_figures("step 1\n" + _TORCH_OOM + "\nE1201 failed\n")
    assert figures == {"oom_requested_bytes": int(24.56 * gib), "oom_capacity_bytes": int(139.81 * gib),
                       "oom_free_bytes": int(1.05 * gib), "oom_allocated_bytes": int(98.60 * gib),
                       "oom_cached_bytes": int(15.70 * gib)}
    old = oom_figures("Tried to allocate 5.96 GiB. GPU 0 has a total capacty of 23.69 GiB of which 5.25 GiB is free. "
                      "Of the allocated memory 17.88 GiB is allocated by PyTorch, and 0 bytes is reserved by PyTorch "
                      "but unallocated.")
    assert old["oom_capacity_bytes"] == int(23.69 * gib) and old["oom_cached_bytes"] == 0
    assert oom_figures("RuntimeError: DataLoader worker (pid 7) is killed: Cannot allocate memory") == {}
    point = TrialPoint(stage=0, micro_batch=128, gradient_accumulation_steps=1, checkpointing="none", offload="none",
                       world_size=1)
    record = _record(point, TrialOutcome("oom", 9.0, figures, "torch.OutOfMemoryError: CUDA out of memory."), 130e9,
                     reused=False)
    assert record.status == "oom" and record.metrics["oom_cached_bytes"] == int(15.70 * gib)
    assert record.note == ("asked 24.6 GiB, allocated 98.6 GiB, cached unusable 15.7 GiB, of 140 GiB: "
                           "torch.OutOfMemoryError: CUDA out of memory.")


def test_error_lines_are_found_in_torchrun_logs() -> None:
    log = "[rank1]: Traceback (most recent call last):\n[rank1]:   File x\n[rank1]: torch.OutOfMemoryError: CUDA out of memory.\nE1201 failed\n"
    assert _last_error(log) == "torch.OutOfMemoryError: CUDA out of memory."


# ----------------------------------------------------------------------------- the section and the command

def test_deepspeed_autotuning_keys_are_accepted() -> None:
    section = {"enabled": True, "fast": True, "results_dir": "r", "exps_dir": "e", "overwrite": False,
               "metric": "FLOPS", "start_step": 2, "end_step": 4, "tuner_type": "random", "tuner_early_stopping": 3,
               "tuner_num_trials": 9, "arg_mappings": {"train_micro_batch_size_per_gpu": "--bs"},
               "num_tuning_micro_batch_sizes": 2, "max_train_batch_size": 64, "min_train_batch_size": 2,
               "max_train_micro_batch_size_per_gpu": 16, "min_train_micro_batch_size_per_gpu": 2, "mp_size": 1,
               "model_info": {"num_params": 1000, "hidden_size": 8, "num_layers": 2, "profile": False}}
    cfg = load_config({**BASE, "autotuning": section}).autotuning
    assert (cfg.metric, cfg.start_profile_step, cfg.end_profile_step, cfg.model_info.num_params) == ("flops", 2, 4, 1000)
    assert load_config(BASE).autotuning == AutotuningConfig()  # DeepSpeed's defaults
    assert (AutotuningConfig().start_profile_step, AutotuningConfig().tuner_num_trials) == (3, 50)


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"fast": False}, r"fast: false asks DeepSpeed to also search ZeRO's communication knobs"),
        ({"metric_path": "m.json"}, r"metric_path is where DeepSpeed's engine writes .* remove metric_path"),
        ({"tuner_type": "model_based"}, r'tuner_type "model_based" \(DeepSpeed\'s XGBoost cost model\)'),
        ({"mp_size": 2}, r"mp_size 2: partita has no model \(tensor\) parallelism"),
        ({"start_profile_step": 5, "end_profile_step": 3}, r"end_profile_step 3 is before start_profile_step 5"),
        ({"arg_mappings": {"lr": "--lr"}}, r"arg_mappings key 'lr' is not one partita tunes"),
        ({"metric": "speed"}, r"autotuning.metric"),
    ],
)
def test_autotuning_keys_partita_does_not_honour_are_refused(section: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config({**BASE, "autotuning": section})


def test_tune_command_input_errors(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    config = tmp_path / "ds.json"
    config.write_text(json.dumps(BASE))
    assert main(["tune", str(SCRIPT), "--config", str(config), "--steps", "2"]) == 2
    assert capsys.readouterr().err.strip() == (
        "partita tune: error: --steps 2 ends before start_profile_step 3; a trial measures the steps from "
        "start_profile_step to --steps")
    assert main(["tune", str(SCRIPT), "--nproc", "2"]) == 2
    assert "partita tune: error: give --config: partita tune [options] --config ds.json script.py" in capsys.readouterr().err
    assert main(["tune", "--config", str(config), "missing.py"]) == 2
    assert "training script 'missing.py' does not exist" in capsys.readouterr().err
