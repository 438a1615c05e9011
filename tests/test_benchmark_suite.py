"""The throughput suite's logic on CPU: engine names, peers, ratios, tables, the docs section,
the OOM and skip paths, and one end-to-end smoke run (2 gloo processes per engine).

The suite exists to be run on GPUs; these tests make sure that what it prints and appends to a
dated report (benchmarks/results/<date>-report.md) is computed from what it measured, before any GPU time is spent on it.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import gpu_throughput  # noqa: E402
from _suite_engines import EngineNameError, EngineSpec, parse_engine, peer_of, suite_engines  # noqa: E402
from _suite_report import append_docs  # noqa: E402
from _suite_table import HEADERS, add_ratios, failure_notes, scaling_rows, table_rows  # noqa: E402


def test_engine_names_parse_and_bad_names_say_the_fix() -> None:
    assert parse_engine("partita2c-offd") == EngineSpec("partita2c-offd", "partita", 2, True, "delayed")
    assert parse_engine("deepspeed3-off") == EngineSpec("deepspeed3-off", "deepspeed", 3, False, "cpu")
    assert parse_engine("fsdp2c") == EngineSpec("fsdp2c", "fsdp2", None, True, None)
    assert parse_engine("torch") == EngineSpec("torch", "torch", None, False, None)
    assert parse_engine("partita2-offdo16") == EngineSpec("partita2-offdo16", "partita", 2, False, "delayed-overlap", True)
    assert parse_engine("partita2-off16").host_16bit_grads and not parse_engine("partita2-off").host_16bit_grads
    bad = {
        "partita": "needs a ZeRO stage 0-3",
        "partita4": "needs a ZeRO stage 0-3",
        "deepspeed2c": "no compiled DeepSpeed variant; use deepspeed2",
        "deepspeed2-offd": "use deepspeed2-off",
        "torch-off": "only partita and deepspeed engines offload",
        "partita2-offx": "unknown offload suffix '-offx'",
        "partita2-offx16": "unknown offload suffix '-offx'",
        "deepspeed2-off16": "is partita's; use deepspeed2-off",
        "torch1": "takes no ZeRO stage",
        "megatron": "unknown engine 'megatron'",
    }
    for name, fragment in bad.items():
        with pytest.raises(EngineNameError, match=fragment.replace("(", r"\(")):
            parse_engine(name)


def test_suite_preset_is_the_issue_list() -> None:
    base = ["torch", "torchc", "fsdp2", "fsdp2c", "partita0", "partita1", "partita2", "partita3",
            "partita0c", "partita1c", "partita2c", "partita3c", "deepspeed0", "deepspeed1", "deepspeed2", "deepspeed3"]
    assert suite_engines(offload=False) == base
    assert suite_engines(offload=True) == base + ["partita2-off", "partita2-offd", "deepspeed2-off"]


def test_peers_compare_like_with_like() -> None:
    expect = {
        # name: (vs fsdp2, vs deepspeed, vs torch)
        "partita2": ("fsdp2", "deepspeed2", "torch"),
        "partita3c": ("fsdp2c", None, "torchc"),  # no compiled DeepSpeed: no mixed ratio
        "partita2-off": ("fsdp2", "deepspeed2-off", "torch"),
        "partita2-offd": ("fsdp2", "deepspeed2-off", "torch"),
        "partita2-offdo16": ("fsdp2", "deepspeed2-off", "torch"),
        "deepspeed1": ("fsdp2", None, "torch"),
        "fsdp2c": (None, None, "torchc"),
        "torch": ("fsdp2", None, None),
    }
    for name, peers in expect.items():
        spec = parse_engine(name)
        assert tuple(peer_of(spec, c) for c in ("fsdp2", "deepspeed", "torch")) == peers, name


def _ok(engine: str, tps: float, peak: float, world: int = 1) -> dict:
    return {"engine": engine, "world": world, "status": "ok", "tokens_per_s_per_gpu": tps, "mfu": 0.5,
            "step_ms": 100.0, "forward_ms": 30.0, "backward_ms": 60.0, "optimizer_ms": 10.0, "peak_gib": peak}


def test_ratios_and_table_cells_from_synthetic_results() -> None:
    results = add_ratios([
        _ok("fsdp2", 50_000.0, 40.0), _ok("fsdp2c", 60_000.0, 40.0), _ok("torch", 40_000.0, 50.0),
        _ok("deepspeed2", 45_000.0, 44.0),
        {"engine": "deepspeed3", "world": 1, "status": "oom", "peak_gib": 139.5, "memory_at_failure_gib": 138.0,
         "device_total_gib": 139.8, "phase": "warm-up", "rank": 0, "detail": "Tried to allocate 2.00 GiB"},
        {**_ok("partita2", 55_000.0, 38.0), "predicted_peak_gib": 37.25}, _ok("partita3", 52_000.0, 41.0),
        _ok("partita2c", 66_000.0, 38.0),
    ])
    by = {r["engine"]: r for r in results}
    assert by["partita2"]["ratios"]["deepspeed"] == {"peer": "deepspeed2", "tokens_per_s": 55_000 / 45_000,
                                                     "peak_gib": 38 / 44}
    assert by["partita3"]["ratios"]["deepspeed"] is None  # the peer ran out of memory
    assert by["partita2c"]["ratios"]["fsdp2"]["peer"] == "fsdp2c"
    assert by["partita2c"]["ratios"]["torch"] is None  # torchc was not run
    rows = {row[0]: row for row in table_rows(results)}
    assert rows["partita2"] == ["partita2", "55,000", "50.0%", "100.0", "30.0", "60.0", "10.0", "38.00", "37.25",
                                "1.10", "0.95", "1.22", "0.86", "1.38", "0.76"]
    assert rows["partita2c"][8:] == ["—", "1.10", "0.95", "—", "—", "—", "—"]  # no estimate recorded
    assert rows["deepspeed3"] == ["deepspeed3", "OOM", "—", "—", "—", "—", "—", "139.50 at OOM"] + ["—"] * 7
    assert failure_notes(results) == [
        "deepspeed3: out of memory during warm-up on rank 0 (allocated 138.00 GiB, peak 139.50 GiB of 139.8 GiB)"
        " — Tried to allocate 2.00 GiB"]
    with pytest.raises(ValueError, match="group the results by world"):
        add_ratios([_ok("torch", 1.0, 1.0, world=1), _ok("fsdp2", 1.0, 1.0, world=2)])


def test_scaling_rows_divide_per_gpu_throughput() -> None:
    results = [_ok("fsdp2", 50_000.0, 40.0), _ok("partita3", 48_000.0, 41.0),
               _ok("fsdp2", 47_500.0, 30.0, world=2), _ok("partita3", 45_600.0, 31.0, world=2),
               _ok("torch", 10.0, 1.0, world=2)]  # no one-rank run: no scaling row
    assert scaling_rows(results) == [["fsdp2", "50,000", "47,500", "2", "0.95"],
                                     ["partita3", "48,000", "45,600", "2", "0.95"]]


def test_driver_validates_options_and_skips_missing_deepspeed(monkeypatch: pytest.MonkeyPatch) -> None:
    assert gpu_throughput._parse_nproc("1,2,2", "cuda", 2) == [1, 2]
    assert gpu_throughput._parse_nproc("all", "cuda", 4) == [4]
    for text, device, visible, fragment in [("3", "cuda", 2, "asks for 3 GPUs but 2 are visible"),
                                           ("all", "cpu", 0, "give a number of processes"),
                                           ("0", "cpu", 0, "not a positive rank count"),
                                           ("1", "cuda", 0, "use --device cpu")]:
        with pytest.raises(ValueError, match=fragment):
            gpu_throughput._parse_nproc(text, device, visible)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: None)
    result = gpu_throughput._run_engine("deepspeed2", 2, None)  # returns before reading any option
    assert result["status"] == "skipped" and "install deepspeed==0.19.8" in result["error"]


def test_failure_summary_is_the_workers_exception_not_torchruns_report() -> None:
    stderr = "\n".join([
        "[rank1]: Traceback (most recent call last):",
        '[rank1]:   File "worker.py", line 3, in run',
        "[rank1]: partita.config.base.ConfigError: Invalid partita config (1 problem):",
        "[rank1]:   - zero_optimization.reduce_bucket_size = 0: out of range",
        "E1129 19:30:29 api.py:1002] failed (exitcode: 1) local_rank: 1",
        "Traceback (most recent call last):",
        '  File "run.py", line 1032, in <module>',
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
        "============================================================",
    ])
    summary, context = gpu_throughput._error_summary(stderr)
    assert summary == ("partita.config.base.ConfigError: Invalid partita config (1 problem): "
                       "- zero_optimization.reduce_bucket_size = 0: out of range")
    assert context.splitlines()[0] == "Traceback (most recent call last):" and len(context.splitlines()) == 4
    assert gpu_throughput._error_summary("killed\n=====\n")[0] == "killed"


def test_from_json_refuses_tables_across_commits(tmp_path: Path) -> None:
    meta = {"commit": "abc1234", "model": "tiny", "device": "cpu", "hardware": "x", "micro_batch": 8, "steps": 3,
            "warmup": 1, "commands": ["python a"], "dirty": False, "date_utc": "2026-11-29 10:00 UTC"}
    (tmp_path / "a.json").write_text(json.dumps({"meta": meta, "results": [_ok("torch", 1.0, 1.0)]}))
    (tmp_path / "b.json").write_text(json.dumps({"meta": {**meta, "commands": ["python b"], "dirty": True},
                                                 "results": [_ok("torch", 2.0, 1.0), _ok("fsdp2", 3.0, 1.0)]}))
    merged_meta, results = gpu_throughput._merge_saved([str(tmp_path / "a.json"), str(tmp_path / "b.json")])
    assert merged_meta["commands"] == ["python a", "python b"] and merged_meta["dirty"] is True
    assert [(r["engine"], r["tokens_per_s_per_gpu"]) for r in results] == [("torch", 2.0), ("fsdp2", 3.0)]
    (tmp_path / "c.json").write_text(json.dumps({"meta": {**meta, "commit": "def5678"}, "results": []}))
    with pytest.raises(ValueError, match="differ in commit"):
        gpu_throughput._merge_saved([str(tmp_path / "a.json"), str(tmp_path / "c.json")])


def test_append_docs_keeps_the_file_and_separates_sections(tmp_path: Path) -> None:
    path = tmp_path / "perf.md"
    path.write_text("# Performance\ntext")
    append_docs(path, "## A\n")
    append_docs(path, "## B\n")
    assert path.read_text() == "# Performance\ntext\n\n## A\n\n## B\n"


def _markdown_table(section: str) -> tuple[list[str], dict[str, list[str]]]:
    lines = [ln for ln in section.splitlines() if ln.startswith("| ")]
    split = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines]
    return split[0], {row[0]: row for row in split[1:]}


def test_cpu_smoke_run_end_to_end(tmp_path: Path) -> None:
    """torch, partita ZeRO-2 and a partita ZeRO-3 whose last rank runs out of memory (while rank
    0 waits in a collective), on 2 gloo processes each: the JSON, the console table and the
    appended docs section must agree, and the OOM must be reported, not crash the suite."""
    docs, out = tmp_path / "performance.md", tmp_path / "suite.json"
    docs.write_text("# Performance\n\nearlier sections\n")
    cmd = [sys.executable, str(REPO / "benchmarks" / "gpu_throughput.py"), "--device", "cpu", "--model", "tiny",
           "--nproc", "2", "--steps", "3", "--warmup", "1", "--engines", "torch,partita2,partita3",
           "--simulate-oom-engine", "partita3", "--json", str(out), "--append-docs", str(docs)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=170, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    saved = json.loads(out.read_text())
    meta, results = saved["meta"], {r["engine"]: r for r in saved["results"]}
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:
        assert meta["commit"] == head.stdout.strip()
    assert meta["commands"] == ["python " + shlex.join(cmd[1:])]
    assert list(results) == ["torch", "partita2", "partita3"]
    assert [results[e]["status"] for e in results] == ["ok", "ok", "oom"]
    oom = results["partita3"]
    assert (oom["rank"], oom["phase"], oom["world"]) == (1, "warm-up", 2)
    assert oom["detail"] == "simulated out of memory (--simulate-oom-engine)" and oom["peak_gib"] > 0
    # partita's own estimate rides along (the model-states part is exact; activations are a formula).
    assert isinstance(results["partita2"]["predicted_peak_gib"], float) and results["partita2"]["predicted_peak_gib"] > 0
    assert results["torch"].get("predicted_peak_gib") is None
    tokens_per_step = 8 * 128 * 2  # micro-batch x sequence x ranks
    for name in ("torch", "partita2"):
        r = results[name]
        assert r["world"] == 2 and r["mfu"] is None
        assert r["tokens_per_s"] == pytest.approx(tokens_per_step / (r["step_ms"] / 1000), rel=1e-9)
        assert r["tokens_per_s_per_gpu"] == pytest.approx(r["tokens_per_s"] / 2, rel=1e-12)
        # The three phases tile the step: their sum is the step time up to the loop's own overhead.
        phases = r["forward_ms"] + r["backward_ms"] + r["optimizer_ms"]
        assert phases == pytest.approx(r["step_ms"], rel=0.05)
        # Same model, data, seed and optimizer: the engines train the same thing.
        assert r["final_loss"] == pytest.approx(results["torch"]["final_loss"], rel=1e-4)
    console = proc.stdout.splitlines()
    at = console.index("2 rank(s):")
    assert re.split(r"\s{2,}", console[at + 1].strip()) == list(HEADERS)
    console_rows = {cells[0]: cells for cells in (re.split(r"\s{2,}", ln.strip()) for ln in console[at + 3:at + 6])}
    assert sorted(console_rows) == ["partita2", "partita3", "torch"]

    text = docs.read_text()
    assert text.startswith("# Performance\n\nearlier sections\n\n## Throughput suite: tiny on CPU")
    section = text.split("## Throughput suite:", 1)[1]
    assert f"partita commit: `{meta['commit']}`" in section and f"`{meta['commands'][0]}`" in section
    assert meta["date_utc"] in section
    header, rows = _markdown_table(section)
    assert header == list(HEADERS)
    col = {name: i for i, name in enumerate(header)}
    for name in ("partita2",):
        r, torch_r = results[name], results["torch"]
        assert rows[name][col["tok/s vs torch"]] == f"{r['tokens_per_s_per_gpu'] / torch_r['tokens_per_s_per_gpu']:.2f}"
        assert rows[name][col["mem vs torch"]] == f"{r['peak_gib'] / torch_r['peak_gib']:.2f}"
        assert r["ratios"]["torch"]["tokens_per_s"] == r["tokens_per_s_per_gpu"] / torch_r["tokens_per_s_per_gpu"]
        assert rows[name][col["tok/s vs fsdp2"]] == "—"  # FSDP2 was not in this run
        assert rows[name][col["tok/s vs deepspeed"]] == "—"  # DeepSpeed was not in this run
        assert rows[name][col["tokens/s/GPU"]] == f"{r['tokens_per_s_per_gpu']:,.0f}"
        assert rows[name] == console_rows[name]  # the terminal shows the same cells
    assert rows["partita3"][col["tokens/s/GPU"]] == "OOM" and console_rows["partita3"][1] == "OOM"
    assert rows["partita3"][col["tok/s vs torch"]] == "—"
    assert f"| {oom['peak_gib']:.2f} at OOM |" in section
    assert "- partita3: out of memory during warm-up on rank 1" in section
