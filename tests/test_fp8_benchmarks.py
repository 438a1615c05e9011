"""The FP8 benchmarks' own logic (benchmarks/fp8_gpu.py, benchmarks/fp8_loss_curve.py) without a GPU
and without launching anything: setting names, per-shape plans, the speed ratios and the table,
merging saved runs, the all-gather bytes ratio, the loss curve's data order and summary."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import fp8_gpu  # noqa: E402
import fp8_loss_curve  # noqa: E402


def _ok(setting: str, tokens_per_s: float, *, shape: str = "1.3b", world: int = 1, comm=None, stage=2) -> dict:
    return {"setting": setting, "shape": shape, "world": world, "status": "ok", "tokens_per_s": tokens_per_s,
            "step_s": 8192 / tokens_per_s, "peak_gib": 40.0, "last_loss": 10.9, "fp8_linears": 97, "linears": 97,
            "setup_s": 5.0, "first_step_s": 40.0, "micro_batch": 8, "seq": 1024, "checkpointed": False,
            "comm_bytes_per_step": comm, "zero_stage": stage}


def test_settings_and_plans() -> None:
    assert fp8_gpu._settings("partita_bf16, fsdp2_bf16,partita_bf16") == ["partita_bf16", "fsdp2_bf16"]
    with pytest.raises(ValueError, match=r"--settings 'partita_fp9': unknown \['partita_fp9'\]; choose from partita_bf16"):
        fp8_gpu._settings("partita_fp9")
    args = argparse.Namespace(tiny=False, micro_batch=None, seq=None, steps=None, warmup=None, timeout=None)
    big = fp8_gpu._plan("6.7b", args)
    assert (big["preset"], big["stage"], big["checkpoint"], big["micro_batch"], big["seq"]) == ("gpt_7b", 3, True, 2, 2048)
    small = fp8_gpu._plan("1.3b", argparse.Namespace(**{**vars(args), "tiny": True, "steps": 5}))
    assert (small["preset"], small["stage"], small["seq"], small["steps"]) == ("gpt_1_3b", 2, 64, 5)


def test_ratios_report_and_merge(tmp_path) -> None:
    gather = "all_gather_into_tensor: ZeRO-3 parameter all-gather"
    results = [
        _ok("partita_bf16", 60_000.0),
        _ok("partita_fp8_tensorwise", 72_000.0),
        _ok("fsdp2_fp8_tensorwise", 70_000.0),
        {"setting": "partita_fp8_rowwise", "shape": "1.3b", "world": 1, "status": "oom", "peak_gib": 139.5,
         "error": "CUDA out of memory"},
    ]
    rows = {r["setting"]: r for r in fp8_gpu._with_ratios(results)}
    assert rows["partita_fp8_tensorwise"]["vs_partita_bf16"] == pytest.approx(1.2)
    assert rows["partita_fp8_tensorwise"]["vs_fsdp2_torchao"] == pytest.approx(72 / 70)
    assert rows["partita_fp8_rowwise"]["vs_partita_bf16"] is None  # a failed row has no ratio
    meta = {"date_utc": "2026-12-04 21:00 UTC", "commit": "abc", "commands": ["python benchmarks/fp8_gpu.py"],
            "versions": {"torch": "2.11"}}
    table = fp8_gpu.report(meta, results)
    assert "| partita_fp8_tensorwise | ok | 72,000 | 0.114 | 40.00 | 10.9000 | 97/97 | 1.200 | 1.029 | 5 + 40 |" in table
    assert "| partita_fp8_rowwise | oom: CUDA out of memory | | | 139.50 |" in table
    # A second call's rows (another shape, two ranks, the FP8 wire's bytes) merge into one table.
    ag = [_ok("partita_bf16", 10_000.0, shape="6.7b", world=2, stage=3, comm={gather: 1000, "all_reduce: x": 4}),
          _ok("partita_fp8_allgather", 11_000.0, shape="6.7b", world=2, stage=3,
              comm={gather: 200, "all_gather_into_tensor: fp8 ZeRO-3 parameter all-gather": 400})]
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    fp8_gpu._write(str(first), meta, results)
    fp8_gpu._write(str(second), {**meta, "commit": "def"}, ag)
    assert second.with_suffix(".md").read_text().startswith("## FP8 training speed")
    merged_meta, merged = fp8_gpu._merge([str(first), str(second)])
    assert merged_meta["commit"] == "abc, def" and len(merged) == 6
    table = fp8_gpu.report(merged_meta, merged)
    assert "FP8 all-gather / bf16 ZeRO-3 (partita_bf16): 0.600" in table  # (200 + 400) / 1000
    with pytest.raises(ValueError, match="is not a JSON file written by fp8_gpu.py --out"):
        (tmp_path / "c.json").write_text(json.dumps([1]))
        fp8_gpu._merge([str(tmp_path / "c.json")])


def test_main_refuses_bad_options(capsys) -> None:
    with pytest.raises(SystemExit):
        fp8_gpu.main(["--warmup", "0", "--tiny"])
    assert "--warmup must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        fp8_gpu.main(["--from-json", "x.json"])
    assert "--from-json needs --out" in capsys.readouterr().err


def test_loss_curve_order_and_summary() -> None:
    order = fp8_loss_curve._order(10, steps=7, micro_batch=3)  # 21 windows: two passes and a bit
    assert tuple(order.shape) == (7, 3)
    flat = order.reshape(-1).tolist()
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:20]) == list(range(10))  # every window once a pass
    assert fp8_loss_curve._order(10, steps=7, micro_batch=3).tolist() == order.tolist()  # the same for every run
    losses = [3.0 - i * 0.001 for i in range(300)]
    losses[200] += 0.5
    bf16 = {"status": "ok", "train_loss": losses, "val_loss": {"0": 5.0, "300": 2.0}}
    fp8 = {"status": "ok", "train_loss": [v * 1.005 for v in losses], "val_loss": {"0": 5.0, "300": 2.03}}
    summary = fp8_loss_curve._summarise({"bf16": bf16, "fp8_tensorwise": fp8})
    assert summary["relative_diff_train_loss"] == pytest.approx(0.005)
    assert summary["relative_diff_val_loss"] == pytest.approx(0.015)
    assert summary["within_1_percent"] is False
    assert bf16["largest_spike"]["step"] == 201 and bf16["largest_spike"]["rise"] == pytest.approx(0.5 - 0.0255, abs=1e-6)  # over the falling mean before it
    assert fp8_loss_curve._summarise({"bf16": bf16, "fp8_tensorwise": {"status": "timeout after 240 s"}}) == {}
