"""NVMe optimizer step time against the disk's bound, in one run (issue 17 item 5).

    # one H200 (16 cores, 128 GiB, disk at /tmp): GPT-1.3B, micro-batch 8, sequence 2048, bf16, ZeRO-2
    python benchmarks/nvme_step.py --device cuda --model gpt_1_3b --micro-batch 8 --nvme-path /tmp/nvme \\
        --bw-gib 2 --sweep 1048576:8:1,1048576:32:1,4194304:16:2 --pick-best --budget-s 150 --out nvme_step_h200.json
    # CPU check of the script (this machine's disk, a 25 M-parameter GPT)
    python benchmarks/nvme_step.py --device cpu --tiny --out /tmp/nvme_step.json

In order, in one process tree:

1. The disk's sequential bandwidth (benchmarks/_disk_bandwidth.py): through partita's own swap
   store with the ``aio`` settings, sub-group tensor size and ``buffer_count`` the runs use
   (write, read, and both at once), and with ``dd`` O_DIRECT 64 MiB blocks for reference.
2. Training with ``offload_optimizer.device "nvme"`` and ``pipeline_read``/``pipeline_write`` on,
   then the same with both off (benchmarks/_nvme_step_worker.py, one fresh process each). After
   ``--warmup`` steps (the first step creates the states and only writes), each step's time, its
   phases, and the swapper's exact bytes read and written.

The bound of a step is the time the disk needs for its bytes at the bandwidth measured in step 1:
``read bytes / read GB/s + written bytes / write GB/s`` (the disk does one thing at a time), and
``max(read / read GB/s, written / write GB/s)`` (reads and writes fully overlapped, a bound the
disk reaches only if its mixed bandwidth is the sum of the two). Reported: step / bound (the
issue's goal: within 1.5x) and host step (``engine.step()``) / bound, against the store's
bandwidth and against dd's.

``--budget-s`` caps the whole benchmark's wall time: the runs share what the bandwidth test left,
and a run stops starting steps when the next would not fit (its rows say so). JSON to ``--out``
(rewritten after each part), a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

from _disk_bandwidth import dd_bandwidth, store_bandwidth  # noqa: E402
from _nvme_step_worker import PREFIX  # noqa: E402
from common import git_commit, hardware_summary, versions, wait_until_quiet  # noqa: E402
from output_paths import output_dir, output_file  # noqa: E402

GB = 1e9
TINY_GPT = {"vocab_size": 256, "block_size": 16, "n_layer": 8, "n_head": 4, "n_embd": 512}


def _gpt(args: argparse.Namespace) -> dict:
    from dataclasses import asdict

    from partita.models.gpt import GPTConfig

    if args.tiny:
        cfg = dict(TINY_GPT)
    else:
        cfg = {k: v for k, v in asdict(getattr(GPTConfig, args.model)()).items()
               if k in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd")}
    if args.n_layer:
        cfg["n_layer"] = args.n_layer
    if args.seq_len:
        cfg["block_size"] = args.seq_len
    return cfg


def _median(steps: list[dict], key) -> float | None:
    values = [key(s) for s in steps]
    return statistics.median(values) if values else None


def summarize(run: dict, bandwidth: dict[str, dict]) -> dict:
    """Medians over the timed steps and the bounds at each measured bandwidth."""
    timed = [s for s in run.get("steps", []) if not s["warmup"]]
    out: dict[str, Any] = {"name": run["name"], "timed_steps": len(timed)}
    if not timed:
        out["note"] = run.get("stopped") or run.get("error") or "no timed step"
        return out
    med = {
        "step_s": _median(timed, lambda s: s["step_s"]),
        "forward_backward_s": _median(timed, lambda s: s["forward_s"] + s["backward_s"]),
        "optimizer_s": _median(timed, lambda s: s["optimizer_s"]),
        "swap_s": _median(timed, lambda s: s["swap"]["seconds"]),
        "compute_s": _median(timed, lambda s: s["swap"]["compute_s"]),
        "read_wait_s": _median(timed, lambda s: s["swap"]["read_wait_s"]),
        "write_wait_s": _median(timed, lambda s: s["swap"]["write_wait_s"]),
        "busy_s": _median(timed, lambda s: s["step_io"]["busy_s"]),
    }
    read_b = timed[-1]["swap"]["bytes_read"]
    write_b = timed[-1]["swap"]["bytes_written"]
    out.update(med)
    out.update({"bytes_read": read_b, "bytes_written": write_b, "prefetched_ranges": timed[-1]["swap"]["prefetched"],
                "deferred_ranges": timed[-1]["swap"].get("deferred"), "sub_groups": run.get("sub_groups"),
                # The disk's speed while it had the step's requests: near the measured bandwidth, the
                # I/O path is not what separates the step from its bound.
                "achieved_gb_s": (read_b + write_b) / med["busy_s"] / GB if med["busy_s"] else None})
    for label, bw in bandwidth.items():
        r, w = bw.get("read_gb_s"), bw.get("write_gb_s")
        if not r or not w:
            continue
        serial = read_b / (r * GB) + write_b / (w * GB)
        overlapped = max(read_b / (r * GB), write_b / (w * GB))
        out[f"bound_{label}"] = {
            "serial_s": serial, "overlapped_s": overlapped,
            "step_over_serial": med["step_s"] / serial, "optimizer_over_serial": med["optimizer_s"] / serial,
            "step_over_overlapped": med["step_s"] / overlapped,
        }
    return out


def _run_worker(spec: dict, timeout_s: float) -> dict:
    cmd = [sys.executable, str(HERE / "_nvme_step_worker.py"), json.dumps(spec)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    last: dict = {"name": spec["name"], "steps": []}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        stderr, code = f"killed after {timeout_s:.0f} s; " + stderr[-1000:], None
    finally:
        # A killed worker cannot remove its swap directory (partita-<tag>-rank0-pid<PID>).
        for name in os.listdir(spec["nvme_path"]):
            if name.startswith("partita-") and name.endswith(f"-pid{proc.pid}"):
                shutil.rmtree(os.path.join(spec["nvme_path"], name), ignore_errors=True)
    for line in stdout.splitlines():
        if line.startswith(PREFIX):
            last = json.loads(line[len(PREFIX):])
    if code != 0:
        last["error"] = f"exit {code}: {stderr.strip()[-1500:]}"
    return last


def _aio_text(aio: dict) -> str:
    return f"block {aio['block_size'] >> 10} KiB, depth {aio['queue_depth']}, threads {aio['intra_op_parallelism']}"


def _best(samples: list[dict]) -> dict:
    """The fastest of the measurements, per direction: the disk's bandwidth is what it can do."""
    best = dict(samples[-1])
    for key in ("write_gb_s", "read_gb_s", "mixed_gb_s"):
        values = [b[key] for b in samples if b.get(key)]
        if values:
            best[key] = max(values)
    best["samples"] = len(samples)
    return best


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "n/a" if value is None else format(value, spec)


def table(result: dict) -> str:
    lines = ["| bandwidth | write GB/s | read GB/s | read+write at once GB/s |", "|---|---|---|---|"]
    def io_mode(bw: dict) -> str:  # a filesystem without O_DIRECT measures the page cache, not the disk
        return {True: ", O_DIRECT", False: ", buffered: no O_DIRECT here"}.get(bw.get("direct_io"), "")

    rows = [(f"{label} ({bw.get('path')}{', aio ' + _aio_text(bw['aio']) if 'aio' in bw else ''}{io_mode(bw)}; "
             f"best of {bw.get('samples', 1)})", bw) for label, bw in result["bandwidth"].items()]
    rows += [(f"sweep: aio {_aio_text(bw['aio'])}", bw) for bw in result.get("aio_sweep", [])]
    for label, bw in rows:
        lines.append(f"| {label} | {_fmt(bw.get('write_gb_s'))} | {_fmt(bw.get('read_gb_s'))} | {_fmt(bw.get('mixed_gb_s'))} |")
    lines += ["", "| run | timed steps | step s | fwd+bwd s | host step s | swap s: compute / read wait / write wait | "
              "disk busy s (GB/s while busy) | read GB | written GB | bound s (serial / overlapped) | step / bound | "
              "host step / bound |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in result["summary"]:
        if not s.get("timed_steps"):
            lines.append(f"| {s['name']} | 0 | {s.get('note', '')} |")
            continue
        b = s.get("bound_store") or {}
        d = s.get("bound_dd") or {}
        lines.append(
            f"| {s['name']} | {s['timed_steps']} | {s['step_s']:.2f} | {s['forward_backward_s']:.2f} | "
            f"{s['optimizer_s']:.2f} | {s['swap_s']:.2f}: {s['compute_s']:.2f} / {s['read_wait_s']:.2f} / "
            f"{s['write_wait_s']:.2f} | {s['busy_s']:.2f} ({_fmt(s.get('achieved_gb_s'))}) | {s['bytes_read'] / GB:.2f} | {s['bytes_written'] / GB:.2f} | "
            f"{_fmt(b.get('serial_s'))} / {_fmt(b.get('overlapped_s'))} | {_fmt(b.get('step_over_serial'))}"
            f" (dd: {_fmt(d.get('step_over_serial'))}) | {_fmt(b.get('optimizer_over_serial'))} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--tiny", action="store_true", help=f"CPU check: GPT {TINY_GPT}, small sub-groups and files")
    p.add_argument("--model", default="gpt_1_3b", help="a GPTConfig preset (gpt_1_3b, gpt_125m, ...)")
    p.add_argument("--n-layer", type=int, default=None, help="override the preset's depth (a smaller model for a slow disk)")
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--micro-batch", type=int, default=None, help="default 8 (1 with --tiny)")
    p.add_argument("--stage", type=int, choices=(1, 2, 3), default=2)
    p.add_argument("--sub-group-size", type=int, default=None, help="elements per sub-group; default 5e7 (2^20 with --tiny)")
    p.add_argument("--buffer-count", type=int, default=8,
                   help="offload_optimizer.buffer_count: 8 lets the prefetch hold 4 sub-groups of Adam states (2 with 4)")
    p.add_argument("--block-size", type=int, default=1 << 20, help="aio.block_size")
    p.add_argument("--queue-depth", type=int, default=8, help="aio.queue_depth")
    p.add_argument("--threads", type=int, default=1, help="aio.intra_op_parallelism")
    p.add_argument("--sweep", default=None,
                   help="aio settings to measure first, block_size:queue_depth:threads,..., e.g. 1048576:8:1,4194304:16:2")
    p.add_argument("--pick-best", action="store_true", help="train with the fastest --sweep setting instead of the flags")
    p.add_argument("--measure-twice", action=argparse.BooleanOptionalAction, default=True,
                   help="measure the bandwidth again after the runs; the bound uses the faster of the two")
    p.add_argument("--wait-quiet", type=float, default=0.0, metavar="S",
                   help="on a shared machine: before each measurement and run, wait up to S seconds for the "
                        "machine to be less than 30%% busy (the waits are recorded, and count against --budget-s)")
    p.add_argument("--bucket", type=int, default=500_000_000)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=4, help="timed steps per run (fewer if the budget runs out)")
    p.add_argument("--runs", default="pipelined,serial", help="pipelined (pipeline_read/write on), serial (off)")
    p.add_argument("--bw-gib", type=float, default=None, help="GiB per bandwidth test; default 4 (0.5 with --tiny)")
    p.add_argument("--nvme-path", type=output_dir, default=None, help="swap directory on the disk measured (default: a temporary one)")
    p.add_argument("--budget-s", type=float, default=170.0, help="wall-clock cap for the whole benchmark")
    p.add_argument("--out", type=output_file, default=None, help="JSON results")
    args = p.parse_args(argv)
    started = time.perf_counter()
    if args.tiny and args.device != "cpu":
        p.error("--tiny is the CPU check; use it with --device cpu")
    sub_group = args.sub_group_size or ((1 << 20) if args.tiny else 50_000_000)
    micro = args.micro_batch or (1 if args.tiny else 8)
    bw_bytes = int((args.bw_gib or (0.5 if args.tiny else 4.0)) * 2**30)
    aio = {"block_size": args.block_size, "queue_depth": args.queue_depth, "intra_op_parallelism": args.threads}
    temporary = None
    nvme_path = args.nvme_path
    if nvme_path is None:
        temporary = nvme_path = tempfile.mkdtemp(prefix="partita-nvme-step-")
    os.makedirs(nvme_path, exist_ok=True)
    result: dict[str, Any] = {
        "commit": git_commit(str(REPO)), "versions": versions(), "hardware": hardware_summary(),
        "nvme_path": nvme_path, "disk_free_gib": shutil.disk_usage(nvme_path).free / 2**30,
        "args": vars(args), "aio": aio, "sub_group_size": sub_group, "micro_batch": micro, "gpt": _gpt(args),
        "bandwidth": {}, "runs": [], "summary": [],
    }

    def save() -> None:
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2))

    try:
        pin = False  # as the optimizer's state buffers: they never cross PCIe, so they are not page-locked
        if args.sweep:
            # Each aio setting on a quarter of the data; the fastest (serial read + write time) can run the training.
            sweep = result["aio_sweep"] = []
            for item in args.sweep.split(","):
                block, depth, threads = (int(float(v)) for v in item.split(":"))
                point = {"block_size": block, "queue_depth": depth, "intra_op_parallelism": threads}
                sweep.append(store_bandwidth(nvme_path, aio=point, numel=sub_group, count=max(4, bw_bytes // 4 // (sub_group * 4)),
                                             buffer_count=args.buffer_count, pin=pin))
            if args.pick_best:
                aio = result["aio"] = min(sweep, key=lambda b: 1 / b["read_gb_s"] + 1 / b["write_gb_s"])["aio"]
            save()
        count = max(4, bw_bytes // (sub_group * 4))
        samples = result["bandwidth_samples"] = {"store": [], "dd": []}

        def quiet(what: str) -> None:
            if args.wait_quiet > 0:
                result.setdefault("waited_s", {})[what] = wait_until_quiet(threshold=0.3, max_wait_s=args.wait_quiet)

        def measure() -> None:
            quiet(f"bandwidth {len(samples['store'])}")
            samples["store"].append(store_bandwidth(nvme_path, aio=aio, numel=sub_group, count=count,
                                                    buffer_count=args.buffer_count, pin=pin))
            samples["dd"].append(dd_bandwidth(nvme_path, total_bytes=bw_bytes))
            result["bandwidth"] = {label: _best(runs) for label, runs in samples.items()}
            save()

        measured_at = time.perf_counter()
        measure()
        result["bandwidth_s"] = bw_s = time.perf_counter() - measured_at
        names = [n for n in args.runs.split(",") if n]
        for k, name in enumerate(names):
            if name not in ("pipelined", "serial"):
                p.error(f"--runs: unknown run {name!r}; use pipelined and/or serial")
            # What is left, less a second bandwidth measurement at the end, shared by the runs left.
            left = args.budget_s - (time.perf_counter() - started) - (bw_s if args.measure_twice else 0.0)
            allowance = left / (len(names) - k)
            store = result["bandwidth"]["store"]
            spec = {"name": name, "device": args.device, "gpt": result["gpt"], "micro_batch": micro,
                    "stage": args.stage, "sub_group_size": sub_group, "buffer_count": args.buffer_count,
                    "bucket": args.bucket, "aio": aio, "nvme_path": nvme_path, "pipeline": name == "pipelined",
                    "warmup": args.warmup, "steps": args.steps, "allowance_s": allowance,
                    "bandwidth_gb_s": {"read": store["read_gb_s"], "write": store["write_gb_s"]}}
            quiet(name)
            spec["allowance_s"] = allowance - result.get("waited_s", {}).get(name, 0.0)
            # The allowance decides when steps stop; the kill is the backstop for a step that hangs.
            result["runs"].append(_run_worker(spec, timeout_s=spec["allowance_s"] + 20))
            save()
        if args.measure_twice:
            measure()  # the disk after the runs: a device that slows when warm or full shows here
        result["summary"] = [summarize(run, result["bandwidth"]) for run in result["runs"]]
    finally:
        if temporary is not None:
            shutil.rmtree(temporary, ignore_errors=True)
    result["wall_s"] = time.perf_counter() - started
    save()
    print(table(result))
    return result


if __name__ == "__main__":
    main()
