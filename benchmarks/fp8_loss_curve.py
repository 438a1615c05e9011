"""FP8 against bf16 loss curves (issue 30): the reference GPT at 124M on the default corpus, the same
data order, compiled, bf16 vs FP8 tensorwise, in one invocation.

    python benchmarks/fp8_loss_curve.py --out $OUT/fp8_loss            # one H200, both runs ~4-5 min
    python benchmarks/fp8_loss_curve.py --tiny --out /tmp/fp8_loss     # CPU smoke test (emulated FP8)

Each run is its own process (a fresh compile and allocator; a failure or timeout of one is
recorded, and the other still runs), training ``GPTConfig.gpt_125m`` (d 768 x 12, vocabulary
50304) at sequence 1024 and micro-batch 8, **8,192 tokens per step** (3000 steps: 24.6 M tokens,
~2.1 passes over the 11.5 M-byte training split of the standard-library corpus), through
``partita.initialize`` at ZeRO-2 with ``bf16``, ``compile`` and, for the FP8 run,
``"fp8": {"enabled": true, "recipe": "tensorwise"}`` (torchao's auto-filter: the QKV, FC and
output-head linears; the two 768-wide output projections stay bf16). AdamW lr 6e-4, betas
0.9/0.95, weight decay 0.1, clipping 1.0, WarmupCosineLR (100 warm-up steps, down to 10%).
Both runs build the model from seed 0 and read the same windows in the same order (one fixed
permutation per pass, drawn from seed 1234), so any difference between the curves is FP8's.

Budget, from ~350 k tokens/s for 124M bf16 compiled on an H200: ~70 s of training per run
plus ~30-60 s of start-up and compile.

Written into ``--out`` (a directory):

- ``fp8_loss_curve.json``: per run the loss of every step, the mean of every 10 steps, the
  validation loss (64 fixed windows of the held-out 5%) at step 0, every ``--val-every`` steps and
  at the end, the final train loss (mean of the last 100 steps), the largest single-step spike
  (a step's loss above the mean of the 50 before it) and tokens/s; and the relative differences
  FP8 - bf16 of the final train and validation losses;
- ``fp8_loss_curve.png``: both curves, validation points, and FP8's relative gap to bf16;
- ``runs/<run>/``: partita's csv_monitor files (every 10 steps) and ``plot/loss.png`` drawn from
  them by ``partita plot`` (``partita.monitor.plot.plot_runs``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from common import git_commit  # noqa: E402
from output_paths import output_dir  # noqa: E402

RUNS = {"bf16": None, "fp8_tensorwise": "tensorwise"}
VAL_WINDOWS = 64
DATA_SEED = 1234


def _config(args: argparse.Namespace, recipe: str | None, run_dir: Path) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 10,  # the step log, and csv_monitor's rows, every 10 steps
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.95], "eps": 1e-8,
                                                  "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupCosineLR", "params": {
            "total_num_steps": args.steps, "warmup_num_steps": min(100, args.steps // 10), "warmup_type": "linear",
            "cos_min_ratio": 0.1}},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2},
        "compile": {"enabled": True, "backend": args.compile_backend},
        "csv_monitor": {"enabled": True, "output_path": str(run_dir.parent), "job_name": run_dir.name},
        "seed": 0,
    }
    if recipe is not None:
        cfg["fp8"] = {"enabled": True, "recipe": recipe}
        if args.tiny:  # the tiny model's linears are below torchao's auto-filter sizes; no FP8 kernels on CPU
            cfg["fp8"].update(emulate=True, filter=["blocks.*"])
    return cfg


def _order(n_windows: int, steps: int, micro_batch: int):
    """The window indices of every step: a fixed permutation per pass over the data, the same for every run."""
    import torch

    gen = torch.Generator().manual_seed(DATA_SEED)
    need, parts = steps * micro_batch, []
    while sum(len(p) for p in parts) < need:
        parts.append(torch.randperm(n_windows, generator=gen))
    return torch.cat(parts)[:need].view(steps, micro_batch)


def _val_loss(engine: Any, val_data: Any, micro_batch: int, device: Any) -> float:
    import torch

    picked = [i * len(val_data) // VAL_WINDOWS for i in range(VAL_WINDOWS)]
    engine.eval()
    total = 0.0
    with torch.no_grad():
        for lo in range(0, VAL_WINDOWS, micro_batch):  # micro-batch sized: the compiled shapes
            x, y = (torch.stack(t).to(device) for t in zip(*(val_data[i] for i in picked[lo:lo + micro_batch])))
            total += float(engine(x, y)[1]) * len(x)
    engine.train()
    return total / VAL_WINDOWS


def run_worker(args: argparse.Namespace) -> None:
    """One run: train ``args.run`` and rewrite ``<out>/<run>.json`` at every validation point."""
    import dataclasses

    import torch

    import partita
    from partita.data import TokenWindowDataset, load_corpus, split_train_val
    from partita.models import GPT, GPTConfig
    from partita.precision.fp8 import fp8_linears

    recipe = RUNS[args.run]
    device = torch.device("cpu" if args.tiny else "cuda")
    out = Path(args.out)
    run_dir = out / "runs" / args.run
    train_tokens, val_tokens = split_train_val(load_corpus(), val_fraction=0.05)
    train_data, val_data = TokenWindowDataset(train_tokens, args.seq), TokenWindowDataset(val_tokens, args.seq)
    order = _order(len(train_data), args.steps, args.micro_batch)
    torch.manual_seed(0)
    gpt = (GPTConfig(vocab_size=256, block_size=args.seq, n_layer=2, n_head=2, n_embd=64) if args.tiny
           else dataclasses.replace(GPTConfig.gpt_125m(), block_size=args.seq))
    with torch.device(device):
        model = GPT(gpt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, _, _, _ = partita.initialize(model=model, model_parameters=model.optimizer_param_groups(0.1),
                                             config=_config(args, recipe, run_dir))
    result: dict[str, Any] = {"run": args.run, "recipe": recipe, "fp8_linears": fp8_linears(engine.module),
                              "params": model.num_parameters(), "tokens_per_step": args.micro_batch * args.seq,
                              "val_loss": {}, "status": "running"}
    losses = torch.zeros(args.steps, device=device)  # every step's loss, read back without a sync per step

    def save(done: int) -> None:
        steps_loss = losses[:done].tolist()
        result["train_loss"] = steps_loss
        result["train_loss_every_10"] = [sum(steps_loss[i:i + 10]) / len(steps_loss[i:i + 10])
                                         for i in range(0, done, 10)]
        result["steps_done"] = done
        (out / f"{args.run}.json").write_text(json.dumps(result) + "\n")

    result["val_loss"]["0"] = _val_loss(engine, val_data, args.micro_batch, device)
    start = time.perf_counter()
    timed_from, timed_start = min(50, args.steps // 2), None  # tokens/s after the compile
    for step in range(args.steps):
        if step == timed_from:
            if device.type == "cuda":
                torch.cuda.synchronize()
            timed_start = time.perf_counter()
        x, y = (torch.stack(t) for t in zip(*(train_data[int(i)] for i in order[step])))
        _, loss = engine(x.to(device, non_blocking=True), y.to(device, non_blocking=True))
        engine.backward(loss)
        engine.step()
        losses[step] = loss.detach()
        if (step + 1) % args.val_every == 0 or step + 1 == args.steps:
            if timed_start is not None and step >= timed_from:  # includes the validation passes before it
                train_s = time.perf_counter() - timed_start
                result["tokens_per_s"] = (step + 1 - timed_from) * args.micro_batch * args.seq / train_s
            result["val_loss"][str(step + 1)] = _val_loss(engine, val_data, args.micro_batch, device)
            save(step + 1)
            print(f"{args.run} step {step + 1}: loss {float(losses[max(0, step - 9):step + 1].mean()):.4f} "
                  f"val {result['val_loss'][str(step + 1)]:.4f}", flush=True)
    result["wall_s"] = time.perf_counter() - start
    result["status"] = "ok"
    save(args.steps)


def _spike(losses: list[float], window: int = 50) -> dict[str, float] | None:
    """The largest rise of one step's loss over the mean of the ``window`` steps before it."""
    best = None
    for i in range(max(window, 100), len(losses)):
        rise = losses[i] - sum(losses[i - window:i]) / window
        if best is None or rise > best["rise"]:
            best = {"step": i + 1, "rise": rise}
    return best


def _summarise(runs: dict[str, dict]) -> dict[str, Any]:
    for run in runs.values():
        if run.get("train_loss"):
            tail = run["train_loss"][-100:]
            run["final_train_loss"] = sum(tail) / len(tail)
            run["final_val_loss"] = run["val_loss"][max(run["val_loss"], key=int)]
            run["largest_spike"] = _spike(run["train_loss"])
    summary: dict[str, Any] = {}
    bf16, fp8 = runs.get("bf16", {}), runs.get("fp8_tensorwise", {})
    if bf16.get("status") == "ok" and fp8.get("status") == "ok":
        for key in ("final_train_loss", "final_val_loss"):
            summary[f"relative_diff_{key.removeprefix('final_')}"] = (fp8[key] - bf16[key]) / bf16[key]
        summary["within_1_percent"] = all(abs(v) <= 0.01 for v in summary.values())
    return summary


def plot(runs: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, gap) = plt.subplots(2, 1, figsize=(9, 6.5), dpi=110, sharex=True, height_ratios=[3, 1.3])
    smooth: dict[str, list[float]] = {}
    for (name, run), color in zip(runs.items(), ("tab:blue", "tab:orange")):
        losses = run.get("train_loss") or []
        ema, smooth[name] = (losses[0] if losses else 0.0), []
        for value in losses:  # exponential moving average, so the two curves can be told apart
            ema = 0.98 * ema + 0.02 * value
            smooth[name].append(ema)
        steps = range(1, len(losses) + 1)
        ax.plot(steps, losses, color=color, alpha=0.15, linewidth=0.6)
        ax.plot(steps, smooth[name], color=color, linewidth=1.5, label=f"{name}, train (EMA 0.98)")
        val = sorted((int(s), v) for s, v in run.get("val_loss", {}).items())
        if val:
            ax.plot(*zip(*val), "o--", color=color, markersize=4, linewidth=1, label=f"{name}, validation")
    if len(smooth) == 2 and all(smooth.values()):
        a, b = smooth["bf16"], smooth["fp8_tensorwise"]
        n = min(len(a), len(b))
        gap.plot(range(1, n + 1), [100 * (b[i] - a[i]) / a[i] for i in range(n)], color="tab:red", linewidth=1.2)
        gap.axhline(0, color="black", linewidth=0.6)
        for bound in (-1, 1):
            gap.axhline(bound, color="gray", linestyle=":", linewidth=0.8)
    gap.set_ylabel("FP8 - bf16 (% of bf16, EMA)")
    gap.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats per byte)")
    ends = [curve[-1] for curve in smooth.values() if curve]
    if ends:  # the start of training (loss ~ln(vocabulary)) would flatten the part worth comparing
        low = min(min(run.get("train_loss") or ends) for run in runs.values())
        ax.set_ylim(bottom=0.97 * min(low, *ends), top=min(ax.get_ylim()[1], 1.6 * max(ends)))
    ax.set_title("reference GPT, standard-library corpus: bf16 vs FP8 tensorwise (torchao float8)", fontsize=10)
    ax.legend(fontsize=8)
    for axis in (ax, gap):
        axis.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)


def _run(name: str, args: argparse.Namespace, timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", f"--run={name}", f"--out={args.out}",
           f"--steps={args.steps}", f"--micro-batch={args.micro_batch}", f"--seq={args.seq}", f"--lr={args.lr}",
           f"--val-every={args.val_every}", f"--compile-backend={args.compile_backend}"] + ["--tiny"] * args.tiny
    env = dict(os.environ, **({"CUDA_VISIBLE_DEVICES": ""} if args.tiny else {}))
    saved = Path(args.out) / f"{name}.json"
    saved.unlink(missing_ok=True)
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True, cwd=REPO)
    status, tail = None, ""
    try:
        _, stderr = proc.communicate(timeout=timeout)
        tail = stderr[-3000:]
        if proc.returncode:
            status = f"failed (exit {proc.returncode})"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        tail = proc.communicate()[1][-3000:]
        status = f"timeout after {timeout:.0f} s"
    run = json.loads(saved.read_text()) if saved.exists() else {"run": name, "val_loss": {}}
    if status is not None:  # what was saved up to the last validation point stays, marked
        run.update(status=status, stderr_tail=tail)
        print(f"{name}: {status}\n{tail[-1500:]}", flush=True)
    return run


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default 3000; --tiny 40)")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default 1024; --tiny 64)")
    parser.add_argument("--lr", type=float, default=6e-4)
    parser.add_argument("--val-every", type=int, default=None, help="validation every N steps (default 500; --tiny 20)")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per run (default 240; a run cut short keeps its curve up to the last validation)")
    parser.add_argument("--compile-backend", default="inductor")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test: a 2-layer model, emulated FP8")
    parser.add_argument("--out", type=output_dir, required=True, help="directory for the JSON, the plots and the runs")
    parser.add_argument("--replot", action="store_true", help="redraw the plots from --out's fp8_loss_curve.json")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--run", choices=tuple(RUNS), default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.steps = args.steps or (40 if args.tiny else 3000)
    args.seq = args.seq or (64 if args.tiny else 1024)
    args.val_every = args.val_every or (20 if args.tiny else 500)
    if min(args.steps, args.micro_batch, args.seq, args.val_every) < 1:
        parser.error("--steps, --micro-batch, --seq and --val-every must be >= 1")
    if args.worker:
        run_worker(args)
        return
    out = Path(args.out)
    if args.replot:
        saved = json.loads((out / "fp8_loss_curve.json").read_text())
        plot(saved["runs"], out / "fp8_loss_curve.png")
        return
    runs = {name: _run(name, args, args.timeout) for name in RUNS}
    summary = _summarise(runs)
    meta = {"commit": git_commit(str(REPO)), "command": "python benchmarks/fp8_loss_curve.py " + " ".join(argv),
            "tokens_per_step": args.micro_batch * args.seq, "steps": args.steps, "micro_batch": args.micro_batch,
            "seq": args.seq, "lr": args.lr, "data_seed": DATA_SEED, "tiny": args.tiny}
    try:
        import torch
        import torchao

        meta["versions"] = {"torch": torch.__version__, "torchao": torchao.__version__,
                            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() and not args.tiny else None}
    except ImportError:
        pass
    (out / "fp8_loss_curve.json").write_text(json.dumps({"meta": meta, "summary": summary, "runs": runs}) + "\n")
    plot(runs, out / "fp8_loss_curve.png")
    from partita.monitor.plot import plot_runs

    dirs = [out / "runs" / name for name in RUNS if (out / "runs" / name).is_dir()]
    written = plot_runs(dirs, out / "runs" / "plot") if dirs else []
    for name, run in runs.items():
        print(f"{name}: {run.get('status')}, final train {run.get('final_train_loss')}, final val "
              f"{run.get('final_val_loss')}, tokens/s {run.get('tokens_per_s')}, spike {run.get('largest_spike')}, "
              f"FP8 linears {len(run.get('fp8_linears', []))}")
    print("summary:", json.dumps(summary))
    print("wrote", out / "fp8_loss_curve.json", out / "fp8_loss_curve.png", *written)


if __name__ == "__main__":
    main()
