"""Side-by-side throughput suite: the reference GPT trained with partita at ZeRO 0-3, DeepSpeed
at the same stages, torch FSDP2 (``fully_shard`` per block) and plain torch (DDP on several
GPUs), eager and compiled, in one run; prints one table per rank count and optionally writes
the raw results as JSON and appends a dated section to a report
(``--append-docs benchmarks/results/<date>-report.md``; docs/performance/index.md lists them).

Each engine runs in its own torchrun job (fresh process, fresh CUDA memory), on the same model,
data and optimizer settings: bf16, AdamW (torch's fused kernel for every engine), gradient
clipping 1.0, no gradient accumulation. Engine names (benchmarks/_suite_engines.py):

    torch, fsdp2                  plain torch (autocast; DDP on several GPUs), FSDP2
    partita0..3, deepspeed0..3    ZeRO stage 0-3
    ...c                          torch.compile per block (torchc, fsdp2c, partita2c; not DeepSpeed)
    partitaN-off, deepspeedN-off  optimizer offloaded to CPU memory
    partitaN-offd                 the same with partita's one-step-delayed update

``--suite`` runs the full list: torch, torchc, fsdp2, fsdp2c, partita0..3, partita0c..3c,
deepspeed0..3 (``--offload`` adds partita2-off, partita2-offd, deepspeed2-off). An engine that
does not fit is reported as OOM with the memory at failure, one whose library is missing as
skipped; neither stops the suite.

Table: tokens/s per GPU, MFU (against 989 dense bf16 TFLOP/s, ``--peak-tflops``), step ms, the
forward / backward / optimizer-step split (CUDA events), peak GiB, and tokens/s and memory ratios
to FSDP2, to DeepSpeed at the same stage and to plain torch — compiled rows against the compiled
peers, offload rows against DeepSpeed's offload. ``--nproc 1,2`` measures both rank counts and adds
a scaling table.

Next GPU session (DeepSpeed 0.19.8 installed in the benchmark environment):

    # one H200
    python benchmarks/gpu_throughput.py --suite --model gpt_125m --nproc 1 \\
        --json benchmarks/results/suite_gpt_125m_1gpu.json --append-docs benchmarks/results/$(date +%F)-report.md
    python benchmarks/gpu_throughput.py --suite --offload --model gpt_1_3b --nproc 1 \\
        --json benchmarks/results/suite_gpt_1_3b_1gpu.json --append-docs benchmarks/results/$(date +%F)-report.md
    # two H200: GPT-1.3B at 1 and 2 GPUs (scaling), GPT-7B at ZeRO-3 (micro-batch 2 fits 2 x 141 GB)
    python benchmarks/gpu_throughput.py --suite --model gpt_1_3b --nproc 1,2 \\
        --json benchmarks/results/suite_gpt_1_3b_2gpu.json --append-docs benchmarks/results/$(date +%F)-report.md
    python benchmarks/gpu_throughput.py --model gpt_7b --micro-batch 2 --nproc 2 \\
        --engines fsdp2,fsdp2c,partita3,partita3c,deepspeed3,partita2 \\
        --json benchmarks/results/suite_gpt_7b_2gpu.json --append-docs benchmarks/results/$(date +%F)-report.md

A command cut short by a time limit keeps what finished: ``--json`` is rewritten after every
engine, and ``--from-json a.json b.json --append-docs benchmarks/results/$(date +%F)-report.md`` rebuilds the tables
(and the docs section) from saved runs of the same commit, model and hardware without running
anything.

CPU smoke mode (no GPU; exercises naming, timing, ratios, the OOM path and the docs section):

    python benchmarks/gpu_throughput.py --device cpu --model tiny --nproc 2 --steps 3 --warmup 1 \\
        --engines torch,fsdp2,partita2,partita3,deepspeed2 --simulate-oom-engine fsdp2
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from _suite_engines import EngineNameError, parse_engine, suite_engines  # noqa: E402
from _suite_table import Result  # noqa: E402
from output_paths import output_file  # noqa: E402

DEFAULT_ENGINES = "torch,fsdp2,partita0,partita1,partita2,deepspeed1,deepspeed2"
PEAK_TFLOPS = 989.0  # H100/H200 SXM dense bf16
MODELS = ("tiny", "gpt2_124m", "gpt_125m", "gpt_1_3b", "gpt_7b")  # GPTConfig presets without arguments


def _parse_nproc(text: str, device: str, visible: int) -> list[int]:
    """``--nproc``: a rank count, a comma list of them, or ``all`` (every visible GPU)."""
    counts = []
    for part in text.split(","):
        if part == "all":
            if device != "cuda":
                raise ValueError("--nproc all counts GPUs; with --device cpu give a number of processes, e.g. --nproc 2")
            counts.append(visible)
        elif part.isdigit() and int(part) >= 1:
            counts.append(int(part))
        else:
            raise ValueError(f"--nproc {text!r}: {part!r} is not a positive rank count; use e.g. 1, 2, 1,2 or all")
    if device == "cuda":
        if visible == 0:
            raise ValueError("no CUDA device is visible; use --device cpu for the smoke mode")
        if (too_many := [n for n in counts if n > visible]):
            raise ValueError(f"--nproc {text!r} asks for {max(too_many)} GPUs but {visible} are visible; "
                             f"use at most {visible} (or --nproc all)")
    return list(dict.fromkeys(counts))  # keep order, drop repeats


def _engine_names(args: argparse.Namespace) -> list[str]:
    if args.suite and args.engines:
        raise ValueError("give --suite or --engines, not both (--suite is the full list)")
    if args.offload and not args.suite:
        raise ValueError("--offload extends --suite; with --engines name the offload engines, e.g. partita2-off")
    names = suite_engines(offload=args.offload) if args.suite else (args.engines or DEFAULT_ENGINES).split(",")
    for name in names:
        parse_engine(name)  # every name checked before the first launch
    if args.simulate_oom_engine and args.simulate_oom_engine not in names:
        raise ValueError(f"--simulate-oom-engine {args.simulate_oom_engine!r} is not among the engines {names}")
    return names


def _run_engine(engine: str, world: int, args: argparse.Namespace) -> Result:
    """One torchrun job; its RESULT line(s) turned into one result dict."""
    spec = parse_engine(engine)
    if spec.family == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        return {"engine": engine, "world": world, "status": "skipped",
                "error": f"deepspeed is not importable by {sys.executable}; install deepspeed==0.19.8 there"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
           str(Path(__file__).resolve()), "--worker", f"--engine={engine}", f"--model={args.model}",
           f"--device={args.device}", f"--micro-batch={args.micro_batch}", f"--steps={args.steps}",
           f"--warmup={args.warmup}", f"--bucket={args.bucket}", f"--peak-tflops={args.peak_tflops}"]
    if args.simulate_oom_engine:
        cmd.append(f"--simulate-oom-engine={args.simulate_oom_engine}")
    env = dict(os.environ)
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # the same CPU code path on a machine that has GPUs
        if spec.family == "deepspeed":
            env["DS_ACCELERATOR"] = "cpu"
    # Own session: on a timeout the whole job (torchrun and its ranks) is killed, nothing else.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True, cwd=REPO)
    try:
        stdout, stderr = proc.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        return {"engine": engine, "world": world, "status": "timeout",
                "error": f"no result within --timeout {args.timeout} s", "traceback": stderr[-3000:]}
    lines = [json.loads(ln[len("RESULT "):]) for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    if oom := [r for r in lines if r.get("status") == "oom"]:
        # Several ranks may run out; report the one that had the most allocated when it failed.
        return max(oom, key=lambda r: r["memory_at_failure_gib"] or 0.0)
    if ok := [r for r in lines if r.get("status") == "ok"]:
        return ok[-1] if proc.returncode == 0 else {**ok[-1], "exit_code": proc.returncode}
    summary, context = _error_summary(stderr)
    return {"engine": engine, "world": world, "status": "failed", "exit_code": proc.returncode,
            "error": summary, "traceback": context}


_RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s?")
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b:?")


def _error_summary(stderr: str) -> tuple[str, str]:
    """The worker's own exception line and the traceback above it, out of a torchrun stderr
    whose last lines are torchrun's report ("ChildFailedError ... FAILED"), not the cause."""
    lines = [_RANK_PREFIX.sub("", ln) for ln in stderr.splitlines()]
    for index, line in enumerate(lines):
        if _EXCEPTION_LINE.match(line) and "ChildFailedError" not in line:
            start = max((i for i in range(index + 1) if lines[i].startswith("Traceback")), default=max(0, index - 30))
            # Messages that list problems continue on indented lines (partita's ConfigError).
            end = index + 1
            while end < len(lines) and end - index <= 6 and lines[end].startswith((" ", "\t")):
                end += 1
            summary = " ".join(ln.strip() for ln in lines[index:end])
            return summary, "\n".join(lines[start:end])
    tail = [ln for ln in lines if ln.strip() and not set(ln.strip()) <= set("=-")]
    return (tail[-1] if tail else "no output"), "\n".join(lines[-40:])


def _progress_line(r: Result) -> str:
    if r["status"] != "ok":
        detail = f" ({r['peak_gib']:.2f} GiB peak)" if r["status"] == "oom" and r.get("peak_gib") is not None else ""
        return f"{r['engine']:>14} x{r['world']}: {r['status'].upper()}{detail}"
    mfu = "" if r["mfu"] is None else f"  MFU {100 * r['mfu']:5.1f}%"
    return (f"{r['engine']:>14} x{r['world']}: {r['tokens_per_s_per_gpu']:10,.0f} tokens/s/GPU{mfu}  "
            f"step {r['step_ms']:7.1f} ms (fwd {r['forward_ms']:.1f} / bwd {r['backward_ms']:.1f} / "
            f"opt {r['optimizer_ms']:.1f})  peak {r['peak_gib']:6.2f} GiB  loss {r['final_loss']:.3f}")


def _merge_saved(paths: list[str]) -> tuple[dict[str, Any], list[Result]]:
    """Meta and results of several ``--json`` files of one commit, model and machine; a later
    file's result for the same engine and rank count replaces an earlier one."""
    metas, merged = [], {}
    for path in paths:
        saved = json.loads(Path(path).read_text())
        if not isinstance(saved, dict) or "meta" not in saved or "results" not in saved:
            raise ValueError(f"{path} is not a results file of this script (no 'meta'/'results'); "
                             "pass files written by --json")
        metas.append(saved["meta"])
        for r in saved["results"]:
            merged[(r["engine"], r["world"])] = {k: v for k, v in r.items() if k != "ratios"}
    for key in ("commit", "model", "device", "hardware", "micro_batch", "steps", "warmup"):
        if len({json.dumps(m[key]) for m in metas}) > 1:
            raise ValueError(f"--from-json files differ in {key}: {[m[key] for m in metas]}; "
                             "one table must compare engines measured under the same conditions")
    meta = dict(metas[0])
    meta["commands"] = [c for m in metas for c in m["commands"]]
    meta["dirty"] = any(m["dirty"] for m in metas)
    dates = sorted({m["date_utc"] for m in metas})
    meta["date_utc"] = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"
    meta["nproc"] = sorted({r["world"] for r in merged.values()})
    return meta, list(merged.values())


def _report(meta: dict[str, Any], results: list[Result], args: argparse.Namespace) -> None:
    from _suite_report import append_docs, by_world, console_report, docs_section

    grouped = by_world(results)
    print(console_report(grouped), flush=True)
    if args.json:
        _write_json(args.json, meta, [r for g in grouped.values() for r in g])
    if args.append_docs:
        append_docs(Path(args.append_docs), docs_section(meta, grouped, json_path=args.json))
        print(f"\nappended a section to {args.append_docs}", flush=True)


def _write_json(path: str, meta: dict[str, Any], results: list[Result]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt_1_3b", choices=MODELS, help="a GPTConfig preset (default gpt_1_3b)")
    parser.add_argument("--engines", default=None, help=f"comma-separated engine names (default {DEFAULT_ENGINES})")
    parser.add_argument("--suite", action="store_true", help="every engine of the issue's side-by-side list")
    parser.add_argument("--offload", action="store_true", help="with --suite: add partita2-off, partita2-offd, deepspeed2-off")
    parser.add_argument("--nproc", default="1", help="ranks per job: N, a list like 1,2, or all (default 1)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: fp32 over gloo, the smoke mode for machines without a GPU")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--bucket", type=int, default=500_000_000)
    parser.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS, help="the GPU's dense bf16 TFLOP/s for MFU")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds one engine's job may take")
    parser.add_argument("--json", type=output_file, default=None, help="write meta + raw results here (rewritten after every engine)")
    parser.add_argument("--append-docs", default=None, help="append a dated markdown section to this file")
    parser.add_argument("--from-json", nargs="+", default=None, metavar="JSON",
                        help="build the tables from saved --json files instead of running")
    parser.add_argument("--simulate-oom-engine", default=None,
                        help="make this engine's last rank raise torch.OutOfMemoryError (tests the OOM path)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--engine", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv[1:])
    if args.worker:
        from _suite_worker import run_worker

        run_worker(args)
        return
    if args.engine:
        parser.error("--engine is internal to the worker; name engines with --engines a,b,c")
    if args.from_json:
        try:
            meta, results = _merge_saved(args.from_json)
        except ValueError as exc:
            parser.error(str(exc))
        _report(meta, results, args)
        return
    for name in ("micro_batch", "steps", "warmup"):
        if getattr(args, name) < (0 if name == "warmup" else 1):
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)} must be {'>= 0' if name == 'warmup' else '>= 1'}")
    from _suite_report import probe_environment, run_metadata

    try:
        engines = _engine_names(args)
        env = probe_environment(args.model, REPO)
        nprocs = _parse_nproc(args.nproc, args.device, env["device_count"])
    except (EngineNameError, ValueError) as exc:
        parser.error(str(exc))
    except RuntimeError as exc:  # the probe could not even import torch/partita or the model preset
        parser.error(str(exc))
    meta = run_metadata(args=args, argv=argv, env=env, repo=REPO, nprocs=nprocs)
    results: list[Result] = []
    for world in nprocs:
        for engine in engines:
            result = _run_engine(engine, world, args)
            results.append(result)
            print(_progress_line(result), flush=True)
            if result["status"] == "failed":
                print(result["traceback"], flush=True)
            elif result["status"] == "timeout":
                print(result["error"], flush=True)
            if args.json:
                _write_json(args.json, meta, results)
    _report(meta, results, args)


if __name__ == "__main__":
    main()
