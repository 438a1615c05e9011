"""Step time of the reference GPT on 2 CPU processes: partita vs DeepSpeed 0.19.8 at ZeRO 0, 1, 2.

One command measures every engine in the same run, on the same machine, minutes apart:

    python benchmarks/cpu_step_time.py

For each round, stage and engine it launches ``torchrun --nproc_per_node 2
benchmarks/cpu_step_worker.py`` as a subprocess -- one configuration at a time, so the engines
never compete for the cores -- and collects the worker's per-step times. Engines are measured
in a rotating order each round, so slow drift of the machine (other jobs, thermal limits) does
not always land on the same engine.

The machine may be shared (it is, on the 2-core VM the figures come from): before each launch
the driver waits for idle CPUs, and it measures how much CPU other jobs took during the launch.
Headline figures: per stage, the median over clean rounds of partita/DeepSpeed step-time ratios
of back-to-back launches, and per engine the median step of its fastest clean round. Every
round, with its share of foreign load, is kept in the details table and the JSON file.

Plain torch DDP runs at stage 0 as a third row: the floor a stage-0 engine can reach.

``--offload`` adds ZeRO-Offload (``offload_optimizer: {"device": "cpu"}``) at stages 1-3 to the
same rounds: partita, partita with ``delayed_param_update``, and DeepSpeed (which then steps
with its own ``DeepSpeedCPUAdam``). The runs without offload stay in as the baseline, so the
offload cost of each engine is a ratio of launches minutes apart. On a CPU-only machine the
"device" is the host: this measures the transfer machinery and the host optimizer kernel, not
PCIe traffic.

Results: a JSON file under ``benchmarks/results/`` and a dated section appended to that day's
report, ``benchmarks/results/<date>-report.md`` (date, hardware, versions, the exact command, the
table); the documentation's performance page (docs/performance/index.md) lists the reports.
DeepSpeed is a benchmark-only dependency: install it into the benchmark environment (see
docs/performance/method.md), never into partita's.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import shutil
import socket
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
from common import (  # noqa: E402
    ENGINES, ModelSize, children_cpu_seconds, cpu_busy_seconds, git_commit, hardware_summary, median_ms, size_dict,
    versions, wait_until_quiet,
)
from output_paths import output_dir  # noqa: E402

WORKER = HERE / "cpu_step_worker.py"
# Dated reports live beside the raw results; the docs site links them (docs/performance/index.md).
DOCS = REPO / "benchmarks" / "results" / f"{dt.date.today().isoformat()}-report.md"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2], choices=(0, 1, 2, 3))
    p.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    p.add_argument("--nproc", type=int, default=2, help="processes (one per core)")
    p.add_argument("--steps", type=int, default=12, help="timed steps per launch")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per launch")
    p.add_argument("--rounds", type=int, default=7, help="launches per engine and stage, interleaved")
    p.add_argument("--offload", action="store_true",
                   help="also measure optimizer offload to CPU at stages 1-3: partita, partita with "
                        "delayed_param_update, DeepSpeed; the runs without offload stay as the baseline")
    p.add_argument("--ds-torch-adam", action="store_true",
                   help="DeepSpeed with torch.optim.AdamW instead of its compiled CPU FusedAdam (with --offload: "
                        "instead of DeepSpeedCPUAdam, through \"zero_force_ds_cpu_optimizer\": false)")
    p.add_argument("--nice", type=int, default=0,
                   help="niceness for the launches (negative needs root): shields the measurement from other "
                        "jobs on a shared machine; the same for every engine")
    p.add_argument("--quiet-wait", type=float, default=120.0,
                   help="before each launch, wait up to this many seconds for other jobs to leave the CPUs (0: no wait)")
    p.add_argument("--quiet-below", type=float, default=0.15,
                   help="machine busy fraction (0-1) under which it counts as quiet")
    p.add_argument("--max-foreign", type=float, default=0.10,
                   help="rounds during which other jobs took more than this share of the CPUs are left out of the "
                        "headline figures (still listed in the details)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per launch before it counts as hung")
    p.add_argument("--results-dir", type=lambda value: Path(output_dir(value)), default=HERE / "results")
    p.add_argument("--no-docs", action="store_true", help=f"do not append a section to {DOCS.relative_to(REPO)}")
    return p.parse_args()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def partita_importable() -> str | None:
    """None when ``partita.initialize`` imports in the benchmark interpreter, else the error."""
    probe = subprocess.run([sys.executable, "-c", "import partita; partita.initialize"],
                           capture_output=True, text=True, cwd=tempfile.gettempdir())
    return None if probe.returncode == 0 else probe.stderr.strip().splitlines()[-1]


# Offload variants: (worker flags, label). "none" is the plain run every other variant is set against.
VARIANTS: dict[str, tuple[list[str], str]] = {
    "none": ([], "no offload"),
    "cpu": (["--offload", "cpu"], "offload cpu"),
    "cpu+delayed": (["--offload", "cpu", "--delayed-update"], "offload cpu + delayed update"),
}


def variants_for(engine: str, stage: int, offload: bool) -> list[str]:
    """Which variants an engine runs at a stage: offload needs ZeRO 1-3, and the delayed update
    is partita's alone (DeepSpeed has no such option)."""
    if not offload or engine == "ddp" or stage == 0:
        return ["none"]
    return ["none", "cpu", "cpu+delayed"] if engine == "partita" else ["none", "cpu"]


def launch(engine: str, stage: int, variant: str, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    """Run one configuration under torchrun; return the worker's measurements or the error."""
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"  # one core per process, the same for every engine
    if engine == "deepspeed":
        env["DS_ACCELERATOR"] = "cpu"  # otherwise DeepSpeed looks for CUDA and fails without it
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
        out = Path(tmp.name)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc),
           "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), str(WORKER),
           "--engine", engine, "--stage", str(stage), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--out", str(out), *VARIANTS[variant][0]]
    if engine == "deepspeed" and args.ds_torch_adam:
        cmd.append("--ds-torch-adam")
    log = log_dir / f"{engine}-stage{stage}{'' if variant == 'none' else '-' + variant}.log"
    waited = wait_until_quiet(threshold=args.quiet_below, max_wait_s=args.quiet_wait) if args.quiet_wait > 0 else 0.0
    load_before = os.getloadavg()[0]
    busy0, mine0 = cpu_busy_seconds(), children_cpu_seconds()
    start = time.perf_counter()
    try:
        with open(log, "a") as f:
            proc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=args.timeout,
                                  cwd=tempfile.gettempdir(), preexec_fn=(lambda: os.nice(args.nice)) if args.nice else None)
        rc: int | str = proc.returncode
    except subprocess.TimeoutExpired:
        rc = f"timeout after {args.timeout:.0f} s"
    wall = time.perf_counter() - start
    # Share of the machine other jobs used while this launch ran: busy time not spent by our
    # own process tree. Figures from launches with a high share are inflated.
    foreign = (cpu_busy_seconds() - busy0 - (children_cpu_seconds() - mine0)) / (wall * (os.cpu_count() or 1))
    if out.stat().st_size > 0:
        # Rank 0 writes only after the last collective of the measurement, so a file means both
        # ranks finished every timed step; a non-zero exit then happened while tearing down
        # (seen once with DeepSpeed: "terminate called without an active exception" in rank 1).
        result = json.loads(out.read_text())
        if rc != 0:
            result["teardown_error"] = {"exit": str(rc), "log_tail": log.read_text().splitlines()[-20:]}
    else:
        tail = log.read_text().splitlines()[-40:]
        result = {"engine": engine, "stage": stage, "error": f"exit {rc}", "log_tail": tail}
    out.unlink(missing_ok=True)
    result.update(variant=variant, wall_s=wall, loadavg_1m_before=load_before, foreign_cpu=max(foreign, 0.0), quiet_wait_s=waited)
    return result


Key = tuple[str, int, str]  # (engine, stage, offload variant)


def summarize(runs: list[dict[str, Any]], *, max_foreign: float) -> dict[Key, dict[str, Any]]:
    """Per (engine, stage, variant): the median of each round, the fastest clean round (other jobs took at
    most ``max_foreign`` of the CPUs; all rounds when none is clean), and all steps pooled."""
    table: dict[Key, dict[str, Any]] = {}
    for r in runs:
        key = (r["engine"], r["stage"], r.get("variant", "none"))
        row = table.setdefault(key, {"step_s": [], "round_ms": {}, "round_foreign": {}, "errors": [], "final_loss": [],
                                     "phases": []})
        if "error" in r:
            row["errors"].append(r)
            continue
        row["step_s"] += r["step_s"]
        row["round_ms"][r["round"]] = median_ms(r["step_s"])
        row["round_foreign"][r["round"]] = r["foreign_cpu"]
        row["final_loss"].append(r["loss_curve"][-1])
        row["phases"].append((median_ms(r["forward_s"]), median_ms(r["backward_s"]), median_ms(r["optimizer_step_s"])))
        row["peak_rss_mib"] = r["peak_rss_mib"]
        row["optimizer_class"] = r.get("optimizer_class", "?")
    for row in table.values():
        if row["step_s"]:
            row["median_ms"] = median_ms(row["step_s"])
            # Other jobs on a shared machine only ever add time, so the least disturbed round is
            # the best estimate of what an engine costs on its own.
            clean = [k for k in row["round_ms"] if row["round_foreign"][k] <= max_foreign]
            row["clean_rounds"] = clean
            row["best_ms"] = min(row["round_ms"][k] for k in (clean or row["round_ms"]))
            row["phase_ms"] = [statistics.median(p[i] for p in row["phases"]) for i in range(3)]
    return table


def round_ratios(table: dict[Key, dict[str, Any]], num: Key, den: Key) -> list[float]:
    """``num`` / ``den`` per round. The launches of a round run minutes apart at most, so each
    ratio compares them under nearly the same machine load; their median is the headline ratio."""
    nrow, drow = table.get(num, {}), table.get(den, {})
    n, d = nrow.get("round_ms", {}), drow.get("round_ms", {})
    both = [k for k in sorted(n) if k in d]
    clean = [k for k in both if k in nrow["clean_rounds"] and k in drow["clean_rounds"]]
    return [n[k] / d[k] for k in (clean or both)]


def paired_ratios(table: dict[Key, dict[str, Any]], stage: int, variant: str = "none") -> list[float]:
    """partita / DeepSpeed per round, both in the same offload variant."""
    return round_ratios(table, ("partita", stage, variant), ("deepspeed", stage, variant))


def _cell(table: dict[Key, dict[str, Any]], key: Key) -> str:
    row = table.get(key)
    if row is None:
        return "-"
    if "best_ms" not in row:
        return "failed"
    return f"{row['best_ms']:.1f}"


def _loss(table: dict[Key, dict[str, Any]], key: Key) -> str:
    row = table.get(key)
    return f"{row['final_loss'][-1]:.5f}" if row and row["final_loss"] else "-"


def render_table(table: dict[Key, dict[str, Any]], stages: list[int]) -> str:
    """Markdown table; ratio = partita / DeepSpeed (below 1.00 means partita is faster). With
    offload variants in the run, one row per stage and variant and an "offload" column."""
    variants = [v for v in VARIANTS if any(k[2] == v for k in table)]
    with_offload = variants != ["none"]
    lines = ["| ZeRO stage | " + ("offload | " if with_offload else "") + "partita ms/step | DeepSpeed ms/step "
             "| ratio partita/DS (median of rounds) | ratio per round | torch DDP ms/step | final loss partita / DS |",
             "|---|---|---|---|---|---|---|" + ("---|" if with_offload else "")]
    for stage in stages:
        for variant in variants:
            p, d = ("partita", stage, variant), ("deepspeed", stage, variant)
            if p not in table and d not in table:
                continue
            ratios = paired_ratios(table, stage, variant)
            ratio = f"**{statistics.median(ratios):.3f}**" if ratios else "-"
            per_round = ", ".join(f"{x:.2f}" for x in ratios) or "-"
            ddp = _cell(table, ("ddp", stage, variant)) if stage == 0 else "n/a"
            ds = _cell(table, d) if d in table or variant != "cpu+delayed" else "n/a (no such option)"
            label = f"{VARIANTS[variant][1]} | " if with_offload else ""
            lines.append(f"| {stage} | {label}{_cell(table, p)} | {ds} | {ratio} | {per_round} "
                         f"| {ddp} | {_loss(table, p)} / {_loss(table, d)} |")
    return "\n".join(lines)


def render_offload_cost(table: dict[Key, dict[str, Any]], stages: list[int]) -> str:
    """Each offload variant against the same engine without offload, per round: what turning
    offload on costs that engine (above 1.00: slower)."""
    lines = ["| engine | ZeRO stage | offload | ms/step | without offload ms/step | ratio to without (median of rounds) "
             "| ratio per round | optimizer that steps |",
             "|---|---|---|---|---|---|---|---|"]
    for stage in stages:
        for (engine, s, variant), row in table.items():
            if s != stage or variant == "none":
                continue
            base = (engine, stage, "none")
            ratios = round_ratios(table, (engine, stage, variant), base)
            ratio = f"**{statistics.median(ratios):.3f}**" if ratios else "-"
            lines.append(f"| {engine} | {stage} | {VARIANTS[variant][1]} | {_cell(table, (engine, stage, variant))} "
                         f"| {_cell(table, base)} | {ratio} | {', '.join(f'{x:.2f}' for x in ratios) or '-'} "
                         f"| {row.get('optimizer_class', '?')} |")
    return "\n".join(lines)


def render_details(table: dict[Key, dict[str, Any]]) -> str:
    """Per-round medians, all steps pooled, and the phase split (rank 0, no barriers between
    phases): where the time goes."""
    lines = ["| engine | stage | median ms per round (CPU share other jobs took) | all steps median ms | forward / backward / step ms (rank 0) "
             "| peak RSS MiB/rank |",
             "|---|---|---|---|---|---|"]
    order = list(VARIANTS)
    for (engine, stage, variant), row in sorted(table.items(), key=lambda kv: (kv[0][1], kv[0][0], order.index(kv[0][2]))):
        if variant != "none":
            engine = f"{engine} ({VARIANTS[variant][1]})"
        if "median_ms" not in row:
            lines.append(f"| {engine} | {stage} | failed: {row['errors'][0]['error']} | | | |")
            continue
        f, b, s = row["phase_ms"]
        rounds = ", ".join(f"{row['round_ms'][k]:.0f} ({100 * row['round_foreign'][k]:.0f}%)" for k in sorted(row["round_ms"]))
        lines.append(f"| {engine} | {stage} | {rounds} | {row['median_ms']:.0f} | {f:.0f} / {b:.0f} / {s:.0f} | "
                     f"{row['peak_rss_mib']:.0f} |")
    return "\n".join(lines)


def docs_section(meta: dict[str, Any], table_md: str, details_md: str, offload_md: str = "") -> str:
    hw = meta["hardware"]
    size = meta["model"]
    ds_adam = ("torch.optim.AdamW (`\"torch_adam\": true`)" if meta["ds_torch_adam"]
               else "its own CPU `FusedAdam` op (JIT-built C++ with g++/ninja on first use)")
    nice = f"; benchmark processes run at nice {meta['nice']} to shield them from other jobs" if meta["nice"] else ""
    stages = "/".join(map(str, meta.get("stages", [0, 1, 2])))
    offload = ""
    if meta.get("offload"):
        ds_offload = ("torch.optim.AdamW (`\"zero_force_ds_cpu_optimizer\": false`)" if meta["ds_torch_adam"]
                      else "its `DeepSpeedCPUAdam` (JIT-built AVX C++)")
        offload = (f"\n- Offload: `\"offload_optimizer\": {{\"device\": \"cpu\"}}` at stages 1-3, other keys at their "
                   f"defaults; partita steps the host partition with torch's fused AdamW, DeepSpeed with {ds_offload}; "
                   f"on a CPU-only machine the \"device\" is the host, so this measures offload's transfer "
                   f"machinery and host optimizer kernel, not PCIe traffic")
    return f"""
## CPU step time, ZeRO {stages}{' with and without optimizer offload' if meta.get('offload') else ''}, {meta['nproc']} processes — {meta['date']}

- Command: `{meta['command']}`
- partita commit: `{meta['partita_commit']}`; torch {meta['versions']['torch']}, DeepSpeed {meta['versions']['deepspeed']}, Python {meta['versions']['python']}
- Hardware: {hw.get('Model name', '?')}, {hw.get('CPU(s)', hw['nproc'])} cores ({hw.get('simd', '')}), {hw.get('memory_gib', '?')} GiB, hypervisor {hw.get('Hypervisor vendor', 'none')}; 1-min load average before the runs {meta['loadavg_start']:.1f}, after {meta['loadavg_end']:.1f}
- Model: reference GPT (`partita.models.gpt.GPT`), n_layer {size['n_layer']}, n_head {size['n_head']}, n_embd {size['n_embd']}, block {size['block_size']}, vocab {size['vocab_size']}, {meta['params'] / 1e6:.2f} M parameters; micro-batch {size['micro_batch']} per rank, fp32, AdamW (lr 3e-4, wd 0.1), gradient clipping 1.0, reduce/allgather buckets 5e8; stdlib byte corpus, same seed and windows for every engine
- Launch: `torchrun --nproc_per_node {meta['nproc']}`, gloo, OMP_NUM_THREADS=1; DeepSpeed with DS_ACCELERATOR=cpu and {ds_adam}; torch DDP with fused AdamW{offload}
- Timing: forward + backward + step between two barriers; {meta['warmup']} warm-up steps dropped; {meta['steps']} timed steps per launch, {meta['rounds']} interleaved rounds. ms/step = median step of the fastest round (other jobs on a shared machine only add time); ratio = median over rounds of partita/DeepSpeed from back-to-back launches; both leave out rounds during which other jobs took more than {100 * meta['max_foreign']:.0f}% of the CPUs (measured from /proc/stat); all rounds, with that share, below{nice}
- Raw results: `{meta['results_file']}`

{table_md}
{offload_md}
{details_md}
"""


def ensure_docs_header() -> None:
    if DOCS.exists():
        return
    DOCS.parent.mkdir(parents=True, exist_ok=True)
    DOCS.write_text(
        f"# Benchmark report, {dt.date.today().isoformat()}\n\n"
        "Sections appended by the scripts under `benchmarks/`, newest last; the current figures are in\n"
        "[docs/performance/index.md](../../docs/performance/index.md).\n"
    )


def main() -> None:
    args = parse_args()
    started = dt.datetime.now(dt.timezone.utc)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    log_dir = args.results_dir / f"logs-{started:%Y%m%dT%H%M%SZ}"
    log_dir.mkdir()

    engines = list(args.engines)
    skipped: dict[str, str] = {}
    if "partita" in engines and (err := partita_importable()):
        skipped["partita"] = err
        engines.remove("partita")
        print(f"partita skipped: {err}", flush=True)
    if "deepspeed" in engines and versions()["deepspeed"] == "not installed":
        skipped["deepspeed"] = "deepspeed is not installed in this environment"
        engines.remove("deepspeed")
        print("deepspeed skipped: not installed", flush=True)

    load_start = os.getloadavg()[0]
    runs: list[dict[str, Any]] = []
    for rnd in range(args.rounds):
        for stage in args.stages:
            order = [(e, v) for e in engines if not (e == "ddp" and stage != 0)
                     for v in variants_for(e, stage, args.offload)]
            k = rnd % max(len(order), 1)
            for engine, variant in order[k:] + order[:k]:  # rotate who goes first each round
                r = launch(engine, stage, variant, args, log_dir)
                r["round"] = rnd
                runs.append(r)
                status = f"{median_ms(r['step_s']):.1f} ms/step" if "error" not in r else r["error"]
                name = engine if variant == "none" else f"{engine} ({VARIANTS[variant][1]})"
                print(f"round {rnd} stage {stage} {name:9s} {status}  (other jobs used {100 * r['foreign_cpu']:.0f}% of the CPUs"
                      f"; waited {r['quiet_wait_s']:.0f} s for quiet)", flush=True)
                if "error" in r:
                    print("\n".join("    " + line for line in r["log_tail"][-15:]), flush=True)
                elif "teardown_error" in r:
                    print(f"    (measurement complete; exit {r['teardown_error']['exit']} while shutting down, "
                          f"log in {log_dir})", flush=True)

    table = summarize(runs, max_foreign=args.max_foreign)
    table_md, details_md = render_table(table, args.stages), render_details(table)
    offload_md = render_offload_cost(table, args.stages) if args.offload else ""
    ok = next((r for r in runs if "error" not in r), None)
    stamp = f"{started:%Y%m%dT%H%M%SZ}"
    results_file = args.results_dir / f"cpu_step_time-{stamp}.json"
    meta = {
        "date": f"{started:%Y-%m-%d %H:%M} UTC",
        "command": "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__, REPO)] + sys.argv[1:]),
        "partita_commit": git_commit(str(REPO)),
        "versions": versions(),
        "hardware": hardware_summary(),
        "model": size_dict(ModelSize()),
        "params": ok["params"] if ok else 0,
        "nproc": args.nproc, "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds,
        "ds_torch_adam": args.ds_torch_adam, "offload": args.offload, "stages": args.stages, "nice": args.nice, "max_foreign": args.max_foreign,
        "loadavg_start": load_start, "loadavg_end": os.getloadavg()[0],
        "skipped": skipped,
        "results_file": os.path.relpath(results_file, REPO),
    }
    results_file.write_text(json.dumps({"meta": meta, "runs": runs}, indent=1))
    if not any("error" in r or "teardown_error" in r for r in runs):
        shutil.rmtree(log_dir)  # worker logs only matter when a launch failed
    print()
    print(table_md)
    print()
    if offload_md:
        print(offload_md)
        print()
    print(details_md)
    for engine, err in skipped.items():
        print(f"\n{engine} not measured: {err}")
    print(f"\nresults: {results_file}")
    if not args.no_docs:
        ensure_docs_header()
        section = docs_section(meta, table_md, details_md, offload_md + "\n" if offload_md else "")
        if skipped:
            section += "\nNot measured: " + "; ".join(f"{e}: {err}" for e, err in skipped.items()) + "\n"
        with open(DOCS, "a") as f:
            f.write(section)
        print(f"appended to {DOCS}")


if __name__ == "__main__":
    main()
