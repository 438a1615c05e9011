"""AdamW vs AdamW8bit on the reference GPT (tiny preset) and the default corpus: loss curves.

    python benchmarks/eight_bit_loss_curve.py --steps 400          # ~3 min on one CPU core

Three runs through ``partita.initialize`` in one process, same config as
examples/configs/zero2.json except the optimizer type: AdamW (seed 0), AdamW8bit (seed 0)
and AdamW with another seed, whose gap to the first run measures the run-to-run noise the
8-bit curve is compared against. Writes docs/eight_bit_loss.png and docs/eight_bit_loss.json.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import os
import sys
import time

import torch

import partita
from partita.data import TokenWindowDataset, infinite_batches, load_corpus, split_train_val
from partita.models import GPT, GPTConfig
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ is not a package
from output_paths import output_file  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
RUNS = (("AdamW", 0), ("AdamW8bit", 0), ("AdamW", 1))


def config(kind: str, steps: int, seed: int) -> dict:
    base = json.loads((ROOT / "examples" / "configs" / "zero2.json").read_text())
    base["optimizer"]["type"] = kind
    base["scheduler"]["params"]["total_num_steps"] = steps
    base["seed"] = seed
    base["steps_per_print"] = 10**9
    return base


@torch.no_grad()
def val_loss(engine, data: TokenWindowDataset, windows: int = 64) -> float:
    engine.eval()
    picked = [i * len(data) // windows for i in range(windows)]
    x, y = (torch.stack(t) for t in zip(*(data[i] for i in picked)))
    loss = engine(x, y)[1].item()
    engine.train()
    return loss


def train(kind: str, seed: int, steps: int, train_data, val_data) -> dict:
    torch.manual_seed(seed)
    model = GPT(GPTConfig.tiny())
    engine, optimizer, loader, _ = partita.initialize(
        model=model,
        model_parameters=model.optimizer_param_groups(0.1),
        training_data=train_data,
        config=config(kind, steps, seed),
    )
    losses, vals = [], {0: val_loss(engine, val_data)}
    batches = infinite_batches(loader)
    start = time.perf_counter()
    while engine.global_steps < steps:
        x, y = next(batches)
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if engine.global_steps % 50 == 0:
            vals[engine.global_steps] = val_loss(engine, val_data)
    state = [s for s in optimizer.inner.state.values()]
    state_bytes = sum(t.numel() * t.element_size() for s in state for k, t in s.items()
                      if torch.is_tensor(t) and t.dim() > 0 and not k.startswith("qmap"))  # fmt: skip
    params = sum(g.master.numel() for g in optimizer.groups)
    return {"optimizer": kind, "seed": seed, "train_loss": losses, "val_loss": vals,
            "state_bytes_per_param": state_bytes / params, "wall_s": time.perf_counter() - start}  # fmt: skip


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--out", type=output_file, default=str(ROOT / "docs" / "eight_bit_loss"))
    parser.add_argument("--replot", action="store_true", help="redraw the PNG from the saved JSON")
    args = parser.parse_args(argv)
    if args.replot:
        plot(json.loads(pathlib.Path(args.out + ".json").read_text()), args.out + ".png")
        return
    torch.set_num_threads(1)
    train_tokens, val_tokens = split_train_val(load_corpus(), val_fraction=0.05)
    block = GPTConfig.tiny().block_size
    train_data, val_data = TokenWindowDataset(train_tokens, block), TokenWindowDataset(val_tokens, block)
    runs = [train(kind, seed, args.steps, train_data, val_data) for kind, seed in RUNS]
    for run in runs:
        tail = sum(run["train_loss"][-50:]) / 50
        print(f"{run['optimizer']:>9} seed {run['seed']}: train loss (mean of last 50) {tail:.4f} | val "
              + " ".join(f"{s}:{v:.4f}" for s, v in run["val_loss"].items())
              + f" | state {run['state_bytes_per_param']:.3f} B/param | {run['wall_s']:.0f} s")  # fmt: skip
    pathlib.Path(args.out + ".json").write_text(json.dumps(runs, indent=1) + "\n")
    plot(runs, args.out + ".png")


def plot(runs: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, zoom) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=110)
    for run, color in zip(runs, ("tab:blue", "tab:orange", "tab:gray")):
        label = f"{run['optimizer']} (seed {run['seed']})"
        losses = run["train_loss"]
        ema, smooth = losses[0], []
        for value in losses:  # exponential moving average, so the curves can be told apart
            ema = 0.95 * ema + 0.05 * value
            smooth.append(ema)
        steps = range(1, len(losses) + 1)
        val_steps, val = zip(*sorted((int(s), v) for s, v in run["val_loss"].items()))
        for axis in (ax, zoom):
            axis.plot(steps, losses, color=color, alpha=0.12, linewidth=0.8)
            axis.plot(steps, smooth, color=color, linewidth=1.6, label=f"{label}, train (EMA)")
            axis.plot(val_steps, val, "o--", color=color, markersize=4, linewidth=1, label=f"{label}, validation")
    half = len(runs[0]["train_loss"]) // 2
    zoom.set_xlim(half, len(runs[0]["train_loss"]) + 5)
    zoom.set_ylim(2.1, 2.8)
    zoom.set_title("second half, zoomed", fontsize=10)
    ax.set_title("Tiny GPT, stdlib corpus: AdamW vs AdamW8bit (bitsandbytes)", fontsize=10)
    ax.set_ylim(top=min(6.0, ax.get_ylim()[1]))
    for axis in (ax, zoom):
        axis.set_xlabel("optimizer step (batch 8 x 128 bytes)")
        axis.set_ylabel("cross-entropy (nats per byte)")
        axis.grid(alpha=0.3)
    zoom.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main(sys.argv[1:])
