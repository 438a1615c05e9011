"""ZeRO-Offload's critical path on one GPU, measured beside the engines it bounds (issue 17 item 4).

One run measures, on the machine it runs on:

1. The host: torch's fused AdamW over a large fp32 partition (what partita's offloaded step runs;
   28 bytes move per element: parameter, gradient and both moments read, three written), a
   STREAM-style copy and triad, and the fp32 -> bf16 cast of the upload, each scaled to the
   model's parameter count; and the same fused AdamW while the GPU copies into pinned memory
   (the download and the host step share the host's memory bandwidth).
2. PCIe: pinned host <-> device copies of 256 MiB, each way alone and both at once.
3. The engines, through ``benchmarks/gpu_throughput.py`` (each in its own process): partita
   without offload (the GPU compute of a step: its forward + backward), partita with the
   optimizer in CPU memory (exact and delayed update) and DeepSpeed with its CPU offload.

From these it writes the bound each offloaded step is held to:

- exact update: ``T_gpu + T_adam``. The step cannot start the host Adam before the global
  gradient norm (clipping) is known at the end of backward, and the next forward needs its
  result; the gradient download (``4 N`` bytes) overlaps backward and the upload (``2 N`` bytes
  of bf16) overlaps the host step bucket by bucket, so at best only those two are serial;
- exact update overlapped with the next forward (``overlap_step_with_forward``):
  ``T_bwd + max(T_adam, T_fwd)``: the forward runs while the host steps;
- delayed update (``-offd``; ``-offdo`` lands it beside the next forward): ``max(T_gpu, T_adam)``:
  the host step runs beside the next forward +
  backward, so the slower of the two sets the pace (the weights go up from the page-locked
  master in fp32 and are cast on the GPU, so the host casts nothing).

    python benchmarks/offload_critical_path.py --out $OUT/offload_critical_path.json
    python benchmarks/offload_critical_path.py --host-only       # the host/PCIe probes alone
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import best_seconds  # noqa: E402
from output_paths import output_file  # noqa: E402
GPT_1_3B_NUMEL = 1_315_819_520  # GPTConfig.gpt_1_3b(), embedding tied
PROBE_NUMEL = 256 * 2**20  # elements per host probe (1 GiB per fp32 tensor); times scale linearly
ENGINES = ("partita2", "partita2-off", "partita2-offo", "partita2-offd", "partita2-offdo", "deepspeed2-off")


def host_probe(numel: int, model_numel: int) -> dict:
    """Seconds for ``model_numel`` elements of each host kernel, and the bandwidth each reaches."""
    param, grad = torch.empty(numel).uniform_(), torch.empty(numel).uniform_()
    adam = torch.optim.AdamW([param], lr=1e-4, fused=True)
    param.grad = grad
    out, low = torch.empty(numel), torch.empty(numel, dtype=torch.bfloat16)
    scale = model_numel / numel
    kernels = {  # name: (callable, bytes moved per element)
        "fused_adamw": (adam.step, 28),
        "copy": (lambda: out.copy_(param), 8),
        "triad": (lambda: torch.add(param, grad, alpha=0.5, out=out), 12),
        "cast_fp32_to_bf16": (lambda: low.copy_(param), 6),
    }
    result = {"threads": torch.get_num_threads(), "cores": os.cpu_count(), "probe_numel": numel}
    for name, (fn, nbytes) in kernels.items():
        seconds = best_seconds(fn)
        result[name] = {"s_per_model": seconds * scale, "gb_per_s": nbytes * numel / seconds / 1e9}
    return result


def pcie_probe(nbytes: int = 256 * 2**20, reps: int = 20) -> dict:
    pinned_up = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    pinned_down = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dev_up, dev_down = torch.empty(nbytes, dtype=torch.uint8, device="cuda"), torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    up_stream, down_stream = torch.cuda.Stream(), torch.cuda.Stream()

    def timed(up: bool, down: bool) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(reps):
            if up:
                with torch.cuda.stream(up_stream):
                    dev_up.copy_(pinned_up, non_blocking=True)
            if down:
                with torch.cuda.stream(down_stream):
                    pinned_down.copy_(dev_down, non_blocking=True)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    timed(True, True)
    gib = reps * nbytes / 2**30
    both = timed(True, True)
    return {"h2d_gib_per_s": gib / timed(True, False), "d2h_gib_per_s": gib / timed(False, True),
            "both_ways_gib_per_s_each": gib / both}


def adam_under_download(numel: int, model_numel: int, seconds: float = 3.0) -> dict:
    """Fused AdamW on the host while the GPU streams into pinned memory without pause: how much
    each slows the other (they share the host's memory bandwidth)."""
    param, grad = torch.empty(numel).uniform_(), torch.empty(numel).uniform_()
    adam = torch.optim.AdamW([param], lr=1e-4, fused=True)
    param.grad = grad
    adam.step()
    chunk = 256 * 2**20
    pinned = torch.empty(chunk, dtype=torch.uint8).pin_memory()
    device = torch.empty(chunk, dtype=torch.uint8, device="cuda")
    stop, copied = threading.Event(), [0]

    def download() -> None:
        stream = torch.cuda.Stream()
        while not stop.is_set():
            with torch.cuda.stream(stream):
                for _ in range(8):
                    pinned.copy_(device, non_blocking=True)
            stream.synchronize()
            copied[0] += 8 * chunk

    worker = threading.Thread(target=download)
    start = time.perf_counter()
    worker.start()
    steps = 0
    while time.perf_counter() - start < seconds:
        adam.step()
        steps += 1
    elapsed = time.perf_counter() - start
    stop.set()
    worker.join()
    return {"fused_adamw_s_per_model": elapsed / steps * model_numel / numel,
            "d2h_gib_per_s": copied[0] / elapsed / 2**30}


def run_engines(engines: list[str], json_path: Path, steps: int, warmup: int, timeout: float) -> dict:
    cmd = [sys.executable, str(HERE / "gpu_throughput.py"), "--model", "gpt_1_3b", "--nproc", "1",
           "--engines", ",".join(engines), "--steps", str(steps), "--warmup", str(warmup),
           "--timeout", str(timeout), "--json", str(json_path)]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=False)
    saved = json.loads(json_path.read_text()) if json_path.exists() else {"results": []}
    return {r["engine"]: r for r in saved["results"]}


def bounds(host: dict, pcie: dict, engines: dict, model_numel: int) -> list[dict]:
    base = engines.get("partita2", {})
    if base.get("status") != "ok":
        return []
    gpu_s = (base["forward_ms"] + base["backward_ms"]) / 1e3
    adam_s = host["fused_adamw"]["s_per_model"]
    cast_s = host["cast_fp32_to_bf16"]["s_per_model"]
    tokens = base["tokens_per_step"] if "tokens_per_step" in base else base["tokens_per_s_per_gpu"] * base["step_ms"] / 1e3
    rows = []
    ds = engines.get("deepspeed2-off", {})
    ds_tps = ds.get("tokens_per_s_per_gpu") if ds.get("status") == "ok" else None
    fwd_s, bwd_s = base["forward_ms"] / 1e3, base["backward_ms"] / 1e3
    for name, bound_s, rule in (("partita2-off", gpu_s + adam_s, "T_gpu + T_adam"),
                                ("partita2-offo", bwd_s + max(adam_s, fwd_s), "T_bwd + max(T_adam, T_fwd)"),
                                ("partita2-offd", max(gpu_s, adam_s), "max(T_gpu, T_adam)"),
                                ("partita2-offdo", max(gpu_s, adam_s), "max(T_gpu, T_adam)")):
        r = engines.get(name, {})
        if r.get("status") != "ok":
            continue
        rows.append({
            "engine": name, "rule": rule, "bound_step_s": bound_s, "bound_tokens_per_s": tokens / bound_s,
            "measured_step_s": r["step_ms"] / 1e3, "measured_tokens_per_s": r["tokens_per_s_per_gpu"],
            "share_of_bound": (tokens / bound_s) and r["tokens_per_s_per_gpu"] / (tokens / bound_s),
            "vs_deepspeed": ds_tps and r["tokens_per_s_per_gpu"] / ds_tps,
            "bound_vs_deepspeed": ds_tps and tokens / bound_s / ds_tps,
            "phases_ms": {k: r[k] for k in ("forward_ms", "backward_ms", "optimizer_ms")},
            "peak_gib": r["peak_gib"],
        })
    rows.append({"engine": "(parts)", "T_gpu_s": gpu_s, "T_adam_s": adam_s, "T_cast_s": cast_s,
                 "T_d2h_grad_fp32_s": 4 * model_numel / (pcie["d2h_gib_per_s"] * 2**30),
                 "T_h2d_param_bf16_s": 2 * model_numel / (pcie["h2d_gib_per_s"] * 2**30)})
    return rows


def markdown(result: dict) -> str:
    lines = ["| engine | bound rule | bound tokens/s | measured tokens/s | share of bound | × DeepSpeed | bound × DeepSpeed | fwd / bwd / opt ms | peak GiB |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in result.get("bounds", []):
        if row["engine"] == "(parts)":
            continue
        ph = row["phases_ms"]
        fmt = lambda v: "—" if v is None else f"{v:.2f}×"  # noqa: E731
        lines.append(f"| {row['engine']} | {row['rule']} | {row['bound_tokens_per_s']:,.0f} | {row['measured_tokens_per_s']:,.0f} | "
                     f"{100 * row['share_of_bound']:.0f}% | {fmt(row['vs_deepspeed'])} | {fmt(row['bound_vs_deepspeed'])} | "
                     f"{ph['forward_ms']:.0f} / {ph['backward_ms']:.0f} / {ph['optimizer_ms']:.0f} | {row['peak_gib']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=output_file, default=None, help="JSON file for everything measured")
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per engine")
    parser.add_argument("--host-only", action="store_true", help="only the host (and PCIe, with a GPU) probes")
    parser.add_argument("--probe-numel", type=int, default=PROBE_NUMEL)
    args = parser.parse_args(argv)
    out = Path(args.out) if args.out else None
    result: dict = {"date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "torch": torch.__version__,
                    "model_numel": GPT_1_3B_NUMEL}

    def save() -> None:
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(result, indent=2) + "\n")

    result["host"] = host_probe(args.probe_numel, GPT_1_3B_NUMEL)
    print("host", json.dumps(result["host"]), flush=True)
    save()
    if torch.cuda.is_available():
        result["pcie"] = pcie_probe()
        result["adam_under_download"] = adam_under_download(args.probe_numel, GPT_1_3B_NUMEL)
        print("pcie", json.dumps(result["pcie"]), "\nadam under download", json.dumps(result["adam_under_download"]), flush=True)
        save()
    if args.host_only or not torch.cuda.is_available():
        return
    engines_json = (out.parent if out else Path("/tmp")) / "offload_critical_path_engines.json"
    result["engines"] = run_engines(args.engines.split(","), engines_json, args.steps, args.warmup, args.timeout)
    result["bounds"] = bounds(result["host"], result["pcie"], result["engines"], GPT_1_3B_NUMEL)
    save()
    print(json.dumps(result["bounds"], indent=1), flush=True)
    print(markdown(result), flush=True)


if __name__ == "__main__":
    main()
