"""Facts that go next to every figure of the throughput suite (date, hardware, versions, the
exact command, the commit and whether the tree was dirty) and the markdown section appended to a
dated report, benchmarks/results/<date>-report.md (docs/performance/index.md lists them).

The hardware is probed in a short-lived subprocess: initializing CUDA in the driver would keep
a CUDA context (hundreds of MiB) on GPU 0 for the whole suite, memory the measured engines
would then lack.
"""

from __future__ import annotations

import datetime as dt
import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from _suite_table import (
    HEADERS, SCALING_HEADERS, Result, add_ratios, failure_notes, render_markdown, render_text,
    scaling_rows, table_rows,
)
from common import git_commit, hardware_summary

_PROBE = r"""
import dataclasses, importlib.metadata, importlib.util, json, platform, sys
import torch
sys.path.insert(0, sys.argv[2])
from partita.models.gpt import GPTConfig
out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
       "model_shape": dataclasses.asdict(getattr(GPTConfig, sys.argv[1])())}
if torch.cuda.is_available():
    props = torch.cuda.get_device_properties(0)
    out.update(device_count=torch.cuda.device_count(), device_name=torch.cuda.get_device_name(0),
               device_total_gib=props.total_memory / 2**30)
    try:
        out["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())
    except Exception as exc:  # a torch without NCCL still runs one-GPU engines
        out["nccl"] = f"unavailable ({exc})"
else:
    out["device_count"] = 0
try:
    out["deepspeed"] = importlib.metadata.version("deepspeed") if importlib.util.find_spec("deepspeed") else None
except Exception:
    out["deepspeed"] = None
print(json.dumps(out))
"""


def probe_environment(model: str, repo: Path) -> dict[str, Any]:
    """Versions, accelerators and the model's shape, read in a separate interpreter."""
    proc = subprocess.run([sys.executable, "-c", _PROBE, model, str(repo)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"probing the environment failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_metadata(*, args: Any, argv: list[str], env: dict[str, Any], repo: Path, nprocs: list[int]) -> dict[str, Any]:
    """Everything a reader needs to reproduce or discount a figure."""
    commit = git_commit(str(repo))
    if args.device == "cuda":
        hardware = f"{env['device_count']} × {env['device_name']} ({env['device_total_gib']:.1f} GiB each)"
    else:
        cpu = hardware_summary()
        hardware = f"{cpu.get('Model name', cpu['machine'])}, {cpu['nproc']} cores" + (
            f", {cpu['memory_gib']} GiB" if "memory_gib" in cpu else "")
    return {
        "date_utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commands": ["python " + shlex.join(argv)],
        "commit": commit.removesuffix("+dirty"),
        "dirty": commit.endswith("+dirty"),
        "device": args.device,
        "hardware": hardware,
        "python": env["python"], "torch": env["torch"], "cuda": env.get("cuda"), "nccl": env.get("nccl"),
        "deepspeed": env.get("deepspeed"),
        "model": args.model, "model_shape": env["model_shape"],
        "micro_batch": args.micro_batch, "warmup": args.warmup, "steps": args.steps, "bucket": args.bucket,
        "peak_tflops": args.peak_tflops if args.device == "cuda" else None,
        "nproc": nprocs,
    }


def by_world(results: list[Result]) -> dict[int, list[Result]]:
    """Results grouped by rank count, each group with its ratios (ratios only compare engines
    measured at the same rank count)."""
    worlds: dict[int, list[Result]] = {}
    for r in results:
        worlds.setdefault(r["world"], []).append(r)
    return {world: add_ratios(group) for world, group in sorted(worlds.items())}


def console_report(grouped: dict[int, list[Result]]) -> str:
    parts = []
    for world, group in grouped.items():
        parts.append(f"\n{world} rank(s):\n" + render_text(HEADERS, table_rows(group)))
        parts += [f"  {note}" for note in failure_notes(group)]
    flat = [r for group in grouped.values() for r in group]
    if rows := scaling_rows(flat):
        parts.append("\nscaling (per-GPU tokens/s at N ÷ at 1):\n" + render_text(SCALING_HEADERS, rows))
    return "\n".join(parts)


def _legend(meta: dict[str, Any]) -> str:
    if meta["device"] == "cuda":
        timing = ("fwd / bwd / opt ms: GPU time (CUDA events) of the forward, the backward and the optimizer "
                  "step (clipping + update + zeroing; `engine.step()` for partita and DeepSpeed), mean over the "
                  "timed steps on rank 0")
        memory = "peak GiB: `torch.cuda.max_memory_allocated()` during the timed steps, max over ranks"
        mfu = (f"MFU: tokens/s/GPU × training FLOPs per token (6N + 12·L·d·T) ÷ {meta['peak_tflops']:g} "
               "dense bf16 TFLOP/s")
    else:
        timing = ("fwd / bwd / opt ms: host time of the forward, the backward and the optimizer step, mean over "
                  "the timed steps on rank 0")
        memory = "peak GiB: peak resident memory (RSS) of a rank process over the whole run, max over ranks"
        mfu = "MFU: not computed on CPU (no peak FLOP/s to compare with)"
    return (
        f"tokens/s/GPU: tokens of all ranks per second ÷ ranks. {mfu}. step ms: wall time of a timed step. "
        f"{timing}. {memory}. Ratio columns: row ÷ peer, same run and rank count (tok/s > 1: the row is faster; "
        "mem < 1: it needs less memory); compiled rows are compared with `fsdp2c` / `torchc` and have no "
        "DeepSpeed ratio (no compiled DeepSpeed in the suite); offload rows with `deepspeed<stage>-off`; "
        "— where the peer was not run or did not finish."
    )


def docs_section(meta: dict[str, Any], grouped: dict[int, list[Result]], *, json_path: str | None) -> str:
    """The dated markdown section for a report under benchmarks/results/."""
    shape = meta["model_shape"]
    params = next((r["params"] for g in grouped.values() for r in g if r.get("params")), None)
    where = meta["hardware"] if meta["device"] == "cuda" else f"CPU ({meta['hardware']})"
    commit = (f"`{meta['commit']}` with uncommitted changes to tracked files (the figures are for that working "
              "tree)" if meta["dirty"] else f"`{meta['commit']}` (clean tree)")
    versions = f"torch {meta['torch']}"
    if meta["device"] == "cuda":
        versions += f" (CUDA {meta['cuda']}, NCCL {meta['nccl']})"
    versions += f", DeepSpeed {meta['deepspeed'] or 'not installed'}, Python {meta['python']}"
    precision = "bf16" if meta["device"] == "cuda" else "fp32"
    lines = [
        f"## Throughput suite: {meta['model']} on {where} — {meta['date_utc']}",
        "",
        "- Command" + ("s (tables merged with --from-json)" if len(meta["commands"]) > 1 else "") + ": "
        + "; ".join(f"`{c}`" for c in meta["commands"]),
        f"- partita commit: {commit}",
        f"- Hardware: {where}; {versions}",
        f"- Model: `{meta['model']}` (n_layer {shape['n_layer']}, n_head {shape['n_head']}, n_embd {shape['n_embd']}, "
        f"vocab {shape['vocab_size']}, sequence {shape['block_size']})"
        + (f", {params / 1e6:,.1f} M parameters" if params else "")
        + f"; micro-batch {meta['micro_batch']} per rank, {precision}, AdamW (lr 3e-4, betas 0.9/0.95, wd 0.1, "
        f"torch fused), clipping 1.0, buckets {meta['bucket']:.0e}, random tokens; {meta['warmup']} warm-up + "
        f"{meta['steps']} timed steps; one torchrun job per engine",
    ]
    if json_path:
        lines.append(f"- Raw results: `{json_path}`")
    for world, group in grouped.items():
        lines += ["", f"{world} rank(s):", "", render_markdown(HEADERS, table_rows(group))]
        if notes := failure_notes(group):
            lines += [""] + [f"- {note}" for note in notes]
    flat = [r for group in grouped.values() for r in group]
    if rows := scaling_rows(flat):
        lines += ["", "Scaling, per-GPU tokens/s at N ÷ at 1:", "", render_markdown(SCALING_HEADERS, rows)]
    lines += ["", _legend(meta), ""]
    return "\n".join(lines)


def append_docs(path: Path, section: str) -> None:
    """Append ``section`` after a blank line (sections are appended, newest last)."""
    existing = path.read_text() if path.exists() else ""
    if not existing or existing.endswith("\n\n"):
        sep = ""
    else:
        sep = "\n" if existing.endswith("\n") else "\n\n"
    with path.open("a") as f:
        f.write(sep + section)
