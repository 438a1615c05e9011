"""FP8 training speed on one H200 (issue 30): partita bf16 against partita FP8 (torchao float8,
tensorwise and rowwise) against FSDP2 + torchao ``convert_to_float8_training``, side by side.

Every setting runs in its own torchrun job (a fresh process: clean allocator, its own compile),
with a per-setting timeout; an OOM, crash or timeout is recorded in the table and the next
setting runs. Every setting is compiled per block with bf16 compute, AdamW (fused), clipping 1.0,
the same model, seed and random tokens. Settings (``--settings``, comma-separated):

    partita_bf16              partita, the existing suite's fastest compiled setting for the shape
    partita_fp8_tensorwise    the same + "fp8": {"enabled": true, "recipe": "tensorwise"}
    partita_fp8_rowwise       the same + "fp8": {"enabled": true, "recipe": "rowwise"}
    fsdp2_fp8_tensorwise      fully_shard per block + root, torchao convert_to_float8_training
                              (tensorwise, torchao's auto-filter), torch.compile per block
    fsdp2_bf16                the same without FP8: the anchor
    partita_bf16_z3           partita bf16 at ZeRO-3 (the all-gather variant's bytes peer at 1.3B)
    partita_fp8_allgather     ZeRO-3 + "fp8": {..., "all_gather": true}; needs --nproc >= 2 (one
                              rank gathers nothing), with the gathered bytes of one step

Shapes (``--shape``): ``1.3b`` = GPTConfig.gpt_1_3b at sequence 1024, micro-batch 8, ZeRO-2 (the
throughput suite's fastest compiled partita setting, partita2c); ``6.7b`` = GPTConfig.gpt_7b
(d 4096 x 32) at sequence 2048, micro-batch 2, ZeRO-3, every block checkpointed (the memory
breakdown's 6.7B setting: 101 GiB at micro-batch 1, so 2 leaves ~30 GiB free). The first five
settings are the default.

Per setting: tokens/s, step s, peak allocated GiB (max over ranks), the loss of the last step,
how many linears run in FP8 (and their names in the JSON), setup and first-step seconds (the
compile), versions; speedups against partita bf16 and against FSDP2 + torchao of the same shape.
With several ranks each partita setting adds one untimed step with the comms logger on, whose
bytes per collective land in the JSON (the all-gather variant's wire against bf16's).

On one H200 (device commands; ``--budget-s`` stops launching settings that could not finish in
time, so the JSON written after every setting is complete when the call's limit comes):

    python benchmarks/fp8_gpu.py --shape 1.3b --budget-s 540 --out $OUT/fp8_gpu_1_3b.json
    python benchmarks/fp8_gpu.py --shape 6.7b --settings partita_bf16,partita_fp8_tensorwise,partita_fp8_rowwise \\
        --budget-s 540 --out $OUT/fp8_gpu_6_7b_a.json
    python benchmarks/fp8_gpu.py --shape 6.7b --settings fsdp2_fp8_tensorwise,fsdp2_bf16 --budget-s 540 \\
        --out $OUT/fp8_gpu_6_7b_b.json
    python benchmarks/fp8_gpu.py --from-json fp8_gpu_6_7b_a.json fp8_gpu_6_7b_b.json --out fp8_gpu_6_7b.json

CPU smoke test (torchao's emulation, a 2-layer model, gloo; every path of the GPU run):

    python benchmarks/fp8_gpu.py --tiny --shape both --out /tmp/fp8_tiny.json
    python benchmarks/fp8_gpu.py --tiny --shape 6.7b --nproc 2 --settings partita_bf16,partita_fp8_allgather
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from common import git_commit  # noqa: E402
from output_paths import output_file  # noqa: E402

SETTINGS: dict[str, dict[str, Any]] = {
    "partita_bf16": {"family": "partita", "recipe": None},
    "partita_fp8_tensorwise": {"family": "partita", "recipe": "tensorwise"},
    "partita_fp8_rowwise": {"family": "partita", "recipe": "rowwise"},
    "fsdp2_fp8_tensorwise": {"family": "fsdp2", "recipe": "tensorwise"},
    "fsdp2_bf16": {"family": "fsdp2", "recipe": None},
    "partita_bf16_z3": {"family": "partita", "recipe": None, "stage": 3},
    "partita_fp8_allgather": {"family": "partita", "recipe": "tensorwise", "all_gather": True, "stage": 3},
}
DEFAULT_SETTINGS = "partita_bf16,partita_fp8_tensorwise,partita_fp8_rowwise,fsdp2_fp8_tensorwise,fsdp2_bf16"
# Per shape: the model preset, its partita setting and how long to run. Steps are few because the
# compile (~30-60 s at 1.3B, ~60-100 s at 6.7B per process) dominates each job's time.
SHAPES: dict[str, dict[str, Any]] = {
    "1.3b": {"preset": "gpt_1_3b", "micro_batch": 8, "seq": 1024, "stage": 2, "checkpoint": False,
             "steps": 20, "warmup": 3, "timeout": 170},
    "6.7b": {"preset": "gpt_7b", "micro_batch": 2, "seq": 2048, "stage": 3, "checkpoint": True,
             "steps": 12, "warmup": 3, "timeout": 260},
}
TINY = {"micro_batch": 2, "seq": 64, "steps": 2, "warmup": 1, "timeout": 600}
BF16, FSDP_FP8 = "partita_bf16", "fsdp2_fp8_tensorwise"


def _settings(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SETTINGS]
    if unknown or not names:
        raise ValueError(f"--settings {text!r}: unknown {unknown or 'empty list'}; choose from {', '.join(SETTINGS)}")
    return list(dict.fromkeys(names))


def _plan(shape: str, args: argparse.Namespace) -> dict[str, Any]:
    """The run parameters of one shape: the shape's own, then --tiny's, then explicit options."""
    plan = dict(SHAPES[shape])
    if args.tiny:
        plan.update(TINY)
    for key in ("micro_batch", "seq", "steps", "warmup", "timeout"):
        if getattr(args, key) is not None:
            plan[key] = getattr(args, key)
    return plan


def _run_setting(name: str, shape: str, plan: dict[str, Any], args: argparse.Namespace, timeout: float) -> dict:
    spec = SETTINGS[name]
    base = {"setting": name, "shape": shape, "world": args.nproc}
    if spec.get("all_gather") and args.nproc < 2:
        return {**base, "status": "skipped",
                "error": "one rank gathers nothing (ZeRO-3 at world size 1 casts its own master); run with --nproc 2"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           str(Path(__file__).resolve()), "--worker", f"--setting={name}", f"--shape={shape}",
           f"--micro-batch={plan['micro_batch']}", f"--seq={plan['seq']}", f"--steps={plan['steps']}",
           f"--warmup={plan['warmup']}", f"--compile-backend={args.compile_backend}"]
    cmd += ["--tiny"] * args.tiny
    env = dict(os.environ)
    if args.tiny:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU path also on a machine with GPUs
    started = time.perf_counter()
    # Own session: a timeout kills torchrun and its ranks, nothing else.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True, cwd=REPO)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        return {**base, "status": "timeout", "wall_s": time.perf_counter() - started,
                "error": f"no result within {timeout:.0f} s", "stderr_tail": stderr[-2000:]}
    wall = time.perf_counter() - started
    lines = [json.loads(ln[len("RESULT "):]) for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    if oom := [r for r in lines if r.get("status") == "oom"]:
        return {**max(oom, key=lambda r: r.get("peak_gib") or 0.0), "wall_s": wall}
    if ok := [r for r in lines if r.get("status") == "ok"]:
        return {**ok[-1], "wall_s": wall, **({"exit_code": proc.returncode} if proc.returncode else {})}
    return {**base, "status": "failed", "exit_code": proc.returncode, "wall_s": wall,
            "error": _exception_line(stderr), "stderr_tail": stderr[-3000:]}


_EXCEPTION = re.compile(r"^(\[rank\d+\]:\s*)?([A-Za-z_][\w.]*(Error|Exception)\b.*)$")


def _exception_line(stderr: str) -> str:
    """The worker's own exception, not torchrun's closing ChildFailedError report."""
    found = [m.group(2) for ln in stderr.splitlines() if (m := _EXCEPTION.match(ln)) and "ChildFailedError" not in ln]
    if found:
        return found[0][:400]
    tail = [ln for ln in stderr.splitlines() if ln.strip()]
    return tail[-1][:400] if tail else "no output"


def _ratio(a: dict | None, b: dict | None) -> float | None:
    if not a or not b or a.get("status") != "ok" or b.get("status") != "ok":
        return None
    return a["tokens_per_s"] / b["tokens_per_s"]


def _with_ratios(results: list[dict]) -> list[dict]:
    """Each ok row's tokens/s over partita bf16's and over FSDP2 + torchao's (same shape, same world)."""
    index = {(r["shape"], r["world"], r["setting"]): r for r in results}
    out = []
    for r in results:
        key = (r["shape"], r["world"])
        out.append({**r, "vs_partita_bf16": _ratio(r, index.get((*key, BF16))),
                    "vs_fsdp2_torchao": _ratio(r, index.get((*key, FSDP_FP8)))})
    return out


def _gather_bytes(r: dict) -> int | None:
    comm = r.get("comm_bytes_per_step")
    return None if comm is None else sum(v for k, v in comm.items() if k.startswith("all_gather_into_tensor"))


def report(meta: dict[str, Any], results: list[dict]) -> str:
    """The markdown section: one table per shape and world, then the all-gather bytes if measured."""
    rows = _with_ratios(results)
    lines = [f"## FP8 training speed ({meta['date_utc']}, partita {meta['commit']})", "",
             f"- Command(s): {'; '.join('`' + c + '`' for c in meta['commands'])}",
             f"- Versions: {json.dumps(meta.get('versions') or {})}", ""]

    def fmt(value: Any, spec: str) -> str:
        return "—" if value is None else format(value, spec)

    for shape, world in dict.fromkeys((r["shape"], r["world"]) for r in rows):
        group = [r for r in rows if r["shape"] == shape and r["world"] == world]
        first = next((r for r in group if r["status"] == "ok"), {})
        lines += [f"### {shape}, {world} rank(s): micro-batch {first.get('micro_batch', '?')}, sequence "
                  f"{first.get('seq', '?')}, checkpointed {first.get('checkpointed', '?')}", "",
                  "| setting | status | tokens/s/GPU | step s | peak GiB | last loss | FP8 linears | vs partita bf16 "
                  "| vs FSDP2+torchao | setup + first step s |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in group:
            if r["status"] != "ok":
                lines.append(f"| {r['setting']} | {r['status']}: {str(r.get('error', ''))[:120]} | | | "
                             f"{fmt(r.get('peak_gib'), '.2f')} | | | | | |")
                continue
            lines.append(
                f"| {r['setting']} | ok | {r['tokens_per_s'] / r['world']:,.0f} | {r['step_s']:.3f} | {r['peak_gib']:.2f} "
                f"| {r['last_loss']:.4f} | {r['fp8_linears']}/{r['linears']} | {fmt(r['vs_partita_bf16'], '.3f')} "
                f"| {fmt(r['vs_fsdp2_torchao'], '.3f')} | {r['setup_s']:.0f} + {fmt(r['first_step_s'], '.0f')} |")
        lines.append("")
        counted = {r["setting"]: r for r in group if r["status"] == "ok" and _gather_bytes(r) is not None}
        ag = counted.get("partita_fp8_allgather")
        peer = counted.get("partita_bf16_z3") or (counted.get(BF16) if (counted.get(BF16) or {}).get("zero_stage") == 3 else None)
        if counted:
            lines += ["All-gather bytes of one step (comms logger, per rank):", ""]
            lines += [f"- {n}: {_gather_bytes(r):,} B" for n, r in counted.items()]
            if ag and peer:
                lines.append(f"- FP8 all-gather / bf16 ZeRO-3 ({peer['setting']}): {_gather_bytes(ag) / _gather_bytes(peer):.3f}")
            lines.append("")
    return "\n".join(lines)


def _write(path: str, meta: dict, results: list[dict]) -> None:
    Path(path).write_text(json.dumps({"meta": meta, "results": _with_ratios(results)}, indent=1) + "\n")
    Path(path).with_suffix(".md").write_text(report(meta, results) + "\n")


def _merge(paths: list[str]) -> tuple[dict, list[dict]]:
    metas, merged = [], {}
    for path in paths:
        saved = json.loads(Path(path).read_text())
        if not isinstance(saved, dict) or "meta" not in saved or "results" not in saved:
            raise ValueError(f"{path} is not a JSON file written by fp8_gpu.py --out (no 'meta'/'results')")
        metas.append(saved["meta"])
        for r in saved["results"]:  # a later file's row for the same setting replaces an earlier one
            merged[(r["shape"], r["world"], r["setting"])] = {k: v for k, v in r.items() if not k.startswith("vs_")}
    meta = {**metas[-1], "commands": [c for m in metas for c in m["commands"]],
            "commit": ", ".join(dict.fromkeys(m["commit"] for m in metas)),
            "date_utc": ", ".join(dict.fromkeys(m["date_utc"] for m in metas))}
    return meta, list(merged.values())


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=("1.3b", "6.7b", "both"), default="1.3b")
    parser.add_argument("--settings", default=DEFAULT_SETTINGS, help=f"comma-separated (default {DEFAULT_SETTINGS})")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 20 at 1.3B, 12 at 6.7B)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first, compile included (default 3)")
    parser.add_argument("--micro-batch", type=int, default=None, help="default 8 at 1.3B, 2 at 6.7B")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default 1024 at 1.3B, 2048 at 6.7B)")
    parser.add_argument("--nproc", type=int, default=1, help="ranks per setting (default 1; the all-gather variant needs 2+)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per setting (default 170 at 1.3B, 260 at 6.7B)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="seconds for the whole call: a setting gets at most what is left, none if under 30 s")
    parser.add_argument("--compile-backend", default="inductor")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test: 2-layer model, emulated FP8, gloo")
    parser.add_argument("--out", type=output_file, default=None, help="JSON results (rewritten after every setting; a .md beside it)")
    parser.add_argument("--from-json", nargs="+", default=None, metavar="JSON", help="merge saved --out files into --out")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--setting", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        from _fp8_gpu_worker import run_worker

        plan = SHAPES[args.shape]
        args.preset, args.checkpoint = plan["preset"], plan["checkpoint"]
        run_worker(args, {"stage": plan["stage"], **SETTINGS[args.setting]})
        return
    if args.from_json:
        if not args.out:
            parser.error("--from-json needs --out (where the merged JSON and table go)")
        try:
            meta, results = _merge(args.from_json)
        except (ValueError, OSError) as exc:
            parser.error(str(exc))
        _write(args.out, meta, results)
        print(report(meta, results))
        return
    try:
        names = _settings(args.settings)
    except ValueError as exc:
        parser.error(str(exc))
    for key in ("steps", "micro_batch", "seq", "nproc"):
        if getattr(args, key) is not None and getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be >= 1")
    if args.warmup is not None and args.warmup < 1:
        parser.error("--warmup must be >= 1: the first step compiles, and a timed compile is no step time")
    shapes = ["1.3b", "6.7b"] if args.shape == "both" else [args.shape]
    meta = {"date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "commit": git_commit(str(REPO)), "commands": ["python benchmarks/fp8_gpu.py " + " ".join(argv)],
            "tiny": args.tiny, "versions": None}
    results: list[dict] = []
    begun = time.perf_counter()
    for shape in shapes:
        plan = _plan(shape, args)
        for name in names:
            timeout = plan["timeout"]
            if args.budget_s is not None:
                left = args.budget_s - (time.perf_counter() - begun)
                if left < 30:
                    results.append({"setting": name, "shape": shape, "world": args.nproc, "status": "skipped",
                                    "error": f"--budget-s {args.budget_s:.0f} spent"})
                    print(f"{shape} {name}: skipped (budget spent)", flush=True)
                    continue
                timeout = min(timeout, left - 10)
            r = _run_setting(name, shape, plan, args, timeout)
            results.append(r)
            meta["versions"] = meta["versions"] or r.get("versions")
            if r["status"] == "ok":
                print(f"{shape} {name}: {r['tokens_per_s'] / r['world']:,.0f} tokens/s/GPU, step {r['step_s']:.3f} s, "
                      f"peak {r['peak_gib']:.2f} GiB, loss {r['last_loss']:.4f}, {r['fp8_linears']}/{r['linears']} "
                      f"linears FP8, setup {r['setup_s']:.0f} s + first step {r['first_step_s']:.0f} s, "
                      f"job {r['wall_s']:.0f} s", flush=True)
            else:
                print(f"{shape} {name}: {r['status'].upper()}: {r.get('error')}", flush=True)
                if r.get("stderr_tail"):
                    print(r["stderr_tail"][-1500:], flush=True)
            if args.out:
                _write(args.out, meta, results)
    print(report(meta, results), flush=True)


if __name__ == "__main__":
    main()
