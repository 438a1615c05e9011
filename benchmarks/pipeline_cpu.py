"""CPU benchmark: partita's pipeline schedules against DeepSpeed's PipelineEngine, 4 gloo processes.

    python benchmarks/pipeline_cpu.py [--micro-batches 4,8,16] [--launches 1] [--rounds 3] [--steps 4] \
        [--json benchmarks/results/pipeline_cpu_<date>.json]

The model is 16 pre-norm residual MLP blocks (d 256, hidden 1024; ``pipeline_cpu_worker.Block``),
64 rows per micro-batch, MSE loss, AdamW, ZeRO-0, gradient clipping 1.0, fp32, cut uniformly
into 4 stages (4 blocks each; 8 chunks of 2 blocks for the interleaved schedules, 2 per rank).
partita runs every schedule it offers (``gpipe``, ``1f1b``, ``interleaved_1f1b`` with
``virtual_stages`` 2, ``zero_bubble`` with 1 and with 2), DeepSpeed 0.19.8 its one 1F1B ``TrainSchedule``
(``deepspeed.pipe.PipelineModule`` + ``deepspeed.initialize`` + ``train_batch``), on the same
layers, seeds, partition and micro-batches.

Each of ``--launches`` ``torchrun --nproc-per-node 4`` jobs runs every configuration of both
engines in one gloo process group (``--ds-python``: a venv with DeepSpeed and partita, as
docs/performance/method.md's benchmark environment); the configurations take turns over ``--rounds``
rounds, in an order rotated each round (``pipeline_cpu_worker``), so both engines see the same
load of a shared machine. Figures:

- step ms: the median over all timed batches of the slowest rank's ``train_batch`` (each batch
  starts after a barrier);
- idle fraction per stage: 1 - compute / pipelined window of that rank, median over batches
  (how both are timed: ``pipeline_cpu_worker``'s docstring); against it the theory
  (``pipeline_theory``: the closed form, and a replay of torch's own action order, which agree);
- the first batch's loss of every configuration (before any update, so it must agree across
  engines and schedules: the same weights and data).

Every process runs with one torch thread (``OMP_NUM_THREADS=1``, ``torch.set_num_threads(1)``).
The driver records, per launch, the share of the machine's CPU time that other jobs took
(``/proc/stat`` minus this launch's own); ``--nice -10`` keeps the benchmark ahead of them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from common import children_cpu_seconds, cpu_busy_seconds, git_commit, hardware_summary  # noqa: E402
from pipeline_theory import formula_bubble, simulated_bubble  # noqa: E402
from output_paths import output_file  # noqa: E402

# zero_bubble twice: one chunk per rank (ZB-H1) and two (the interleaved zero-bubble schedule).
PARTITA_SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 1), ("zero_bubble", 2))


def launch(configs: list[tuple[str, str, int, int]], args, port: int) -> dict:
    """One torchrun job of the worker over ``(engine, schedule, virtual, micro_batches)`` configs;
    returns its per-rank results and the machine's share of CPU time other jobs took meanwhile."""
    with_ds = any(c[0] == "deepspeed" for c in configs)
    python = args.ds_python if with_ds else sys.executable
    with tempfile.TemporaryDirectory() as out:
        cmd = [python, "-m", "torch.distributed.run", "--nproc-per-node", str(args.stages), "--master-port", str(port),
               os.path.join(HERE, "pipeline_cpu_worker.py"),
               "--configs", ",".join(":".join(map(str, c)) for c in configs), "--rounds", str(args.rounds),
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--out", out]
        if args.nice:
            cmd = ["nice", "-n", str(args.nice)] + cmd  # the same for both engines
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
        if with_ds:
            env["DS_ACCELERATOR"] = "cpu"
        busy0, own0, t0 = cpu_busy_seconds(), children_cpu_seconds(), time.monotonic()
        load0 = os.getloadavg()[0]
        proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
        wall = time.monotonic() - t0
        other = (cpu_busy_seconds() - busy0) - (children_cpu_seconds() - own0)
        if proc.returncode != 0:
            return {"error": _last_error(proc.stderr + proc.stdout), "wall_s": wall}
        ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(args.stages)]
    return {"wall_s": wall, "load_average_start": load0,
            "other_jobs_cpu_share": max(0.0, other) / (wall * (os.cpu_count() or 1)), "ranks": ranks}


def _last_error(text: str) -> str:
    """The worker's exception line (the last line naming an Error), not torchrun's report."""
    lines = [line.strip() for line in text.splitlines() if "Error" in line or "error" in line]
    return lines[-1] if lines else text.strip()[-2000:]


def summarize(launches: list[dict], stages: int) -> list[dict]:
    """One row per (engine, schedule, micro-batches) over all launches."""
    rows: dict[tuple, dict] = {}
    for job in launches:
        if "ranks" not in job:
            continue
        for c, first in enumerate(job["ranks"][0]):
            key = (first["engine"], first["schedule"], first["virtual_stages"], first["micro_batches"])
            row = rows.setdefault(key, {"steps": [], "idle": [[] for _ in range(stages)], "cpu": [], "first_loss": None,
                                        "engine_idle": [[] for _ in range(stages)], "core_share": []})
            per_rank = [job["ranks"][r][c] for r in range(stages)]
            if row["first_loss"] is None:
                row["first_loss"] = per_rank[-1]["warmup"][0]["loss"] if per_rank[-1]["warmup"] else None
            for i in range(len(per_rank[0]["steps"])):
                batch = [pr["steps"][i] for pr in per_rank]
                row["steps"].append(max(b["step_s"] for b in batch))
                row["cpu"].append(sum(b["cpu_s"] for b in batch))
                row["core_share"].append(sum(b["compute_cpu_s"] for b in batch) / sum(b["compute_s"] for b in batch))
                for s, b in enumerate(batch):
                    row["idle"][s].append(1.0 - b["compute_s"] / b["window_s"])
                    if "engine_bubble" in b and b["engine_bubble"].get("idle_fraction") is not None:
                        row["engine_idle"][s].append(b["engine_bubble"]["idle_fraction"])
    out = []
    for (engine, schedule, v, m), row in rows.items():
        name = "deepspeed_1f1b" if engine == "deepspeed" else schedule.partition("/")[0]  # "zero_bubble/autograd"
        idle = [statistics.median(x) for x in row["idle"]]
        sim = simulated_bubble(name, stages, m, v)
        out.append({
            "engine": engine, "schedule": schedule, "virtual_stages": v, "micro_batches": m,
            "timed_batches": len(row["steps"]),
            "step_ms_median": 1e3 * statistics.median(row["steps"]),
            "step_ms_min": 1e3 * min(row["steps"]),
            "step_ms_quartiles": [1e3 * q for q in statistics.quantiles(row["steps"], n=4)] if len(row["steps"]) > 1 else None,
            "idle_fraction_per_stage": idle, "idle_fraction_mean": sum(idle) / len(idle),
            "engine_timer_idle_fraction_per_stage": [statistics.median(x) if x else None for x in row["engine_idle"]],
            "theory_idle_fraction": formula_bubble(name, stages, m, v),
            "simulated_idle_fraction_per_stage": sim,
            "cpu_s_per_batch_all_ranks": statistics.median(row["cpu"]),
            # thread CPU time / wall time inside compute calls, over all ranks: 1.0 when every
            # rank had a core to itself while computing, about cores / ranks when oversubscribed.
            "core_share_during_compute": statistics.median(row["core_share"]),
            "first_batch_loss": row["first_loss"],
        })
    order = {"gpipe": 0, "1f1b": 1, "interleaved_1f1b": 2, "zero_bubble": 3}
    out.sort(key=lambda r: (r["micro_batches"], r["engine"] == "deepspeed", order.get(r["schedule"].partition("/")[0], 9),
                            r["virtual_stages"], r["schedule"]))
    return out


def markdown(rows: list[dict]) -> str:
    lines = ["| m | engine / schedule | step ms (median; IQR) | DeepSpeed ms / this ms | idle fraction per stage (mean) | theory | core share in compute |",
             "|---|---|---|---|---|---|---|"]
    ds = {r["micro_batches"]: r["step_ms_median"] for r in rows if r["engine"] == "deepspeed"}
    for r in rows:
        label = "DeepSpeed 1F1B" if r["engine"] == "deepspeed" else f"partita {r['schedule']}" + (
            f" (v={r['virtual_stages']})" if r["virtual_stages"] > 1 else "")
        q = r["step_ms_quartiles"]
        iqr = f"; {q[0]:.0f}–{q[2]:.0f}" if q else ""
        ratio = f"{ds[r['micro_batches']] / r['step_ms_median']:.2f}×" if r["micro_batches"] in ds and r["engine"] != "deepspeed" else "—"
        idle = " / ".join(f"{x:.2f}" for x in r["idle_fraction_per_stage"])
        lines.append(f"| {r['micro_batches']} | {label} | {r['step_ms_median']:.0f}{iqr} | {ratio} | {idle} "
                     f"({r['idle_fraction_mean']:.2f}) | {r['theory_idle_fraction']:.3f} | {r['core_share_during_compute']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, default=4, help="processes = pipeline stages")
    parser.add_argument("--micro-batches", default="4,8,16")
    parser.add_argument("--schedules", default=None,
                        help="partita's configurations, comma-separated schedule:virtual_stages (default: all of "
                             "PARTITA_SCHEDULES); zero_bubble/autograd: with pipeline.zero_bubble_weight_split "
                             "\"autograd\" (torch's split)")
    parser.add_argument("--launches", type=int, default=1, help="torchrun jobs, each running every configuration")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4, help="timed batches per configuration per round")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--ds-python", default=os.path.join(REPO, ".bench-venv", "bin", "python"))
    parser.add_argument("--no-deepspeed", action="store_true")
    parser.add_argument("--nice", type=int, default=0,
                        help="run every launch under nice -n N (negative, as root: ahead of other jobs on a shared machine)")
    parser.add_argument("--json", type=output_file, default=None)
    args = parser.parse_args()
    ms = [int(x) for x in args.micro_batches.split(",")]
    chosen = PARTITA_SCHEDULES if args.schedules is None else [
        (item.split(":")[0], int(item.split(":")[1]) if ":" in item else 1) for item in args.schedules.split(",")]
    configs = [("partita", s, v, m) for m in ms for s, v in chosen]
    if not args.no_deepspeed:
        # Each m's DeepSpeed run next to partita's runs of that m (the worker rotates the order per round).
        configs = [c for m in ms for c in [x for x in configs if x[3] == m] + [("deepspeed", "1f1b", 1, m)]]
    started = datetime.datetime.now(datetime.timezone.utc)
    jobs = []
    for i in range(args.launches):
        job = launch(configs, args, 29640 + i)
        job["launch"] = i
        jobs.append(job)
        print(f"launch {i}: {job['wall_s']:.0f} s" + (f", error: {job['error']}" if "error" in job else
              f", other jobs' CPU share {job['other_jobs_cpu_share']:.2f}"), flush=True)
    rows = summarize(jobs, args.stages)
    table = markdown(rows)
    print(table)
    errors = [{"launch": j["launch"], "error": j["error"]} for j in jobs if "error" in j]
    if args.json:
        from common import versions

        result = {"started_utc": started.isoformat(timespec="seconds"), "command": " ".join(sys.argv),
                  "commit": git_commit(REPO), "hardware": hardware_summary(), "versions": versions(),
                  "ds_versions": _ds_versions(args.ds_python) if not args.no_deepspeed else None,
                  "stages": args.stages, "settings": vars(args), "rows": rows, "errors": errors, "table": table,
                  "launches": jobs}
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


def _ds_versions(python: str) -> str:
    code = "import torch, deepspeed; print(f'torch {torch.__version__}, deepspeed {deepspeed.__version__}')"
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    return proc.stdout.strip().splitlines()[-1] if proc.returncode == 0 else f"unavailable: {_last_error(proc.stderr)}"


if __name__ == "__main__":
    main()
