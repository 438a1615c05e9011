"""Where a pipeline schedule's idle time goes: a per-action timeline of every rank, and what the
executed order would give with the measured costs.

    python benchmarks/pipeline_timeline.py --stages 2 --schedules zero_bubble:2,interleaved_1f1b:2,1f1b:1 \
        --micro-batches 8 [--pin none|main|all] [--nice -10] [--launches 2] [--json OUT.json] [--gantt]

Each launch is one ``torchrun --nproc-per-node <stages>`` job of ``pipeline_timeline_worker``
per configuration (``schedule:virtual_stages``, with an optional ``@{json}`` of extra pipeline keys,
e.g. ``zero_bubble:2@{"zero_bubble_split":false}``); configurations alternate launch by launch so
that a shared machine's load falls on all of them alike. Per rank and batch the report splits the
torch schedule's window (``schedule.step``) into

- ``compute``: the stage calls F / B / I / W and the loss (wall; and the main thread's CPU time);
- ``wait``: waiting for receives (and, at the end, sends) with the main thread's CPU idle: the
  bubble proper, plus a neighbour that was late;
- ``post``: posting isend / irecv; ``other``: everything else (the runtime's Python between
  actions, input splitting, the first-step bookkeeping).

``idle_fraction`` = 1 - compute wall / window (the pipeline benchmark's and ``engine.last_bubble``'s
figure); ``idle_fraction_cpu`` = 1 - compute CPU / window (counts compute that was descheduled as
idle too). ``replay_measured``: the executed order of compute calls per rank (the events' order)
replayed by ``pipeline_theory.replay`` with each call's measured CPU time and free communication:
the idle this *order* costs with these costs, against ``replay_unit`` (unit costs F = I = W = 1,
B = 2: the closed form) and what the run measured. ``gantt`` draws each rank's window in text:
F / B / I / W (lower case: less than half the wall time had CPU), ``.`` waiting, ``-`` other.
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
from output_paths import output_file  # noqa: E402
from pipeline_theory import formula_bubble, replay  # noqa: E402

KINDS = "FBIW"


def parse_config(text: str) -> tuple[str, int, dict]:
    """``schedule:virtual[@{json}]`` -> (schedule, virtual stages, extra pipeline keys)."""
    head, _, extra = text.partition("@")
    schedule, _, virtual = head.partition(":")
    return schedule, int(virtual or 1), json.loads(extra) if extra else {}


def launch(schedule: str, virtual: int, extra: dict, args, port: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.stages),
               "--master-port", str(port), os.path.join(HERE, "pipeline_timeline_worker.py"),
               "--schedule", schedule, "--virtual-stages", str(virtual), "--micro-batches", str(args.micro_batches),
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--pipeline-extra", json.dumps(extra),
               "--out", out, "--pin", args.pin]
        if args.nice:
            cmd = ["nice", "-n", str(args.nice)] + cmd
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
        busy0, own0, t0 = cpu_busy_seconds(), children_cpu_seconds(), time.monotonic()
        proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
        wall = time.monotonic() - t0
        other = (cpu_busy_seconds() - busy0) - (children_cpu_seconds() - own0)
        if proc.returncode != 0:
            lines = [x for x in (proc.stderr + proc.stdout).splitlines() if "Error" in x]
            return {"error": lines[-1] if lines else proc.stderr[-2000:], "wall_s": wall}
        ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(args.stages)]
    return {"wall_s": wall, "other_jobs_cpu_share": max(0.0, other) / (wall * (os.cpu_count() or 1)), "ranks": ranks}


def _inside(event: list, window: list) -> bool:
    return event[2] >= window[2] and event[3] <= window[3]


def breakdown(events: list[list]) -> dict:
    """One rank's batch: the window split into compute / wait / post / other (seconds)."""
    window = next(e for e in events if e[0] == "window")
    batch = next(e for e in events if e[0] == "batch")
    inner = [e for e in events if e[0] in ("compute", "wait", "post") and _inside(e, window)]
    span = window[3] - window[2]
    sums = {k: sum(e[3] - e[2] for e in inner if e[0] == k) for k in ("compute", "wait", "post")}
    cpu = {k: sum(e[5] - e[4] for e in inner if e[0] == k) for k in ("compute", "wait", "post")}
    per_kind: dict[str, list[float]] = {}
    for e in inner:
        if e[0] == "compute" and e[1] != "loss":
            stage, kind, _ = _op(e[1])
            # stage 0's I and W are listed apart: torch computes no input gradient there (I is empty, W whole)
            per_kind.setdefault(kind + ("@s0" if stage == 0 else ""), []).append(e[5] - e[4])
    return {
        "batch_s": batch[3] - batch[2], "window_s": span,
        "compute_s": sums["compute"], "compute_cpu_s": cpu["compute"], "wait_s": sums["wait"], "wait_cpu_s": cpu["wait"],
        "post_s": sums["post"], "other_s": span - sum(sums.values()),
        "window_process_cpu_s": window[7] - window[6], "window_thread_cpu_s": window[5] - window[4],
        # the main thread's CPU time in the window outside compute: the runtime's own Python and posting
        "overhead_cpu_s": (window[5] - window[4]) - cpu["compute"],
        "idle_fraction": 1.0 - sums["compute"] / span, "idle_fraction_cpu": 1.0 - cpu["compute"] / span,
        "cpu_per_call_ms": {k: 1e3 * statistics.median(v) for k, v in sorted(per_kind.items())},
        "calls": {k: len(v) for k, v in sorted(per_kind.items())},
    }


def _kind(label: str) -> str:
    """``"12I3"`` -> ``"I"`` (stage digits, kind letter, micro-batch digits)."""
    return next(c for c in label if c.isalpha())


def _op(label: str) -> tuple[int, str, int]:
    kind = _kind(label)
    stage, mb = label.split(kind, 1)
    return int(stage), kind, int(mb)


def executed_ops(events: list[list]) -> list[tuple[list, tuple[int, str, int]]]:
    """The compute calls in the order they ran, each with its op; the loss is folded into the
    forward it follows (the replay's F of the last stage includes it)."""
    out: list[tuple[list, tuple[int, str, int]]] = []
    for e in sorted((e for e in events if e[0] == "compute"), key=lambda e: e[2]):
        if e[1] == "loss":
            if out:
                prev, op = out[-1]
                out[-1] = ([*prev[:4], prev[4], prev[5] + (e[5] - e[4]), *prev[6:]], op)
            continue
        out.append((e, _op(e[1])))
    return out


def replay_measured(per_rank_events: list[list[list]], num_stages: int, v: int) -> dict:
    """The executed order replayed with each call's measured CPU time (zero-cost communication),
    and with the unit costs: idle fraction per rank and the makespan in seconds."""
    ops, costs = [], {}
    for events in per_rank_events:
        rank_ops = []
        for e, op in executed_ops(events):
            rank_ops.append(op)
            costs[op] = e[5] - e[4]
        ops.append(rank_ops)
    measured = replay(ops, num_stages, v, costs)
    unit = replay(ops, num_stages, v)
    busy = [sum(costs[o] for o in r) for r in ops]
    return {"idle_fraction_per_rank": measured, "unit_cost_idle_fraction_per_rank": unit,
            "makespan_s": max(b / (1 - f) for b, f in zip(busy, measured) if f < 1)}


def gantt(events: list[list], width: int, t_end: float) -> str:
    """One rank's window as ``width`` characters (see the module docstring)."""
    window = next(e for e in events if e[0] == "window")
    line = [" "] * width
    scale = width / t_end

    def paint(e: list, ch: str) -> None:
        for i in range(int(e[2] * scale), min(width, max(int(e[2] * scale) + 1, int(e[3] * scale)))):
            line[i] = ch

    paint(window, "-")
    for e in events:
        if e[0] == "wait":
            paint(e, ".")
    for e in events:
        if e[0] == "compute" and e[1] != "loss":
            ch = _kind(e[1])
            paint(e, ch if (e[5] - e[4]) >= 0.5 * (e[3] - e[2]) else ch.lower())
    return "".join(line)


def summarize(jobs: list[dict], micro_batches: int) -> list[dict]:
    rows: dict[str, dict] = {}
    for job in jobs:
        if "ranks" not in job:
            continue
        first = job["ranks"][0]
        key = job["config"]
        row = rows.setdefault(key, {"config": key, "schedule": first["schedule"], "virtual_stages": first["virtual_stages"],
                                    "stages": first["stages"], "batches": [], "replays": [], "other_jobs_cpu_share": []})
        row["other_jobs_cpu_share"].append(job["other_jobs_cpu_share"])
        for i in range(len(first["steps"])):
            per_rank = [r["steps"][i]["events"] for r in job["ranks"]]
            row["batches"].append([breakdown(ev) for ev in per_rank])
            row["replays"].append(replay_measured(per_rank, first["stages"] * first["virtual_stages"],
                                                  first["virtual_stages"]))
    out = []
    for row in rows.values():
        p, v = row["stages"], row["virtual_stages"]
        b = row["batches"]

        def med(key: str, rank: int) -> float:
            return statistics.median(x[rank][key] for x in b)

        out.append({
            "config": row["config"], "schedule": row["schedule"], "virtual_stages": v, "stages": p,
            "micro_batches": micro_batches, "timed_batches": len(b),
            "batch_ms_median": 1e3 * statistics.median(max(r["batch_s"] for r in x) for x in b),
            "window_ms_median": 1e3 * statistics.median(max(r["window_s"] for r in x) for x in b),
            "per_rank": [{k: med(k, r) for k in ("window_s", "compute_s", "compute_cpu_s", "wait_s", "post_s", "other_s",
                                                 "idle_fraction", "idle_fraction_cpu", "overhead_cpu_s")}
                         | {"cpu_per_call_ms": b[-1][r]["cpu_per_call_ms"], "calls": b[-1][r]["calls"]} for r in range(p)],
            "idle_fraction_mean": statistics.mean(med("idle_fraction", r) for r in range(p)),
            "idle_fraction_cpu_mean": statistics.mean(med("idle_fraction_cpu", r) for r in range(p)),
            "replay_measured_idle_mean": statistics.median(statistics.mean(x["idle_fraction_per_rank"])
                                                           for x in row["replays"]),
            "replay_unit_idle_mean": statistics.mean(row["replays"][-1]["unit_cost_idle_fraction_per_rank"]),
            "formula_idle_fraction": formula_bubble(row["schedule"], p, micro_batches, v),
            "other_jobs_cpu_share": row["other_jobs_cpu_share"],
        })
    return out


def markdown(rows: list[dict]) -> str:
    lines = ["| config | batch ms | window ms | idle (wall) | idle (CPU) | replay, measured costs | formula | "
             "wait / post / other ms per rank | CPU ms per call |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        parts = " ; ".join(f"{1e3 * x['wait_s']:.0f}/{1e3 * x['post_s']:.0f}/{1e3 * x['other_s']:.0f}" for x in r["per_rank"])
        calls = " ; ".join(",".join(f"{k} {v:.1f}" for k, v in x["cpu_per_call_ms"].items()) for x in r["per_rank"])
        lines.append(f"| {r['config']} | {r['batch_ms_median']:.0f} | {r['window_ms_median']:.0f} | "
                     f"{r['idle_fraction_mean']:.3f} | {r['idle_fraction_cpu_mean']:.3f} | {r['replay_measured_idle_mean']:.3f} | "
                     f"{r['formula_idle_fraction']:.3f} | {parts} | {calls} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--schedules", default="zero_bubble:2,interleaved_1f1b:2,1f1b:1",
                        help="comma-separated schedule:virtual_stages[@{json pipeline keys}]")
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--launches", type=int, default=1, help="launches of every configuration, alternating")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--pin", choices=("none", "main", "all"), default="none",
                        help="rank r on CPU r %% cpu_count: its main thread, or all its threads (gloo's too)")
    parser.add_argument("--nice", type=int, default=0)
    parser.add_argument("--gantt", action="store_true", help="print each configuration's last batch as text")
    parser.add_argument("--json", type=output_file, default=None)
    args = parser.parse_args()
    configs = _split_configs(args.schedules)
    started = datetime.datetime.now(datetime.timezone.utc)
    jobs = []
    for i in range(args.launches):
        for c, text in enumerate(configs):
            schedule, virtual, extra = parse_config(text)
            job = launch(schedule, virtual, extra, args, 29700 + (i * len(configs) + c) % 200)
            job["config"], job["launch"] = text, i
            jobs.append(job)
            print(f"launch {i} {text}: {job['wall_s']:.0f} s" + (f", error: {job['error']}" if "error" in job else
                  f", other jobs' CPU share {job['other_jobs_cpu_share']:.2f}"), flush=True)
    rows = summarize(jobs, args.micro_batches)
    table = markdown(rows)
    print(table)
    if args.gantt:
        for job in jobs:
            if "ranks" in job and job["launch"] == args.launches - 1:
                evs = [r["steps"][-1]["events"] for r in job["ranks"]]
                end = max(e[3] for ev in evs for e in ev if e[0] == "window")
                print(f"\n{job['config']} (last batch, {1e3 * end:.0f} ms)")
                for r, ev in enumerate(evs):
                    print(f"rank {r} |{gantt(ev, 120, end)}|")
    if args.json:
        from common import versions

        with open(args.json, "w") as f:
            json.dump({"started_utc": started.isoformat(timespec="seconds"), "command": " ".join(sys.argv),
                       "commit": git_commit(REPO), "hardware": hardware_summary(), "versions": versions(),
                       "settings": vars(args), "rows": rows, "table": table,
                       "errors": [{"config": j["config"], "error": j["error"]} for j in jobs if "error" in j],
                       "launches": [_last_batch_only(j) for j in jobs]}, f)


def _last_batch_only(job: dict) -> dict:
    """The launch with only its last batch's events per rank (the rows hold every batch's figures;
    all events of every batch would make the JSON megabytes)."""
    if "ranks" not in job:
        return job
    return {**job, "ranks": [{**r, "steps": r["steps"][-1:]} for r in job["ranks"]]}


def _split_configs(text: str) -> list[str]:
    """Commas inside ``@{...}`` belong to the JSON, not the list."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += ch == "{"
        depth -= ch == "}"
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    return out + [cur] if cur else out


if __name__ == "__main__":
    main()
