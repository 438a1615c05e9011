"""The largest GPT that trains on one GPU in each setting, found by measurement (issue 17 item 2).

    python benchmarks/largest_per_setting.py --settings p-none,p-none-8b,fsdp2 --budget-s 540 \\
        --nvme-path /tmp/nvme --out $OUT/largest_per_setting.json --markdown       # one H200
    python benchmarks/largest_per_setting.py --tiny --out /tmp/lps.json --markdown  # CPU check of the logic
    python benchmarks/largest_per_setting.py --from-json a.json --markdown          # the table of a saved run
    python benchmarks/largest_per_setting.py --plan --settings all                  # predictions only, no trial

Settings (benchmarks/_largest_search.py): partita ZeRO-3 with nothing offloaded (p-none), the
optimizer in CPU memory (p-opt), optimizer and parameters in CPU memory (p-optp), optimizer
states on NVMe (p-nvme), each also with AdamW8bit (-8b); FSDP2 with and without CPUOffloadPolicy
(fsdp2, fsdp2-off); DeepSpeed ZeRO-3 with optimizer and parameters offloaded (ds-off).

A trial: one GPT size (d_model x n_layers, 128-wide heads, vocabulary 50304, sequence 2048,
micro-batch 1, bf16, every block checkpointed) trained 10 steps in a fresh process
(benchmarks/largest_per_setting_worker.py). It *trains* when the 10 steps finish within the
per-trial timeout, with no out-of-memory on the GPU or the host, and the loss at step 10 is
below the loss at step 1. Per trial: peak GPU allocated and reserved, peak host RSS of the
trial's whole process tree (sampled every 0.25 s) and of its main process, peak disk use of its
swap directory, s/step (median after the first), tokens/s and the losses.

The search per setting starts at the rung partita's estimator predicts to be the largest that
fits the machine's GPU, host memory and disk (FSDP2 and DeepSpeed: the estimate of the partita
setting with the same placement), then steps one rung at a time to the edge (_largest_search.py).
Each trial's time is predicted first (start-up, allocation, GPU compute, PCIe, the host optimizer
step at rates measured on this host by the worker's --calibrate, NVMe traffic); a trial predicted
to overrun the per-trial timeout or what is left of ``--budget-s`` is skipped and says so.
Settings run cheapest first. ``--out`` is rewritten after every trial.

Host memory: the driver stops a trial (SIGKILL to its process group) when the machine's
MemAvailable falls below ``--min-available-gib`` or the tree's RSS exceeds ``--host-limit-gib``,
before the kernel's OOM killer would pick a process, and records "host OOM"; a trial the kernel
kills anyway (SIGKILL, no result line) is recorded as host OOM too.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _largest_search import (HEAD_DIM, SEQ_LEN, VOCAB, Setting, classify_trial, format_params, ladder,  # noqa: E402
                             markdown_table, parse_settings, rung_dict, search_setting)
from _largest_trial_env import (TreeWatch, measure_disk_gbps, predict_trial_s, probe_capacities,  # noqa: E402
                                tiny_simulation)
from output_paths import output_dir, output_file  # noqa: E402

GIB = 2**30
WORKER = HERE / "largest_per_setting_worker.py"


class Predictor:
    """partita's estimate per (setting, rung), cached; the largest fitting rung by bisection
    (the peaks grow with the rung, so one fit/no-fit boundary)."""

    def __init__(self, rungs: list[tuple[int, int]], caps: dict, headroom: float, tiny: bool) -> None:
        self.rungs, self.caps, self.headroom, self.tiny = rungs, caps, headroom, tiny
        self._info: dict[int, object] = {}
        self._est: dict[tuple[str, int], tuple[int, int, int]] = {}

    def options(self, setting: Setting) -> dict:
        options = dict(setting.options)
        options.pop("sub_group_size", None)
        return {**options, **nvme_options(setting, self.tiny)}

    def needs(self, setting: Setting, index: int) -> tuple[int, int, int]:
        from partita.estimate import GPTShape, Setup, estimate_memory
        from partita.estimate.model_info import model_info

        key = (setting.name, index)
        if key not in self._est:
            if index not in self._info:
                d, n = self.rungs[index]
                vocab, seq = (512, 64) if self.tiny else (VOCAB, SEQ_LEN)
                self._info[index] = model_info(GPTShape(d, n, d // (32 if self.tiny else HEAD_DIM), vocab, seq))
            options = {k: v for k, v in self.options(setting).items() if k != "stage"}
            e = estimate_memory(self._info[index], Setup(dtype="fp32" if self.tiny else "bf16", stage=3, micro_batch=1,
                                                         checkpointing="every", **options))
            self._est[key] = (e.peak_accelerator, e.peak_cpu, e.nvme)
        return self._est[key]

    def fits(self, setting: Setting, index: int) -> bool:
        keep = 1.0 - self.headroom
        acc, cpu, nvme = self.needs(setting, index)
        return acc <= keep * self.caps["gpu_bytes"] and cpu <= keep * self.caps["host_bytes"] and \
            nvme <= keep * self.caps["disk_bytes"]

    def largest(self, setting: Setting) -> int | None:
        lo, hi = -1, len(self.rungs)  # fits(lo) (virtually), not fits(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.fits(setting, mid) else (lo, mid)
        return None if lo < 0 else lo


def nvme_options(setting: Setting, tiny: bool) -> dict:
    """Sub-groups of 1e8 elements on NVMe settings (4 pinned buffers of 4 B each: 1.6 GB, not the
    16 GB of the default 1e9), as benchmarks/largest_tiered.py ran them on the H200."""
    uses_nvme = "nvme" in (setting.options.get("offload_optimizer"), setting.options.get("offload_param"))
    return {"sub_group_size": 4096 if tiny else 100_000_000} if uses_nvme and setting.family == "partita" else {}


def run_worker(spec: dict, timeout_s: float, args: argparse.Namespace, trial_dir: str) -> dict:
    """One trial in its own session; the tree's memory and the swap directory watched meanwhile."""
    python = args.deepspeed_python if spec["family"] == "deepspeed" and args.deepspeed_python else sys.executable
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        started = time.monotonic()
        proc = subprocess.Popen([python, str(WORKER), json.dumps(spec)], stdout=out, stderr=err,
                                cwd=str(HERE.parent), start_new_session=True,
                                env={**os.environ, **({"CUDA_VISIBLE_DEVICES": ""} if spec["device"] == "cpu" else {})})
        watch = TreeWatch(proc.pid, trial_dir, min_available=args.min_available_gib * GIB,
                          rss_limit=None if args.host_limit_gib is None else args.host_limit_gib * GIB)
        try:
            stopped = watch.follow(proc, timeout_s)
        finally:  # the driver itself interrupted (SIGTERM, Ctrl-C): never leave a trial running
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    lines = [json.loads(ln[len("TRIAL "):]) for ln in stdout.splitlines() if ln.startswith("TRIAL ")]
    return {"result": lines[-1] if lines else None, "returncode": proc.returncode, "stopped": stopped,
            "wall_s": time.monotonic() - started, "timeout_s": round(timeout_s), **watch.peaks(),
            "stderr_tail": stderr[-2500:]}


def versions_with_bnb() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    from common import versions

    try:
        return {**versions(), "bitsandbytes": version("bitsandbytes")}
    except PackageNotFoundError:
        return {**versions(), "bitsandbytes": "not installed"}


def _parse_start_rungs(items: list[str], settings: list[Setting], n_rungs: int) -> dict[str, int]:
    names = {s.name for s in settings}
    out = {}
    for item in items:
        name, sep, rung = item.partition("=")
        if not sep or name not in names or not rung.isdigit() or int(rung) >= n_rungs:
            raise SystemExit(f"--start-rung {item!r}: expected SETTING=RUNG with SETTING one of the chosen settings "
                             f"({', '.join(sorted(names))}) and RUNG in 0..{n_rungs - 1}")
        out[name] = int(rung)
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", default="all", help="comma-separated setting names, or all")
    parser.add_argument("--budget-s", type=float, default=540.0, help="wall-clock budget of the whole search")
    parser.add_argument("--trial-timeout-s", type=float, default=None, help="default 300 (--tiny: 60)")
    parser.add_argument("--max-trials", type=int, default=4, help="trials per setting at most")
    parser.add_argument("--out", type=output_file, default=None, help="JSON, rewritten after every trial")
    parser.add_argument("--nvme-path", type=output_dir, default=None, help="swap directory (default: a temporary one)")
    parser.add_argument("--tiny", action="store_true", help="CPU: tiny GPTs, artificial capacities")
    parser.add_argument("--markdown", action="store_true", help="print the markdown table at the end")
    parser.add_argument("--from-json", nargs="+", default=None, metavar="JSON",
                        help="print the table of saved runs (several: their settings in order, one table)")
    parser.add_argument("--start-rung", action="append", default=[], metavar="SETTING=RUNG",
                        help="start SETTING's search at ladder rung RUNG instead of the estimator's prediction "
                             "(to resume a search whose earlier run ran out of trials)")
    parser.add_argument("--plan", action="store_true", help="print the predicted start rung and time per setting")
    parser.add_argument("--headroom", type=float, default=None,
                        help="fraction of each tier kept free when predicting (default 0.03; --tiny: 0)")
    parser.add_argument("--gpu-gib", type=float, default=None)
    parser.add_argument("--host-gib", type=float, default=None, help="default: MemAvailable at start")
    parser.add_argument("--disk-gib", type=float, default=None, help="default: free space at --nvme-path")
    parser.add_argument("--min-available-gib", type=float, default=1.5, help="host floor; below it a trial is stopped")
    parser.add_argument("--host-limit-gib", type=float, default=None,
                        help="stop a trial whose tree RSS exceeds this (default none; --tiny: 1.5)")
    parser.add_argument("--gpu-tflops", type=float, default=300.0, help="achieved bf16 TFLOP/s for the time model")
    parser.add_argument("--pcie-gbps", type=float, default=20.0, help="achieved host<->GPU GB/s for the time model")
    parser.add_argument("--nvme-gbps", type=float, default=3.0,
                        help="NVMe GB/s, read and write combined, for the time model (measured at --nvme-path unless "
                             "--no-calibrate)")
    parser.add_argument("--no-calibrate", action="store_true",
                        help="use --adamw-eps/--adamw8bit-eps/--nvme-gbps as given instead of measuring them")
    parser.add_argument("--adamw-eps", type=float, default=1.0e9, help="host fused AdamW elements/s (if not calibrated)")
    parser.add_argument("--adamw8bit-eps", type=float, default=3.7e7, help="host AdamW8bit elements/s (if not calibrated)")
    parser.add_argument("--deepspeed-python", default=None, help="interpreter for DeepSpeed trials (default: this one)")
    args = parser.parse_args(argv)
    if args.from_json:
        saved = [json.loads(Path(path).read_text()) for path in args.from_json]
        print(markdown_table({"settings": [s for run in saved for s in run["settings"]]}))
        return 0
    try:
        settings = parse_settings(args.settings)
    except ValueError as error:
        parser.error(str(error))
    if args.trial_timeout_s is None:
        args.trial_timeout_s = 60.0 if args.tiny else 300.0
    if args.headroom is None:
        args.headroom = 0.0 if args.tiny else 0.03
    if args.tiny and args.host_limit_gib is None:
        args.host_limit_gib = 1.5  # the host-ballast stand-in grows a trial past it
    if args.out is None and not args.plan:
        parser.error("--out is required (the JSON is rewritten after every trial)")

    from common import git_commit, hardware_summary

    # SIGTERM (a time limit) unwinds like Ctrl-C: the running trial is killed, the JSON kept.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    start_time = time.monotonic()
    temporary = None if args.nvme_path else tempfile.mkdtemp(prefix="partita-largest-")
    nvme_root = args.nvme_path or temporary
    os.makedirs(nvme_root, exist_ok=True)
    device = "cpu" if args.tiny else "cuda"
    rungs = ladder(args.tiny)
    caps = probe_capacities(args, nvme_root)
    rates = {"adamw_elements_per_s": args.adamw_eps, "adamw8bit_elements_per_s": args.adamw8bit_eps,
             "gpu_tflops": args.gpu_tflops, "pcie_gbps": args.pcie_gbps, "nvme_gbps": args.nvme_gbps, "source": "given"}
    if not args.no_calibrate and any(s.host_step for s in settings):
        proc = subprocess.run([sys.executable, str(WORKER), "--calibrate"], capture_output=True, text=True,
                              cwd=str(HERE.parent), timeout=300)
        try:
            measured = json.loads(proc.stdout.splitlines()[-1])
            rates.update({k: v for k, v in measured.items() if k.endswith("_per_s") or k == "threads"},
                         source="measured (worker --calibrate)", calibration=measured)
        except (IndexError, json.JSONDecodeError):  # the given rates stay; the JSON says why
            rates["calibration_error"] = (proc.stderr or proc.stdout)[-1000:]
    if not args.no_calibrate and not args.tiny and any(nvme_options(s, False) for s in settings):
        disk = measure_disk_gbps(nvme_root)
        rates.update(nvme_gbps=disk["nvme_gbps"], disk_calibration=disk)
    predictor = Predictor(rungs, caps, args.headroom, args.tiny)
    vocab, seq = (512, 64) if args.tiny else (VOCAB, SEQ_LEN)
    ds_state = {"first": True}  # DeepSpeed JIT-builds its CPU Adam in the first DeepSpeed trial only

    start_overrides = _parse_start_rungs(args.start_rung, settings, len(rungs))

    def plan(setting: Setting) -> dict:
        index = predictor.largest(setting)
        start = start_overrides.get(setting.name, 0 if index is None else index)
        acc, cpu, nvme = predictor.needs(setting, start)
        def cost(i: int, first: bool) -> dict:
            return predict_trial_s(setting, rung_dict(rungs, i, vocab=vocab, seq_len=seq)["params"],
                                   predictor.needs(setting, i)[1], rates, seq_len=seq, steps=10, first_deepspeed=first,
                                   tiny=args.tiny, expected_fit=predictor.fits(setting, i))

        time_s = cost(start, True)
        # The search's likely two trials: the start and the rung above it (expected to fail quickly).
        pair = time_s["total_s"] + (cost(start + 1, False)["total_s"] if start + 1 < len(rungs) else 0.0)
        return {"rung": index, "start_rung": start, "proxy": setting.family != "partita",
                **({} if index is None else rung_dict(rungs, index, vocab=vocab, seq_len=seq)),
                "needs_gib": [acc / GIB, cpu / GIB, nvme / GIB], "trial_s": time_s, "two_trials_s": pair}

    plans = {s.name: plan(s) for s in settings}
    # Cheapest first: the predicted start and next trials (a setting that would be skipped costs nothing).
    order = sorted(settings, key=lambda s: plans[s.name]["two_trials_s"]
                   if plans[s.name]["trial_s"]["total_s"] <= args.trial_timeout_s else 0.0)
    if args.plan:
        for s in order:
            p = plans[s.name]
            first = rung_dict(rungs, p["start_rung"], vocab=vocab, seq_len=seq)
            size = ("none fits" if p["rung"] is None and s.name not in start_overrides
                    else f"{format_params(first['params'])} ({first['d_model']}x{first['n_layers']})")
            t = p["trial_s"]
            unit, scale = ("MiB", 1024) if args.tiny else ("GiB", 1)
            needs = "/".join(f"{v * scale:.1f}" for v in p["needs_gib"])
            print(f"{s.name:10} start {size:22} needs GPU/host/disk {needs} {unit}"
                  f"  trial ~{t['total_s']:.0f} s ({t['startup_s']:.0f} s start-up + 10 x {t['step_s']:.2f} s),"
                  f" with the rung above ~{p['two_trials_s']:.0f} s")
        return 0

    report = {"benchmark": "largest_per_setting", "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "commit": git_commit(str(HERE.parent)), "hardware": hardware_summary(), "versions": versions_with_bnb(),
              "device": device, "tiny": args.tiny, "command": " ".join([Path(sys.executable).name, *sys.argv]),
              "capacities": {k: (v / GIB if k.endswith("_bytes") else v) for k, v in caps.items()},
              "headroom": args.headroom, "rates": rates, "budget_s": args.budget_s,
              "trial_timeout_s": args.trial_timeout_s, "ladder": [rung_dict(rungs, i, vocab=vocab, seq_len=seq)
                                                                  for i in range(len(rungs))],
              "settings": [], "complete": False}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def write() -> None:
        report["elapsed_s"] = time.monotonic() - start_time
        out.write_text(json.dumps(report, indent=2) + "\n")

    try:
        for setting in order:
            live = {"setting": setting.name, "label": setting.label, "family": setting.family,
                    "predicted": plans[setting.name], "trials": []}
            report["settings"].append(live)
            simulate = tiny_simulation(setting, plans[setting.name]["start_rung"], rungs) if args.tiny else None

            def trial(index: int, setting: Setting = setting, live: dict = live, simulate=simulate) -> dict:
                rung = rung_dict(rungs, index, vocab=vocab, seq_len=seq)
                cpu_need = predictor.needs(setting, index)[1]
                predicted = predict_trial_s(setting, rung["params"], cpu_need, rates, seq_len=seq, steps=10,
                                            first_deepspeed=ds_state["first"], tiny=args.tiny,
                                            expected_fit=predictor.fits(setting, index))
                left = args.budget_s - (time.monotonic() - start_time)
                row = {**rung, "predicted_s": predicted}
                if predicted["total_s"] > args.trial_timeout_s:
                    row.update(status="skipped", reason=(
                        f"predicted {predicted['step_s']:.1f} s/step x 10 steps + {predicted['startup_s']:.0f} s "
                        f"start-up = {predicted['total_s']:.0f} s exceeds the per-trial timeout {args.trial_timeout_s:.0f} s"))
                elif predicted["total_s"] > left:
                    row.update(status="skipped", reason=f"budget: predicted {predicted['total_s']:.0f} s, "
                                                        f"{max(left, 0):.0f} s of --budget-s left")
                else:
                    trial_dir = os.path.join(nvme_root, f"trial-{setting.name}-{index}")
                    os.makedirs(trial_dir, exist_ok=True)
                    spec = {"setting": setting.name, "family": setting.family, "options": predictor.options(setting),
                            "d_model": rung["d_model"], "n_layers": rung["n_layers"],
                            "n_heads": rung["d_model"] // (32 if args.tiny else HEAD_DIM), "vocab": vocab,
                            "seq_len": seq, "steps": 10, "device": device, "nvme_path": trial_dir,
                            "port": 29600 + len(live["trials"]) + 10 * len(report["settings"]),
                            "simulate": simulate}
                    try:
                        raw = run_worker(spec, min(args.trial_timeout_s, left), args, trial_dir)
                    finally:
                        shutil.rmtree(trial_dir, ignore_errors=True)
                    if setting.family == "deepspeed":
                        ds_state["first"] = False
                    row.update(classify_trial(raw))
                    if raw.get("stopped") == "timeout" and left < args.trial_timeout_s:
                        # Cut by the overall budget, not by its own timeout: no verdict on this rung.
                        row.update(status="skipped", reason=f"budget: stopped after {raw['wall_s']:.0f} s, "
                                                            "the rest of --budget-s")
                live["trials"].append({"rung": index, **row})
                write()
                print(f"{setting.name:10} {rung['d_model']}x{rung['n_layers']:<3} {format_params(rung['params'])}: "
                      f"{row['status']} {row.get('cause') or row.get('reason') or ''}", flush=True)
                return row

            result = search_setting(plans[setting.name]["start_rung"], len(rungs), trial, max_trials=args.max_trials)
            live.update({k: v for k, v in result.items() if k != "trials"})
            write()
        report["skipped_for_budget"] = [f"{s['setting']} rung {t['rung']}" for s in report["settings"]
                                        for t in s["trials"] if t.get("reason", "").startswith("budget")]
        report["complete"] = not report["skipped_for_budget"]
        write()
    finally:
        if temporary is not None:
            shutil.rmtree(temporary, ignore_errors=True)
    if args.markdown:
        print(markdown_table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
