"""benchmarks/largest_per_setting.py's logic without a GPU and without trials: the rung-by-rung
search (exact rung sequences for pass/fail patterns), the classification of a worker's outcome,
the driver's JSON (rewritten after every trial, skips by predicted time and budget) with a fake
trial function, the markdown table, and the host-memory watch on a real child process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import largest_per_setting  # noqa: E402
from _largest_search import (SETTINGS, classify_trial, gpt_params, ladder, markdown_table, parse_settings,  # noqa: E402
                             search_setting)
from _largest_trial_env import TreeWatch  # noqa: E402


def _pattern(edge: int, calls: list[int] | None = None):
    """A fake trial: rungs up to ``edge`` pass, above it fail."""
    def trial(index: int) -> dict:
        if calls is not None:
            calls.append(index)
        return {"status": "pass"} if index <= edge else {"status": "fail", "cause": "GPU OOM"}
    return trial


@pytest.mark.parametrize(("start", "edge", "rungs", "largest", "first_fail", "outcome"), [
    (3, 3, [3, 4], 3, 4, "edge found"),                       # prediction exact: 2 trials
    (3, 4, [3, 4, 5], 4, 5, "edge found"),                    # one rung too low
    (3, 2, [3, 2], 2, 3, "edge found"),                       # one rung too high
    (3, 1, [3, 2, 1], 1, 2, "edge found"),
    (5, 9, [5, 6, 7], 7, None, "every rung up to the top of the ladder passed"),
    (1, -1, [1, 0], None, 0, "no rung passed, down to the bottom of the ladder"),
    (0, 6, [0, 1, 2, 3], 3, None, "edge not reached within 4 trials"),
])
def test_search_steps_one_rung_at_a_time(start, edge, rungs, largest, first_fail, outcome) -> None:
    calls: list[int] = []
    result = search_setting(start, 8, _pattern(edge, calls), max_trials=4)
    assert calls == rungs
    assert [t["rung"] for t in result["trials"]] == rungs
    assert (result["largest"], result["first_fail"], result["outcome"]) == (largest, first_fail, outcome)
    assert result["start_rung"] == start
    assert json.loads(json.dumps(result)) == result  # plain JSON


def test_search_stops_at_a_skipped_trial() -> None:
    skip = {"status": "skipped", "reason": "predicted 46.1 s/step x 10 steps exceeds the per-trial timeout 300 s"}
    first = search_setting(2, 8, lambda i: skip)
    assert first["trials"] == [{"rung": 2, **skip}]
    assert (first["largest"], first["first_fail"]) == (None, None)
    assert first["outcome"] == "not run: " + skip["reason"]
    later = search_setting(2, 8, lambda i: {"status": "pass"} if i == 2 else skip)
    assert [t["rung"] for t in later["trials"]] == [2, 3]
    assert (later["largest"], later["first_fail"]) == (2, None)
    assert later["outcome"] == f"edge not reached: rung 3 not run ({skip['reason']})"


def test_search_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match=r"^start rung 8 is outside the ladder of 8 rungs$"):
        search_setting(8, 8, _pattern(3))
    with pytest.raises(ValueError, match=r"^trial at rung 1 returned status 'ok'; expected pass, fail or skipped$"):
        search_setting(1, 8, lambda i: {"status": "ok"})


def test_settings_and_ladder() -> None:
    assert [s.name for s in SETTINGS] == ["p-none", "p-none-8b", "p-opt", "p-opt-8b", "p-optp", "p-optp-gm", "p-optp-8b", "p-nvme",
                                          "p-nvme-8b", "fsdp2", "fsdp2-off", "ds-off"]
    assert [s.name for s in parse_settings("fsdp2,p-none,fsdp2")] == ["fsdp2", "p-none"]
    with pytest.raises(ValueError, match=r"^unknown setting\(s\) \['p-gpu'\]; the settings are p-none, "):
        parse_settings("p-none,p-gpu")
    rungs = ladder()
    assert rungs[0] == (4096, 16) and rungs[-1] == (5120, 64) and len(rungs) == 35
    assert gpt_params(4096, 32) == 6_658_596_864  # partita's GPT at d 4096 x 32 (the estimator's count)
    sizes = [gpt_params(d, n) for d, n in rungs]
    steps = [b / a - 1 for a, b in zip(sizes, sizes[1:]) if 6e9 <= a <= 20e9]
    assert all(0.03 < s < 0.075 for s in steps), steps  # ~5% a rung between 6 and 20 B


def test_classify_trial_names_each_cause() -> None:
    ok = {"status": "ok", "losses": [10.9, 10.1, 9.0], "step_s": 0.5, "params": 7}
    passed = classify_trial({"result": ok, "returncode": 0, "peak_host_rss_gib": 3.0})
    assert passed == {"peak_host_rss_gib": 3.0, "returncode": 0, "losses": [10.9, 10.1, 9.0], "step_s": 0.5,
                      "params": 7, "status": "pass"}
    cases = [
        ({"result": {**ok, "losses": [9.0, 9.5]}}, "loss", "loss did not fall: 9.0 -> 9.5"),
        ({"result": {"status": "oom", "phase": "train", "detail": "Tried to allocate 2.00 GiB"}}, "gpu-oom",
         "GPU OOM in train (Tried to allocate 2.00 GiB)"),
        ({"result": {"status": "oom", "phase": "train", "detail": "Tried to allocate 2.00 GiB",
                     "peak_gpu_reserved_gib": 138.21, "gpu_total_gib": 139.8}}, "gpu-oom",
         "GPU OOM in train (Tried to allocate 2.00 GiB; peak reserved 138.2 of 139.8 GiB)"),
        ({"result": {"status": "host-oom", "phase": "build", "detail": "MemoryError: "}}, "host-oom",
         "host OOM in build (MemoryError: )"),
        ({"result": {"status": "disk-full", "phase": "train", "detail": "OSError: No space"}}, "disk-full",
         "disk full in train (OSError: No space)"),
        ({"result": None, "returncode": -9}, "host-oom",
         "host OOM: killed by SIGKILL (exit status -9) without a result line, the kernel's OOM killer"),
        ({"result": None, "returncode": -9, "stopped": "timeout", "timeout_s": 300}, "timeout",
         "timeout: no result within 300 s"),
        ({"result": None, "returncode": -9, "stopped": "host-floor", "min_available_gib": 1.25}, "host-oom",
         "host OOM: MemAvailable fell below 1.2 GiB (stopped by the driver before the kernel's OOM killer)"),
        ({"result": None, "returncode": 1, "stderr_tail": "Traceback\nValueError: bad\n"}, "error",
         "error: exit status 1: ValueError: bad"),
    ]
    for raw, kind, cause in cases:
        row = classify_trial(raw)
        assert (row["status"], row["cause_kind"], row["cause"]) == ("fail", kind, cause)


def test_driver_json_with_a_fake_trial(tmp_path, monkeypatch) -> None:
    """The driver end to end on the tiny ladder, its worker replaced: start rungs from the
    estimator, the rung sequence, skips by predicted time, the JSON after every trial."""
    seen: list[tuple[str, int]] = []
    written: list[int] = []
    out = tmp_path / "run.json"

    def fake_worker(spec, timeout_s, args, trial_dir):
        seen.append((spec["setting"], spec["n_layers"]))
        # Trials finished so far, as the file on disk has them when the next one starts.
        written.append(sum(len(s["trials"]) for s in json.loads(out.read_text())["settings"]))
        if spec["n_layers"] > 4:
            return {"result": {"status": "oom", "phase": "train", "detail": "Tried to allocate 1 MiB"},
                    "returncode": 3, "stopped": None}
        return {"result": {"status": "ok", "losses": [6.2, 5.5], "step_s": 0.01, "tokens_per_s": 6400.0},
                "returncode": 0, "stopped": None, "peak_host_rss_gib": 0.3, "peak_disk_gib": 0.0}

    monkeypatch.setattr(largest_per_setting, "run_worker", fake_worker)
    code = largest_per_setting.main(["--tiny", "--settings", "p-none,p-opt,p-opt-8b", "--no-calibrate",
                                     "--adamw8bit-eps", "1000", "--out", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    # p-opt-8b at 1000 elements/s: ~240 s a step, far over the tiny 60 s timeout: skipped first (costs nothing).
    assert [s["setting"] for s in report["settings"]] == ["p-opt-8b", "p-none", "p-opt"]
    skipped, none, opt = report["settings"]
    assert [t["status"] for t in skipped["trials"]] == ["skipped"]
    assert skipped["trials"][0]["reason"].endswith("exceeds the per-trial timeout 60 s")
    assert skipped["outcome"].startswith("not run: predicted ")
    # Estimator start rungs on the tiny capacities: p-none 3 layers (index 1), p-opt 4 layers (index 2).
    assert (none["start_rung"], opt["start_rung"]) == (1, 2)
    assert seen == [("p-none", 3), ("p-none", 4), ("p-none", 5), ("p-opt", 4), ("p-opt", 5)]
    assert written == [1, 2, 3, 4, 5]  # the skipped trial first, then one more after every trial
    assert [(t["rung"], t["status"]) for t in none["trials"]] == [(1, "pass"), (2, "pass"), (3, "fail")]
    assert (none["largest"], none["first_fail"], none["outcome"]) == (2, 3, "edge found")
    assert none["trials"][2]["cause"] == "GPU OOM in train (Tried to allocate 1 MiB)"
    assert (opt["largest"], opt["first_fail"]) == (2, 3)
    assert report["complete"] is True
    assert set(report) >= {"benchmark", "commit", "capacities", "rates", "ladder", "settings", "budget_s", "elapsed_s"}
    table = markdown_table(report).splitlines()
    assert table[0].startswith("| setting | largest that trains | peak GPU alloc / reserved GiB |")
    assert table[3] == ("| p-none | 0.237 M (64×4) | — / — | 0.3 | 0.0 | 0.01 | 6,400 | "
                        "0.287 M (64×5): GPU OOM in train (Tried to allocate 1 MiB) | 0.187 M (64×3) |")


def test_driver_skips_for_budget(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(largest_per_setting, "run_worker", lambda *a: pytest.fail("no trial fits the budget"))
    out = tmp_path / "run.json"
    largest_per_setting.main(["--tiny", "--settings", "p-none", "--budget-s", "1", "--out", str(out)])
    report = json.loads(out.read_text())
    trial = report["settings"][0]["trials"][0]
    assert trial["status"] == "skipped" and trial["reason"].startswith("budget: predicted 4 s, ")
    assert report["complete"] is False


def test_tree_watch_stops_a_child_over_the_rss_limit(tmp_path) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; x = bytearray(300 << 20); time.sleep(30)"],
                             start_new_session=True)
    watch = TreeWatch(child.pid, str(tmp_path), min_available=0, rss_limit=100 << 20, period_s=0.05)
    assert watch.follow(child, timeout_s=20) == "host-limit"
    assert child.returncode == -9
    assert watch.peaks()["peak_host_rss_gib"] > 100 / 1024


def test_worker_names_the_memory_that_ran_out() -> None:
    import errno

    import torch

    from largest_per_setting_worker import _classify

    def raised(make) -> BaseException:
        try:
            make()
        except BaseException as exc:  # noqa: BLE001 - the exception is the value under test
            return exc
        raise AssertionError("nothing raised")

    def pinned(pin_memory: bool = True) -> None:
        raise torch.OutOfMemoryError("CUDA error: out of memory") if pin_memory else None

    def device() -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    def wrapped() -> None:
        try:
            device()
        except torch.OutOfMemoryError as exc:
            raise RuntimeError("backward hook failed") from exc

    assert _classify(raised(pinned)) == "host-oom"  # raised on a line that pins host memory
    assert _classify(raised(device)) == "oom"
    assert _classify(raised(wrapped)) == "oom"
    assert _classify(raised(lambda: (_ for _ in ()).throw(MemoryError()))) == "host-oom"
    assert _classify(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 9 bytes")) \
        == "host-oom"
    assert _classify(OSError(errno.ENOSPC, "No space left on device")) == "disk-full"
    assert _classify(ValueError("bad config")) == "error"
